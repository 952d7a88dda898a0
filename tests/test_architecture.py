"""The shape of the package: rooms without import cycles, small modules, the named parts public."""

from __future__ import annotations

import ast
from pathlib import Path

import lakeloader as ll

PACKAGE = Path(ll.__file__).parent
#: The most lines a module may have.
MAX_LINES = 450


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Package modules that ``path`` imports, type-only imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n in modules and n != "lakeloader"}
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_not_even_type_only() -> None:
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_is_large() -> None:
    sizes = {name: len(p.read_text().splitlines()) for name, p in _modules().items()}
    assert {n: s for n, s in sizes.items() if s > MAX_LINES} == {}


def test_the_three_parts_are_public_objects() -> None:
    names = ("DataLoader", "LakeDataset", "ReaderStateTracker", "CheckpointManager")
    for name in (*names, "RecoveryCoordinator", "Topology"):
        assert name in ll.__all__ and isinstance(getattr(ll, name), type)
    assert ll.ReaderStateTracker.__module__ == "lakeloader.state.tracker"
    assert ll.RecoveryCoordinator.__module__ == "lakeloader.recovery.coordinator"
    assert ll.CheckpointManager.__module__ == "lakeloader.checkpoint.manager"


#: Record modules of the checkpoint room that the layout may use: value objects, leaves too.
CHECKPOINT_RECORDS = {"lakeloader.checkpoint.training"}


def test_the_checkpoint_layout_is_a_leaf() -> None:
    modules = _modules()
    inside = ("lakeloader.checkpoint", "lakeloader.loader")
    layout = _imports(modules["lakeloader.checkpoint.layout"], modules)
    assert not {m for m in layout if m.startswith(inside)} - CHECKPOINT_RECORDS
    for record in CHECKPOINT_RECORDS:  # and they import nothing else of the room
        used = _imports(modules[record], modules)
        assert not {m for m in used if m.startswith(inside)} - CHECKPOINT_RECORDS, record
