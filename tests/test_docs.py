"""The docs against the code: every `offload ...` command in README.md and docs/*.md parses with the CLI as it is,
every repository file they link to or name in a code span exists, and the README stays a front door.

A renamed or removed flag, a moved file or a dropped section heading fails here, not in a reader's terminal.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from offload.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300
# written by a generator, not by hand: a link to one is checked by test_generated_docs_present
GENERATED = {ROOT / "docs" / "flags.md"}
SUBCOMMANDS = ("generate", "serve", "batch", "eval", "probe", "convert", "plan")

SHELL_LANGUAGES = {"", "sh", "bash", "console", "shell"}
FENCE = re.compile(r"^```(\S*)\s*$")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# tokens that end the command argparse sees: pipes, lists, redirections, background
SHELL_OPERATORS = re.compile(r"^(\||\|\||&&|;|&|\d?>>?|<|\d?>&\d)$|^\d?>")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
TOP_FOLDERS = ("offload", "tiers", "kernels", "scheduler", "benchmarks", "tests", "configs", "docs")
REPO_PATH = re.compile(rf"^(?:{'|'.join(TOP_FOLDERS)})/[\w./-]*$")
BENCHMARK_FILE = re.compile(r"(?<![\w/])benchmarks/[\w/.-]+\.(?:py|json|sh)\b")


def fenced_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced code block, in order."""
    blocks, language, lines = [], None, []
    for line in text.splitlines():
        match = FENCE.match(line.strip())
        if language is None:
            if match:
                language, lines = match.group(1).lower(), []
        elif line.strip() == "```":
            blocks.append((language, lines))
            language = None
        else:
            lines.append(line)
    assert language is None, "a code fence is never closed"
    return blocks


def shell_lines(lines: list[str]) -> list[str]:
    """The block's commands, backslash continuations joined and a leading `$ ` prompt dropped."""
    commands, pending = [], ""
    for line in lines:
        line = line.strip()
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        line = (pending + line).strip()
        pending = ""
        commands.append(line.removeprefix("$ ").strip())
    if pending:
        commands.append(pending.strip())
    return [c for c in commands if c]


def offload_argv(command: str) -> list[str] | None:
    """The arguments after `offload` (or a path ending in /offload, such as .venv/bin/offload), or None when the
    command runs something else. Environment assignments before it and shell operators after it are dropped."""
    tokens = shlex.split(command, comments=True)
    while tokens and ENV_ASSIGNMENT.match(tokens[0]):
        tokens.pop(0)
    if not tokens or not (tokens[0] == "offload" or tokens[0].endswith("/offload")):
        return None
    argv = []
    for token in tokens[1:]:
        if SHELL_OPERATORS.match(token):
            break
        argv.append(token)
    return argv


def doc_commands() -> list[tuple[str, str, list[str]]]:
    """(doc name, command as written, argv) of every offload command in a shell code block of the docs."""
    found = []
    for doc in DOCS:
        for language, lines in fenced_blocks(doc.read_text()):
            if language not in SHELL_LANGUAGES:
                continue
            for command in shell_lines(lines):
                argv = offload_argv(command)
                if argv is not None:
                    found.append((doc.relative_to(ROOT).as_posix(), command, argv))
    return found


COMMANDS = doc_commands()


def test_the_docs_show_every_subcommand():
    shown = {argv[0] for _, _, argv in COMMANDS if argv and not argv[0].startswith("-")}
    shown |= {argv[1] for _, _, argv in COMMANDS if len(argv) > 1 and argv[0] == "--debug"}
    assert set(SUBCOMMANDS) <= shown, f"no example of {sorted(set(SUBCOMMANDS) - shown)}"
    assert any(doc == "README.md" for doc, _, _ in COMMANDS)


@pytest.mark.parametrize("doc, command, argv", COMMANDS, ids=[f"{d}: {c[:60]}" for d, c, _ in COMMANDS])
def test_command_parses(doc, command, argv):
    parser = build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on a bad flag, 0 after --help
        assert exc.code == 0, f"{doc}: `{command}` does not parse:\n{err.getvalue()}"


def test_offload_argv_reads_commands_as_the_shell_does():
    assert offload_argv("TRITON_INTERPRET=1 .venv/bin/offload plan --model x  # a comment") == ["plan", "--model", "x"]
    assert offload_argv("offload generate --prompt 'a b' > out.txt") == ["generate", "--prompt", "a b"]
    assert offload_argv(".venv/bin/python benchmarks/moe.py") is None
    assert shell_lines(["$ offload generate \\", "    --prompt x", "", "make demo"]) == [
        "offload generate --prompt x",
        "make demo",
    ]


def test_a_removed_flag_fails_to_parse():
    with pytest.raises(SystemExit) as exc, contextlib.redirect_stderr(io.StringIO()):
        build_parser().parse_args(["generate", "--no-such-flag"])
    assert exc.value.code == 2


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    outside_code = strip_fenced(doc.read_text())
    found, seen = set(), {}
    for line in outside_code.splitlines():
        if line.startswith("#"):
            anchor = github_anchor(line.lstrip("#"))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def strip_fenced(text: str) -> str:
    return re.sub(r"^```.*?^```\s*$", "", text, flags=re.S | re.M)


def link_targets(doc: Path) -> list[str]:
    return [t for t in LINK.findall(strip_fenced(doc.read_text())) if not re.match(r"^[a-z]+:", t)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_links_resolve(doc):
    broken = []
    for target in link_targets(doc):
        path_part, _, anchor = target.partition("#")
        path = (doc.parent / path_part).resolve() if path_part else doc
        if path in GENERATED and not path.exists():
            continue
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{doc.name}: " + "; ".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_named_files_exist(doc):
    text = doc.read_text()
    named = {span for span in CODE_SPAN.findall(strip_fenced(text)) if REPO_PATH.match(span) and "*" not in span}
    named |= set(BENCHMARK_FILE.findall(text))
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


def test_generated_docs_present():
    linked = {(doc.parent / t.partition("#")[0]).resolve() for doc in DOCS for t in link_targets(doc)}
    absent = sorted(p.relative_to(ROOT).as_posix() for p in GENERATED & linked if not p.exists())
    if absent:
        pytest.skip(f"linked but not generated yet: {absent}")


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    assert not any(re.search(r"\d\d:\d\d(-\d\d:\d\d)? UTC", line) for line in lines), "dated runs go to benchmarks.md"
