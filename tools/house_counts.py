"""The counts issue 19 asks for, for one checkout of the library: top-level modules and packages, import layers,
import cycles, ``GradCompState`` fields and ``type: ignore`` comments.

    python tools/house_counts.py lightning_gradcomp
    git worktree add /tmp/before 47f344c && python tools/house_counts.py /tmp/before/lightning_gradcomp

Imports are read from the source (``tests/unit/test_import_graph.py``: every ``import`` anywhere in a module,
``TYPE_CHECKING`` and function-local ones included). Layers are the longest chain of imports after strongly
connected components (cycles) are merged into one node, counted twice: between modules, and between the package's
top-level units (a subpackage counts as one unit).
"""

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.unit.test_import_graph import cycles, import_graph


def layers(graph: dict[str, set[str]]) -> tuple[int, list[list[str]]]:
    """The longest import chain with cycles merged, and the cycles."""
    found = cycles(graph)
    merged = {m: f"cycle{i}" for i, c in enumerate(found) for m in c}
    dag: dict[str, set[str]] = {}
    for m, deps in graph.items():
        dag.setdefault(merged.get(m, m), set()).update(
            merged.get(d, d) for d in deps if merged.get(d, d) != merged.get(m, m)
        )
    depth: dict[str, int] = {}

    def visit(n: str) -> int:
        if n not in depth:
            depth[n] = 1 + max((visit(d) for d in dag.get(n, ())), default=0)
        return depth[n]

    return max(visit(n) for n in dag), found


def top_level_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for m, deps in graph.items():
        parts = m.split(".")
        if len(parts) < 2:
            continue
        units.setdefault(parts[1], set()).update(
            d.split(".")[1] for d in deps if len(d.split(".")) > 1 and d.split(".")[1] != parts[1]
        )
    return units


def state_fields(root: Path) -> object:
    """Attributes of ``GradCompState``: class-level annotations (a dataclass) or ``self.x =`` in ``__init__``."""
    if not (root / "hook.py").exists():
        return "n/a (no hook.py)"
    tree = ast.parse((root / "hook.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GradCompState")
    annotated = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    assigned = set()
    for node in ast.walk(init) if init is not None else ():
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                assigned.add(t.attr)
    return len(annotated | assigned)


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "lightning_gradcomp").resolve()
    graph = import_graph(root)
    module_layers, module_cycles = layers(graph)
    unit_layers, unit_cycles = layers(top_level_graph(graph))
    top = [p for p in root.iterdir() if not p.name.startswith("__") and (p.suffix == ".py" or (p / "__init__.py").exists())]
    ignores = sum(f.read_text().count("type: ignore") for f in root.rglob("*.py"))
    print(f"| {root} | count |\n|---|---|")
    print(f"| top-level modules and packages | {len(top)} |")
    print(f"| modules | {len(graph)} |")
    print(f"| import layers between modules (cycles merged) | {module_layers} |")
    print(f"| import layers between top-level units (cycles merged) | {unit_layers} |")
    print(f"| import cycles (modules in them) | {len(module_cycles)} ({sum(map(len, module_cycles))}) |")
    print(f"| cycles between top-level units | {len(unit_cycles)} |")
    print(f"| GradCompState fields | {state_fields(root)} |")
    print(f"| `type: ignore` | {ignores} |")


if __name__ == "__main__":
    main()
