"""Counts that show how many times the library writes each mechanism down.

Prints, for the library package ``lightning_gradcomp``:

* lines per compressor: every file named after it (its compressor module and twins, its kernels in Python, C++ and
  Triton);
* the functions that run a compressor's group step: every function outside ``compressors/`` and ``kernels/`` that
  calls a compressor's ``compress`` or ``compress_flat`` (the runtime's own callers; the target is one);
* the places that compute bytes on the wire: every function that multiplies out ``element_size()``, reads a
  ``.nbytes`` or asks a compressor for ``sent``/``sent_flat`` (the target is the ledger alone);
* the compressor contract: public methods and class attributes of ``Compressor`` (and the boolean flags among them);
* the entries at the library's root.

Usage: ``python tools/architecture_counts.py [--list]`` (``--list`` names every place counted). The counts are
syntactic (``ast``), so they are exact for what they count and blind to what a call does at run time.
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "lightning_gradcomp"

#: each compressor's file stem: every library file whose name contains it belongs to that compressor
COMPRESSOR_STEMS = {
    "TernGrad": "terngrad",
    "Gradient Dropping": "graddrop",
    "AdaComp": "adacomp",
    "top-k / DGC": ("topk", "dgc"),
    "PowerSGD": "powersgd",
    "DeMo": "demo",
    "QSGD": "qsgd",
    "1-bit SGD": "onebit",
    "int8": "int8",
}
SOURCE_SUFFIXES = (".py", ".cpp", ".h")
COMPRESS_CALLS = {"compress", "compress_flat"}
BYTES_CALLS = {"element_size", "sent", "sent_flat"}


@dataclass
class Counts:
    compressor_lines: dict[str, tuple[int, list[str]]] = field(default_factory=dict)
    group_step_functions: list[str] = field(default_factory=list)
    byte_places: list[str] = field(default_factory=list)
    contract_methods: list[str] = field(default_factory=list)
    contract_flags: list[str] = field(default_factory=list)
    contract_attributes: list[str] = field(default_factory=list)
    root_entries: list[str] = field(default_factory=list)


def _library_files() -> list[Path]:
    return sorted(p for p in LIBRARY.rglob("*") if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _functions(tree: ast.AST) -> list[tuple[str, ast.AST]]:
    """Every function with its qualified name (Class.method, outer.inner)."""
    found: list[tuple[str, ast.AST]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                found.append((name, child))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def _own_nodes(function: ast.AST) -> list[ast.AST]:
    """The nodes of a function's own body, not of the functions nested in it (those are counted on their own)."""
    nodes: list[ast.AST] = []
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        nodes.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return nodes


def _calls_attribute(function: ast.AST, names: set[str]) -> bool:
    return any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names
        for node in _own_nodes(function)
    )


def _reads_nbytes(function: ast.AST) -> bool:
    return any(isinstance(node, ast.Attribute) and node.attr == "nbytes" for node in _own_nodes(function))


def count() -> Counts:
    counts = Counts()
    files = _library_files()
    for label, stems in COMPRESSOR_STEMS.items():
        stems = (stems,) if isinstance(stems, str) else stems
        mine = [p for p in files if any(stem in p.name for stem in stems)]
        counts.compressor_lines[label] = (sum(_lines(p) for p in mine), [str(p.relative_to(ROOT)) for p in mine])
    for path in files:
        if path.suffix != ".py":
            continue
        relative = path.relative_to(LIBRARY)
        tree = ast.parse(path.read_text())
        runtime = relative.parts[0] not in ("compressors", "kernels")
        for name, function in _functions(tree):
            where = f"{relative}::{name}"
            if runtime and _calls_attribute(function, COMPRESS_CALLS):
                counts.group_step_functions.append(where)
            if _calls_attribute(function, BYTES_CALLS) or _reads_nbytes(function):
                counts.byte_places.append(where)
    base = ast.parse((LIBRARY / "compressors" / "base.py").read_text())
    for node in ast.walk(base):
        if isinstance(node, ast.ClassDef) and node.name == "Compressor":
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                    counts.contract_methods.append(item.name)
                targets: list[tuple[str, ast.AST | None]] = []
                if isinstance(item, ast.Assign):
                    targets = [(t.id, item.value) for t in item.targets if isinstance(t, ast.Name)]
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    targets = [(item.target.id, item.value)]
                for attr, value in targets:
                    if attr.startswith("_"):
                        continue
                    counts.contract_attributes.append(attr)
                    if isinstance(value, ast.Constant) and isinstance(value.value, bool):
                        counts.contract_flags.append(attr)
    counts.root_entries = sorted(p.name for p in LIBRARY.iterdir() if p.name != "__pycache__")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="name every file, function and entry counted")
    args = parser.parse_args()
    counts = count()
    print("| what | count |")
    print("| --- | --- |")
    for label, (lines, paths) in counts.compressor_lines.items():
        print(f"| lines of {label} ({len(paths)} files) | {lines} |")
    print(f"| functions that run a compressor's group step (outside compressors/, kernels/) | "
          f"{len(counts.group_step_functions)} |")
    print(f"| functions that compute bytes on the wire | {len(counts.byte_places)} |")
    print(f"| Compressor's public methods | {len(counts.contract_methods)} |")
    print(f"| Compressor's public class attributes (boolean flags among them) | "
          f"{len(counts.contract_attributes)} ({len(counts.contract_flags)}) |")
    print(f"| entries at the library's root | {len(counts.root_entries)} |")
    if args.list:
        for label, (_, paths) in counts.compressor_lines.items():
            print(f"\n{label}: " + ", ".join(paths))
        for title, names in (
            ("group step", counts.group_step_functions),
            ("bytes on the wire", counts.byte_places),
            ("contract methods", counts.contract_methods),
            ("contract flags", counts.contract_flags),
            ("root entries", counts.root_entries),
        ):
            print(f"\n{title}:")
            for name in names:
                print(f"  {name}")


if __name__ == "__main__":
    main()
