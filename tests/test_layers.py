"""The architecture's layers, checked over the source: every import points down or sideways, never up, and no
two modules import each other, directly or through others (lazy imports inside functions count too).

The layers, bottom first, as docs/ARCHITECTURE.md draws them. A module belongs to the first layer whose prefix
names it (the longest prefix wins); everything under offload/ not claimed by a lower layer is the face.

Packages form no cycle either: collapsed to its units (the package that holds a module, down to the rooms of a
folder such as offload.tiers.kv or offload.scheduler.cost, and each of offload's own top-level modules, such as
offload.api), the graph is still acyclic, so no two packages import each other even where no two of their modules do.

No two modules share a name, wherever they are: a name says which module it is.

A tier has one name, offload/common/tier.py's Tier: no bare "device", "host" or "nvme" string in the source outside
the places NOT_TIERS lists (wire formats, other enumerations that spell the same words).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# each source folder and the package it installs as (offload/kernels, offload/tiers and offload/scheduler link them)
PACKAGES = {
    "offload": "offload",
    "kernels": "offload.kernels",
    "tiers": "offload.tiers",
    "scheduler": "offload.scheduler",
}
LAYERS = (
    ("common", ("offload.common",)),
    ("kernels", ("offload.kernels",)),
    ("tiers", ("offload.tiers",)),
    ("scheduler", ("offload.scheduler",)),
    ("model", ("offload.model",)),
    ("planner", ("offload.planner",)),
    ("core", ("offload.core",)),
    ("face", ("offload",)),
)
# what each layer may not touch at all, whatever its place: the scheduler decides without tensors or files
FORBIDDEN = {"scheduler": ("torch", "os", "pathlib", "safetensors")}


def module_name(path: Path) -> str:
    folder, *parts = path.relative_to(ROOT).with_suffix("").parts
    parts = [PACKAGES[folder], *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules() -> dict[str, Path]:
    found = {}
    for folder in PACKAGES:
        for p in sorted((ROOT / folder).rglob("*.py")):
            if not any(part.is_symlink() for part in [p, *p.parents] if ROOT in part.parents):
                found[module_name(p)] = p
    return found


def layer_of(module: str) -> int:
    """The index of `module`'s layer: the layer with the longest prefix of it."""
    best, best_len = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best < 0:
        raise AssertionError(f"{module} is in no layer")
    return best


def imports(path: Path, known: set[str]) -> set[str]:
    """The project's modules `path` imports anywhere in it (a `from package import name` of a submodule counts
    as importing the submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def external_imports(path: Path) -> set[str]:
    """Top-level names of everything `path` imports that is not relative."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Each import from a module into a higher layer, as a readable line."""
    return [
        f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
        for m, targets in sorted(graph.items())
        for t in sorted(targets)
        if layer_of(t) > layer_of(m)
    ]


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """Each cycle a depth-first walk of `graph` closes, as "a -> b -> a"."""
    found = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                found.append(" -> ".join([*path[path.index(t) :], t]))
            elif t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def unit_of(module: str) -> str:
    """The unit `module` belongs to: the package that holds it, two levels below offload at most
    (offload.tiers.io.base: offload.tiers.io; offload.tiers.copy: offload.tiers; offload.batch.job: offload.batch),
    or itself for offload's own top-level modules and offload."""
    parts = module.split(".")
    if len(parts) <= 2:
        return module
    return ".".join(parts[: min(len(parts) - 1, 3)])


