"""Settings declared once: a dataclass field's default, type, help, parser and flag, from which the command line's
flags and the docs' flag reference are generated.

    dtype: str = knob("auto", "compute", "compute dtype", choices=("auto", *DTYPES))

A field made with `knob` carries a Knob in its metadata. `add_flags` adds one argparse flag per knob of a dataclass,
in argument groups; every flag defaults to None, so that `from_args` passes only what the user gave and the
dataclass's own default (where None means "the planner decides") stands for the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from offload.common import environment
from offload.common.sizes import parse_size

# the knob groups, in the order --help and the flag reference list them
GROUPS = {
    "server": "HTTP server",
    "budgets": "memory budgets (SIZE: 512MiB, 8GiB, 2GB or bytes)",
    "kv": "KV cache",
    "experts": "mixture-of-experts streaming",
    "scheduler": "scheduler",
    "io": "I/O",
    "compute": "compute",
    "sampling": "sampling defaults",
}


_NUMBERS = {"int": int, "float": float}  # a field annotated so takes its flag's value as that number


@dataclass(frozen=True, slots=True)
class Knob:
    """How one setting reads on the command line and in the docs."""

    group: str  # a key of GROUPS
    help: str  # one line, for --help
    doc: str = ""  # what the flag reference adds to `help`
    flag: str = ""  # "" = --field-name
    size: bool = False  # read with parse_size (a number of bytes)
    choices: tuple = ()
    metavar: str | None = None
    repeat: bool = False  # a tuple field; the flag may be given several times
    default_text: str = ""  # how the reference and --help state the default ("" = from the value)

    def __post_init__(self) -> None:
        if self.group not in GROUPS:
            raise ValueError(f"knob group {self.group!r} is not one of {', '.join(GROUPS)}")


def knob(default: Any, group: str, help: str, **kw: Any) -> Any:
    """A dataclass field with its command-line declaration (see Knob)."""
    return dataclasses.field(default=default, metadata={"knob": Knob(group, help, **kw)})


def knobs(cls: type) -> list[tuple[dataclasses.Field, Knob]]:
    """The fields of dataclass `cls` that carry a Knob, in declaration order."""
    return [(f, f.metadata["knob"]) for f in dataclasses.fields(cls) if "knob" in f.metadata]


def flag_name(f: dataclasses.Field, k: Knob) -> str:
    if k.flag:
        return k.flag
    name = "--" + f.name.replace("_", "-")
    return name.replace("--", "--no-", 1) if f.default is True else name


def default_text(f: dataclasses.Field, k: Knob) -> str:
    """The default as --help and the reference state it (a default-on switch's flag turns it off and states none)."""
    if k.default_text:
        return k.default_text
    if f.default is None:
        return "the planner decides"
    if f.default is False:
        return "off"
    return "none" if k.repeat else str(f.default)


def add_flags(parser: argparse.ArgumentParser, cls: type, groups: dict[str, Any] | None = None) -> dict[str, Any]:
    """One flag per knob of `cls`, in the argument group of its Knob (created in `parser` where `groups` lacks it).
    Returns the groups, so that several dataclasses share them."""
    groups = {} if groups is None else groups
    for f, k in knobs(cls):
        if k.group not in groups:
            groups[k.group] = parser.add_argument_group(GROUPS[k.group])
        negated = f.default is True and not k.flag  # the flag turns a default-on knob off
        choices = f"{'|'.join(map(str, k.choices))}; " if k.choices and k.metavar else ""
        help_line = f"do not {k.help}" if negated else f"{k.help} ({choices}default: {default_text(f, k)})"
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": help_line}
        if isinstance(f.default, bool):
            kw["action"] = "store_const"
            kw["const"] = not f.default
        elif k.repeat:
            kw |= {"action": "append", "metavar": k.metavar or "TEXT"} | ({"type": int} if "int" in str(f.type) else {})
        else:
            kind = _NUMBERS.get(str(f.type).split("|")[0].strip()) if not k.size else None
            if kind is not None and not k.choices:
                kw["type"] = kind
            elif k.choices and all(isinstance(c, int) for c in k.choices):
                kw["type"] = int
            if k.choices:
                kw["choices"] = k.choices
                kw["metavar"] = k.metavar or "{" + ",".join(map(str, k.choices)) + "}"
            else:
                kw["metavar"] = k.metavar or ("SIZE" if k.size else None)
        action = groups[k.group].add_argument(flag_name(f, k), **kw)
        action.doc = k.doc  # what the flag reference adds
    return groups


def given(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of `cls` the user set on the command line, read as the fields take them (sizes in bytes)."""
    out: dict[str, Any] = {}
    for f, k in knobs(cls):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        if k.size:
            value = parse_size(value, flag_name(f, k))
        elif k.repeat:
            value = tuple(value)
        out[f.name] = value
    return out


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """An instance of `cls` from the flags add_flags declared."""
    return cls(**given(cls, args))


def reference(parser: argparse.ArgumentParser) -> str:
    """The flag reference (Markdown) of every subcommand of `parser`: one table per argument group."""
    lines = [
        "# Flag reference",
        "",
        "Generated from the declarations (`offload/common/config.py`, `offload/server/settings.py`, `offload/cli.py`)",
        "by `make docs`; a test fails when this file and the code differ. Sizes read as 512MiB, 8GiB, 2GB or a number",
        "of bytes.",
    ]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        lines += ["", f"## offload {name}", "", p.description or "", ""]
        for group in p._action_groups:
            actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
            if not actions:
                continue
            title = group.title if group.title not in ("options", "optional arguments") else "general"
            lines += [f"### {title}", "", "| flag | what it sets |", "| --- | --- |"]
            for a in actions:
                flag = a.option_strings[-1]
                if a.metavar is not None:
                    flag += f" {a.metavar}"
                elif a.choices:
                    flag += " {" + ",".join(map(str, a.choices)) + "}"
                elif a.nargs != 0:
                    flag += " " + a.dest.upper()
                text = (a.help or "").replace("|", "\\|")
                if a.required:
                    text += " (required)"
                if doc := getattr(a, "doc", ""):
                    text += ". " + doc.replace("|", "\\|")
                lines.append(f"| `{flag}` | {text} |")
            lines.append("")
        while lines[-1] == "":
            lines.pop()
    lines += ["", *environment.reference()]
    return "\n".join(lines) + "\n"


def to_flags(cls: type, value: Any) -> list[str]:
    """The flags that give `value` (an instance of dataclass `cls`) back through add_flags and from_args: one for
    each knob whose value is not its default, sizes in bytes."""
    flags: list[str] = []
    for f, k in knobs(cls):
        v = getattr(value, f.name)
        if v == f.default:
            continue
        name = flag_name(f, k)
        if isinstance(f.default, bool):
            flags.append(name)
        elif k.repeat:
            for item in v:
                flags += [name, str(item)]
        elif k.size:
            flags += [name, exact_size(v)]
        else:
            flags += [name, str(v)]
    return flags


def exact_size(nbytes: int) -> str:
    """A size as parse_size reads it back exactly: GiB or MiB where whole, else bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if nbytes and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)
