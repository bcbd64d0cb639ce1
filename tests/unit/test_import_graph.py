"""No module of ``lightning_gradcomp`` takes part in an import cycle, counting every import in the file.

Imports under ``TYPE_CHECKING`` and imports inside functions count too: they hide a cycle from the interpreter
but not from a reader (two modules that each need the other are one module split in two), and a type checker
or a later refactor turns them into real ones. The graph is read from the source (``ast``), not from
``sys.modules``, so no module is imported and every branch is seen.
"""

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import lightning_gradcomp

ROOT = Path(lightning_gradcomp.__file__).resolve().parent


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package at ``root`` (``__init__`` names its
    package)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported(module: str, path: Path, known: set[str]) -> Iterator[str]:
    """The package's modules that ``module`` imports anywhere in its file.

    ``from a import b`` imports the module ``a.b`` when there is one, else the module ``a`` (``b`` is a name
    defined there, so ``a`` must have run, even when it is ``module``'s own package). Either import first runs
    the ``__init__`` of each enclosing package; those count unless they enclose ``module`` itself (that package
    is already being imported, running it again imports nothing).
    """
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:  # relative: from the package, or `level - 1` packages up
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
        for target in targets:
            parts = target.split(".")
            while parts and ".".join(parts) not in known:  # `import a.b.name` style: the longest module prefix
                parts.pop()
            if not parts:
                continue
            explicit = ".".join(parts)
            if explicit != module:
                yield explicit
            for depth in range(1, len(parts)):
                enclosing = ".".join(parts[:depth])
                if enclosing in known and enclosing != module and not module.startswith(enclosing + "."):
                    yield enclosing


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (all imports of its file, wherever they stand)."""
    modules = _modules(root)
    known = set(modules)
    return {m: set(_imported(m, p, known)) for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, listed sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def folder_graph(graph: dict[str, set[str]], root: Path = ROOT) -> dict[str, set[str]]:
    """Folder -> the folders its modules import. A folder is a subpackage of the package at ``root``
    (``compressors``, ``exchange``, ...); a module at the root (``registry``, ``flat``) and the root package itself
    are folders of their own."""
    modules = _modules(root)

    def folder(module: str) -> str:
        parts = modules[module].relative_to(root).parts
        return parts[0] if len(parts) > 1 else module

    folders: dict[str, set[str]] = {folder(m): set() for m in graph}
    for module, imported in graph.items():
        folders[folder(module)] |= {folder(t) for t in imported} - {folder(module)}
    return folders


def _described(found: list[list[str]]) -> str:
    return "\n".join(" <-> ".join(m.removeprefix("lightning_gradcomp.") for m in c) for c in found)


#: the package's modules this test already holds to no cycle (the compressors, their kernels, the planner): a
#: cycle through any of them fails even while other cycles are still being taken apart
def test_the_graph_sees_hidden_and_relative_imports(tmp_path: Path) -> None:
    """The checker itself: cycles through a ``TYPE_CHECKING`` import, a function-local import and a relative
    import are found; a module importing its own package's submodule is not a cycle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg.a import A\n",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\nA = 1\n",
        "b.py": "import pkg.a\nB = 2\n",
        "c.py": "def f():\n    from pkg import d\n    return d\n",
        "d.py": "from . import c\n",
        "sub/__init__.py": "from .e import E\n",
        "sub/e.py": "from ..a import A\nE = A\n",
        "f.py": "import os.path\nfrom pkg.sub import e\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert graph["pkg.sub.e"] == {"pkg.a"} and graph["pkg.f"] == {"pkg.sub", "pkg.sub.e"}
    assert cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


def test_no_module_is_in_an_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, f"import cycles:\n{_described(found)}"


def test_the_folder_graph_merges_a_folders_modules(tmp_path: Path) -> None:
    """The checker itself: two modules of one folder are one node; a cycle between folders is found although no
    module is in a cycle (``a.x`` -> ``b.y`` -> ``a.z``); a root module is a folder of its own."""
    pkg = tmp_path / "pkg"
    for folder in ("a", "b", "c"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    files = {"__init__.py": "", "root.py": "", "a/x.py": "from pkg.b import y\n", "a/z.py": "import pkg.root\n",
             "b/y.py": "from pkg.a import z\n", "c/w.py": "from pkg.a import x\n"}
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert cycles(graph) == []
    folders = folder_graph(graph, pkg)
    assert folders == {"pkg": set(), "pkg.root": set(), "a": {"b", "pkg.root"}, "b": {"a"}, "c": {"a"}}
    assert cycles(folders) == [["a", "b"]]


#: the bottom module: the flat layout of a group of layers and the packets (``Segments``, ``FlatPacket``, ...) that
#: compressors, kernels, the wire formats and the exchange all speak
BOTTOM = "lightning_gradcomp.flat"


def test_the_bottom_module_imports_nothing_of_the_library() -> None:
    """``flat`` imports torch and the standard library only, so every folder can import it without a cycle."""
    assert import_graph()[BOTTOM] == set()
    tree = ast.parse((ROOT / "flat.py").read_text())
    top = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    top |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(tree))
    assert top - set(sys.stdlib_module_names) == {"torch"}


def test_no_import_cycle_between_folders() -> None:
    """No cycle between the package's folders (compressors, exchange, kernels, wire, sites, strategies, callbacks,
    ...): a folder imports only folders below it. The callbacks take the strategy as ``exchange.host.HookHost``, so
    the strategies import the callbacks and not the other way round."""
    found = cycles(folder_graph(import_graph()))
    assert not found, f"folder-level import cycles: {found}"