def collapse(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """`graph` with each module replaced by its unit; imports within a unit are left out."""
    units: dict[str, set[str]] = {}
    for m, targets in graph.items():
        units.setdefault(unit_of(m), set()).update(unit_of(t) for t in targets)
    return {u: targets - {u} for u, targets in units.items()}


MODULES = source_modules()
# a package's __init__ is its own module: importing offload.tiers.io.base does not run offload.tiers.io's code on our
# behalf
GRAPH = {m: imports(p, set(MODULES)) - {m} for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    assert {m: layer_of(m) for m in MODULES}  # raises for a module outside every layer
    assert layer_of("offload.api") == len(LAYERS) - 1
    assert layer_of("offload.common.errors") == 0
    assert layer_of("offload.model.engine") == 4


def test_no_import_points_up():
    bad = upward(GRAPH)
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    bad = cycles(GRAPH)
    assert not bad, "\n".join(bad)


def test_no_import_cycles_between_packages():
    bad = cycles(collapse(GRAPH))
    assert not bad, "\n".join(bad)


def test_the_checks_catch_what_they_look_for():
    assert upward({"offload.tiers.weights.weight_store": {"offload.model.registry"}}) == [
        "offload.tiers.weights.weight_store (tiers) imports offload.model.registry (model)"
    ]
    assert (
        upward({"offload.api": {"offload.tiers.kv.kv_cache"}, "offload.tiers.kv.kv_cache": {"offload.tiers.io.base"}})
        == []
    )
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a -> b -> c -> a"]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    # no two modules import each other here, but their packages do
    planted = {
        "offload.batch.job_files": {"offload.server.protocol"},
        "offload.server.batches": {"offload.batch.job_files", "offload.server.front"},
        "offload.server.protocol": {"offload.core"},
        "offload.tiers.io.base": set(),
        "offload.tiers.kv.kv_cache": {"offload.tiers.io.base"},
    }
    assert cycles(planted) == []
    assert collapse(planted) == {
        "offload.batch": {"offload.server"},
        "offload.server": {"offload.batch", "offload.core"},
        "offload.tiers.io": set(),
        "offload.tiers.kv": {"offload.tiers.io"},
    }
    assert cycles(collapse(planted)) == ["offload.batch -> offload.server -> offload.batch"]
    units = ("offload", "offload.api", "offload.tiers.io.base", "offload.tiers.copy", "offload.kernels.linear")
    assert [unit_of(m) for m in units] == [
        "offload",
        "offload.api",
        "offload.tiers.io",
        "offload.tiers",
        "offload.kernels",
    ]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_forbidden_dependencies(layer: str):
    index = [name for name, _ in LAYERS].index(layer)
    bad = [
        f"{m} imports {name}"
        for m, p in sorted(MODULES.items())
        if layer_of(m) == index
        for name in sorted(external_imports(p) & set(FORBIDDEN[layer]))
    ]
    assert not bad, "\n".join(bad)


def test_modules_stay_readable():
    """A module over 400 lines says why in its opening docstring ("Over 400 lines: ...")."""
    too_long = []
    for m, p in sorted(MODULES.items()):
        text = p.read_text()
        lines = len(text.splitlines())
        if lines > 400 and "Over 400 lines" not in (ast.get_docstring(ast.parse(text)) or ""):
            too_long.append(f"{m}: {lines} lines")
    assert not too_long, "\n".join(too_long)


def test_no_two_modules_share_a_name():
    names: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        if path.name != "__init__.py":
            names.setdefault(path.stem, []).append(module)
    shared = {name: found for name, found in names.items() if len(found) > 1}
    assert not shared, shared


TIER_WORDS = {"device", "host", "nvme"}
# Where a bare "device", "host" or "nvme" string is not a tier (offload/common/tier.py's Tier names the tiers): path ->
# the scopes that may spell one (a function or class by qualified name, a module-level constant by its name), or None
# for the whole file.
NOT_TIERS: dict[str, tuple[str, ...] | None] = {
    "offload/common/tier.py": ("Tier",),  # the enum itself
    # wire formats: the max_memory keys users write; the hardware profile's JSON, and the text and probe output that
    # name its units
    "offload/common/sizes.py": None,
    "offload/planner/profiles.py": None,
    "offload/planner/profile_text.py": ("format_profile",),
    "offload/planner/probe.py": ("_compute_unit",),
    # other enumerations that spell "device": where a cold expert runs (COLD_EXPERTS), where host KV attends
    # (HOST_KV_ATTENTION)
    "offload/common/config.py": ("COLD_EXPERTS", "HOST_KV_ATTENTION"),
    "offload/model/expert_streaming.py": ("RoutedExperts", "layer_experts"),
    "offload/planner/cold_experts.py": ("cold_experts",),
    "offload/model/host_attention.py": ("HostAttention.stage",),
    "offload/planner/host_attention_prices.py": ("choose_host_attention",),
    # the cost model's resources (Prediction.resources, the plan JSON's "busy_seconds"): "host" is the host's CPU
    "scheduler/cost/predict.py": ("_layer_step", "_step", "mixed_step_seconds"),
    "offload/planner/report.py": ("_explain",),
}


def bare_tier_strings(tree: ast.Module) -> list[tuple[str, str, int]]:
    """Each string constant "device", "host" or "nvme" in `tree` (docstrings left out) as (scope, string, line):
    the scope is the qualified name of the function or class around it, or at module level the constant it is
    assigned to ("" elsewhere)."""
    found = []

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant):
                continue  # a docstring
            inner = scope
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                inner = f"{scope}.{child.name}" if scope else child.name
            elif not scope and isinstance(child, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                inner = ",".join(t.id for t in targets if isinstance(t, ast.Name))
            if isinstance(child, ast.Constant) and child.value in TIER_WORDS:
                found.append((scope, child.value, child.lineno))
            visit(child, inner)

    visit(tree, "")
    return found


def test_tiers_are_named_by_the_enum():
    bad, used = [], set()
    for _, path in sorted(MODULES.items()):
        where = path.relative_to(ROOT).as_posix()
        allowed = NOT_TIERS.get(where, ())
        for scope, word, line in bare_tier_strings(ast.parse(path.read_text(), str(path))):
            used |= {(where, None), (where, scope)}
            if allowed is not None and scope not in allowed:
                bad.append(f"{where}:{line} ({scope or 'module'}): {word!r}, not Tier.{word.upper()}")
    # an allowance nothing needs any more goes
    stale = [(where, s) for where, scopes in NOT_TIERS.items() for s in scopes or (None,) if (where, s) not in used]
    assert not bad and not stale, "\n".join(bad + [f"stale in NOT_TIERS: {where} {s or ''}" for where, s in stale])


def test_the_tier_check_catches_what_it_looks_for():
    source = '''
"""device"""
KV = {"host": 1, "disk": 2}
def f():
    """nvme"""
    return "nvme" if KV else f"{'device':>6}"
class C:
    tier: str = "device"
    def g(self):
        return ("cpu", "host")
'''
    assert bare_tier_strings(ast.parse(source)) == [
        ("KV", "host", 3),
        ("f", "nvme", 6),
        ("f", "device", 6),
        ("C", "device", 8),
        ("C.g", "host", 10),
    ]
