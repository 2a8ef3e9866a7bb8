"""The package's floors and import graph: every module imports; nothing imports upward; no import circles.

Floors, lowest first (docs/design.md): ops (kernels_batch_invariant) -> model (config, layers, the model,
contexts and caches) -> LoRA and sharding (lora, parallel) -> engine | trainer | capacity planning ->
parity (metric, audit, smoke) -> the RL loop (rl) -> integrations with other trainers (integrations: verl's
engine and rollout plugins, built on the loop's pieces) -> entry points (cli, train). A module may import its
own package and any lower floor; packages on the same floor do not import each other. Function-level
(lazy) imports count like any other; imports under ``if TYPE_CHECKING:`` do not (they never run).
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zmrl"

FLOORS: dict[str, int] = {
    "extras": 0,  # the optional-dependency guard, importable from every floor
    "kernels_batch_invariant": 0,
    "model": 1,
    "lora": 2, "parallel": 2,
    "rollout": 3, "trainer": 3, "capacity": 3,
    "parity": 4,
    "rl": 5,
    "integrations": 6,
    "cli": 7, "train": 7, "__main__": 7,
}
# Packages of one floor that form one unit and may import each other.
GROUPS = {"cli": "entry points", "train": "entry points", "__main__": "entry points"}

# Known exceptions, each with its reason; the test fails if one disappears (prune the list) or a new one
# appears. ModelConfig's sizing conveniences (param_counts, kv_bytes_per_token_per_layer,
# kda_state_bytes_per_request) delegate to zmrl.capacity.sizing, and ModelConfig.preset reads the preset
# table in presets.py, which builds ModelConfig objects: both are public API of ModelConfig.
# ModelConfig.from_json reads the released Kimi K3 format and HF configs through k3_release.py and
# hf_config.py, which build ModelConfig objects (lazy imports inside the reader).
ALLOWED = {
    ("zmrl.model.config", "zmrl.capacity.sizing"),
    ("zmrl.model.config", "zmrl.model.presets"),
    ("zmrl.model.config", "zmrl.model.k3_release"),
    ("zmrl.model.config", "zmrl.model.hf_config"),
}


def _module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


MODULES = _module_names()


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(name: str) -> set[str]:
    """The zmrl modules ``name`` imports (a ``from X import y`` names X.y when that is a module)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "zmrl")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] == "zmrl":
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    found.add(sub if sub in MODULES else module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    found.discard(name)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _floor(name: str) -> tuple[str, int] | None:
    parts = name.split(".")
    if len(parts) == 1:  # the zmrl package itself
        return None
    return GROUPS.get(parts[1], parts[1]), FLOORS[parts[1]]


def test_every_package_has_a_floor():
    missing = sorted({n.split(".")[1] for n in MODULES if "." in n} - set(FLOORS))
    assert not missing, f"zmrl packages without a floor in tests/test_floors.py: {missing}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_imports(name):
    if name == "zmrl.__main__":  # runs the CLI when imported: compile it only
        compile(MODULES[name].read_text(), str(MODULES[name]), "exec")
        return
    if name.startswith("zmrl.kernels_batch_invariant.triton."):
        # the Triton backend is a GPU extra; CPU installs without triton never import it
        pytest.importorskip("triton")
    importlib.import_module(name)


def test_nothing_imports_upward_or_sideways():
    bad = []
    for src, targets in GRAPH.items():
        s = _floor(src)
        for dst in sorted(targets):
            d = _floor(dst)
            if s is None or d is None or s[0] == d[0] or d[1] < s[1]:
                continue
            if (src, dst) in ALLOWED:
                continue
            kind = "upward" if d[1] > s[1] else "sideways (same floor)"
            bad.append(f"{src} (floor {s[1]}: {s[0]}) imports {dst} (floor {d[1]}: {d[0]}): {kind}")
    assert not bad, "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return out


def test_no_import_cycles():
    graph = {src: {d for d in targets if (src, d) not in ALLOWED} for src, targets in GRAPH.items()}
    assert _cycles(graph) == []


def test_allowed_exceptions_still_exist():
    """Each entry of ALLOWED is a real edge (remove it from the list once the code no longer needs it)."""
    stale = sorted(e for e in ALLOWED if e[1] not in GRAPH.get(e[0], set()))
    assert not stale, f"ALLOWED lists imports that no longer exist: {stale}"


def test_the_checks_can_fail():
    """The cycle finder and the floor rule see a planted cycle and a planted upward import."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _floor("zmrl.rl.loop") == ("rl", 5) and _floor("zmrl.model.kda") == ("model", 1)
    assert "zmrl.rollout.scheduler" in GRAPH["zmrl.rollout.engine"]
    assert "zmrl.rollout.engine" not in GRAPH["zmrl.rollout.graph_runner"]
