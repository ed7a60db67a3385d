"""The package's folders are the pipeline's stages, and every import runs down the pipeline (issue 21).

The imports are read with ast (no module is imported), lazy imports inside functions and TYPE_CHECKING blocks
included. A module may import from its own stage or an earlier one; the parts of one stage may import each other
(plan.py and layouts/), except where the stage holds two separate rooms (proof/ and advice/); no circle between rooms;
nothing in the product imports scripts/ (its own program, scripts/matrix/ included).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "converter"

# (stage, its rooms): a room is a folder under converter/ or a module at its top ("" = converter/__init__.py)
STAGES: tuple[tuple[tuple[str, ...], ...], ...] = (
    (("", "errors", "gemma4", "quantization"),),
    (("read",),),
    (("validate",),),  # every "is this checkpoint what its config says" check: after read, before plan
    (("plan", "dequantize", "transforms", "layouts", "pairing", "cost", "parallel"),),
    (("write",),),
    (("proof",), ("advice",)),  # one stage, two rooms that must not lean on each other
    (("hub",),),
    (("pipeline",),),  # the one call that converts: sources (hub), decision (advice), plan, write
    (("cli",),),
)
# top-level packages of the proof (scripts/ on sys.path): the product importing one is an arrow into scripts/
PROOF_PACKAGES = frozenset(p.parent.name for p in (PACKAGE.parent / "scripts").glob("*/__init__.py"))


def _room_of(module: str) -> str:
    """converter.read.checkpoint -> "read"; converter.plan -> "plan"; converter -> ""."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _place(room: str) -> tuple[int, int] | None:
    """(stage index, group index within the stage) of a room; None for a room the table lacks."""
    for stage, groups in enumerate(STAGES):
        for group, rooms in enumerate(groups):
            if room in rooms:
                return stage, group
    return None


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The converter modules a `from ... import ...` names (each imported name may be a submodule)."""
    if node.level:
        base = importer.split(".") if is_package else importer.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    if not (module == "converter" or module.startswith("converter.")):
        top = module.split(".")[0]
        return [module] if top == "scripts" else [f"scripts.{module}"] if top in PROOF_PACKAGES else []
    return [module] + [f"{module}.{alias.name}" for alias in node.names]


def package_imports() -> dict[str, set[str]]:
    """Every converter module -> the converter (or scripts) modules it imports, anywhere in its body."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    imports: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                found.update(_resolve(name, path.name == "__init__.py", node))
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names
                             if alias.name.split(".")[0] in ("converter", "scripts"))
        # `from .x import y` names y too: keep only what is a module (or the package holding it)
        imports[name] = {m for m in found if m in modules or m.split(".")[0] == "scripts"}
    return imports


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle in a directed graph, as the rooms along it, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def layout_violations(imports: dict[str, set[str]]) -> list[str]:
    """Every import that runs back up the pipeline, reaches a sibling room or scripts/; any room circle."""
    problems = []
    rooms: dict[str, set[str]] = {}
    for importer in sorted(imports):
        room = _room_of(importer)
        here = _place(room)
        if here is None:
            problems.append(f"{importer}: room {room!r} is in no stage of the table (add it to STAGES)")
            continue
        for imported in sorted(imports[importer]):
            if imported.split(".")[0] == "scripts":
                problems.append(f"{importer} imports {imported}: scripts/ is its own program")
                continue
            target = _room_of(imported)
            if target == room:
                continue
            rooms.setdefault(room, set()).add(target)
            there = _place(target)
            if there is None:
                problems.append(f"{importer} imports {imported}: room {target!r} is in no stage of the table")
            elif there[0] > here[0]:
                problems.append(f"{importer} imports {imported}: an arrow back up the pipeline "
                                f"(stage {here[0]} -> stage {there[0]})")
            elif there[0] == here[0] and there[1] != here[1]:
                problems.append(f"{importer} imports {imported}: {room}/ and {target}/ are sibling rooms")
    circle = _cycle(rooms)
    if circle:
        problems.append("a circle between rooms: " + " -> ".join(r or "converter/__init__" for r in circle))
    return problems


def test_every_import_runs_down_the_pipeline():
    imports = package_imports()
    assert len(imports) > 40 and "converter.read.checkpoint" in imports["converter.plan"]  # it read the real package
    assert layout_violations(imports) == []


def test_every_stage_folder_is_a_package_with_a_docstring():
    for path in sorted(PACKAGE.iterdir()):
        if path.is_dir() and path.name != "__pycache__":
            init = path / "__init__.py"
            assert init.is_file(), f"{path} has no __init__.py"
            assert ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))), f"{init} says nothing of its room"


@pytest.mark.parametrize("imports, expected", [
    ({"converter.plan": {"converter.write.shard"}, "converter.write.shard": set()}, "back up the pipeline"),
    ({"converter.read.checkpoint": {"converter.pipeline"}, "converter.pipeline": set()}, "back up the pipeline"),
    ({"converter.proof.verification": {"converter.advice.report"}, "converter.advice.report": set()}, "sibling rooms"),
    ({"converter.pipeline": {"scripts.matrix.synthetic"}}, "scripts/ is its own program"),
    ({"converter.cli.convert": {"scripts.consumers.vllm.check"}}, "scripts/ is its own program"),
    ({"converter.plan": {"converter.layouts.base"}, "converter.layouts.base": {"converter.plan"}}, "a circle"),
    ({"converter.newroom.thing": set()}, "in no stage"),
])
def test_a_wrong_arrow_is_named(imports, expected):
    problems = layout_violations(imports)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize("imports", [
    {"converter.cli.convert": {"converter.pipeline", "converter.read.checkpoint", "converter.hub.download"}},
    {"converter.layouts.base": {"converter.plan"}, "converter.plan": {"converter.read.checkpoint"}},
])
def test_a_downward_arrow_passes(imports):
    assert layout_violations(imports) == []
