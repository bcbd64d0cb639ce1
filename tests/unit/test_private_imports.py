"""No module of ``lightning_gradcomp`` reaches into another module's private names.

A name with one leading underscore is its module's own: another module that imports it (``from a import _x``),
or reads it off the module (``a._x``), depends on a detail its owner may change without notice. A shared piece
gets a public name in the module that owns it. A private *module* (``_x.py``) is its package's own: the modules of
that package (and of its subpackages) may import it, as the package's ``__init__`` does; a module of another
package goes through the package's public names. Read from the source (``ast``), every import wherever it stands
(``TYPE_CHECKING``, function bodies), as ``test_import_graph`` reads the import graph.
"""

import ast
from pathlib import Path

from tests.unit.test_import_graph import ROOT, _modules


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _reaches_private_module(importer: str, target: str) -> bool:
    """Whether ``target`` (a module) is private to a package that does not hold ``importer``."""
    parts = target.split(".")
    for depth in range(1, len(parts)):
        if _private(parts[depth]):
            owner = ".".join(parts[:depth])
            if importer != owner and not importer.startswith(owner + "."):
                return True
    return False


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` reads from."""
    if not node.level:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _uses_in(module: str, path: Path, known: set[str], top: str) -> list[str]:
    """``module``'s uses of another module's private name or another package's private module."""
    tree = ast.parse(path.read_text(), str(path))
    bound: dict[str, str] = {}  # local name -> the package's module it is bound to
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != top:
                    continue
                if alias.name in known and _reaches_private_module(module, alias.name):
                    found.append(f"{module}:{node.lineno}: import {alias.name}")
                bound[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, path, node)
            if source.split(".")[0] != top:
                continue
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if target in known:  # a submodule
                    bound[alias.asname or alias.name] = target
                    bad = _reaches_private_module(module, target)
                else:  # a name defined in ``source``
                    bad = source in known and (
                        (source != module and _private(alias.name)) or _reaches_private_module(module, source)
                    )
                if bad:
                    found.append(f"{module}:{node.lineno}: from {source} import {alias.name}")

    def module_of(expr: ast.expr) -> "str | None":
        if isinstance(expr, ast.Name):
            return bound.get(expr.id)
        if isinstance(expr, ast.Attribute):
            parent = module_of(expr.value)
            if parent is not None and f"{parent}.{expr.attr}" in known:
                return f"{parent}.{expr.attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = module_of(node.value)
            if owner is not None and owner != module:
                found.append(f"{module}:{node.lineno}: {owner}.{node.attr}")
    return found


def private_uses(root: Path = ROOT) -> list[str]:
    """Each use, in a module of the package at ``root``, of another module's private name or another package's
    private module: ``module:line: what``, sorted."""
    modules = _modules(root)
    known = set(modules)
    return sorted(use for module, path in modules.items() for use in _uses_in(module, path, known, root.name))


def test_the_checker_sees_every_kind_of_private_use(tmp_path: Path) -> None:
    """The checker itself: private names imported (absolute, relative, aliased, in a function) or read off
    another module are found, and a private module's sibling may import it; a module's own private names, a
    private alias of a public name, dunders and other packages' names are not flagged."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "other").mkdir()
    files = {
        "__init__.py": "from pkg.a import A as _A\nfrom pkg import _p\n__all__ = ['_A']\n",
        "_p.py": "x = 1\n",
        "a.py": "import os\n_secret = 1\nA = _secret + os._exit.__doc__.__len__()\n",
        "b.py": "from pkg.a import _secret\n",
        "c.py": "def f():\n    from .a import _secret as s\n    return s\n",
        "d.py": "import pkg.a\nfrom pkg import a\nimport pkg.a as m\ny = (pkg.a._secret, a._secret, m._secret, a.__name__)\n",
        "sub/__init__.py": "",
        "sub/_q.py": "Q = 1\n",
        "sub/e.py": "from pkg.sub._q import Q\nfrom pkg._p import x\nfrom . import _q\n",
        "other/__init__.py": "",
        "other/f.py": "from pkg.sub._q import Q\nfrom pkg.sub import _q\nimport pkg.sub._q\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    assert private_uses(pkg) == [
        "pkg.b:1: from pkg.a import _secret",
        "pkg.c:2: from pkg.a import _secret",
        "pkg.d:4: pkg.a._secret",
        "pkg.d:4: pkg.a._secret",
        "pkg.d:4: pkg.a._secret",
        "pkg.other.f:1: from pkg.sub._q import Q",
        "pkg.other.f:2: from pkg.sub import _q",
        "pkg.other.f:3: import pkg.sub._q",
    ]


def test_no_module_uses_another_modules_private_names() -> None:
    found = private_uses()
    assert not found, "private names used across modules:\n" + "\n".join(found)
