"""The package layout: the library imports without the lab, and the public API has one spelling per name."""

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_gradcomp
from lightning_gradcomp import compressors, registry
from lightning_gradcomp._deprecated import MOVED_MODULES

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "lightning_gradcomp"

#: imports every module of the library in a fresh interpreter in which any import of ``gradcomp_lab`` fails
_IMPORT_ALL_WITHOUT_LAB = """
import importlib, importlib.abc, pkgutil, sys

class BlockLab(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "gradcomp_lab" or name.startswith("gradcomp_lab."):
            raise ImportError(f"the library imported the lab: {name}")
        return None

sys.meta_path.insert(0, BlockLab())
import lightning_gradcomp
failed = []
for module in pkgutil.walk_packages(lightning_gradcomp.__path__, "lightning_gradcomp."):
    try:
        importlib.import_module(module.name)
    except Exception as exc:
        failed.append(f"{module.name}: {exc!r}")
print("imported", len(list(pkgutil.walk_packages(lightning_gradcomp.__path__))))
assert not failed, failed
assert not any(m == "gradcomp_lab" or m.startswith("gradcomp_lab.") for m in sys.modules)
"""


def _lab_references(path: Path) -> list[str]:
    """Every import of ``gradcomp_lab`` in a module (top-level, function-local, under ``TYPE_CHECKING``), and every
    string in its code that names a lab module (``importlib.import_module("gradcomp_lab.x")``, ``"gradcomp_lab.x:f"``).
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, (ast.stmt, ast.expr)):  # imports are statements, strings expressions
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if re.match(r"gradcomp_lab(\.|:|$)", node.value) else []
        found += [f"{path.name}:{node.lineno}: {n}" for n in names if re.split(r"[.:]", n)[0] == "gradcomp_lab"]
    return found


#: the only references to the lab the library may hold: the deprecated aliases of names that moved there, resolved by
#: ``lightning_gradcomp._deprecated.moved_names`` only when a script spells the old name (never at import time,
#: which :func:`test_every_library_module_imports_with_the_lab_blocked` checks)
DEPRECATED_ALIASES_INTO_THE_LAB = {
    "callbacks/__init__.py": ["gradcomp_lab.ema:ExponentialMovingAverage"],
    "callbacks/ema.py": ["gradcomp_lab.ema:ExponentialMovingAverage", "gradcomp_lab.ema:tf_decay",
                         "gradcomp_lab.ema:tf_ema_avg_fn"],
}


def test_no_library_module_imports_the_lab() -> None:
    modules = sorted(LIBRARY.rglob("*.py"))
    assert len(modules) > 50  # the scan reads the package, not an empty glob
    found = {f"{path.parent.name}/{path.name}": [ref.split(": ", 1)[1] for ref in _lab_references(path)] for path in modules}
    assert {module: refs for module, refs in found.items() if refs} == DEPRECATED_ALIASES_INTO_THE_LAB


def test_the_scan_finds_local_and_dynamic_imports_of_the_lab(tmp_path: Path) -> None:
    module = tmp_path / "probe.py"
    module.write_text(
        "import importlib\n"
        "def f():\n    from gradcomp_lab.perfmodel import Codec\n"
        "def g():\n    return importlib.import_module('gradcomp_lab.report')\n"
    )
    assert _lab_references(module) == ["probe.py:3: gradcomp_lab.perfmodel", "probe.py:5: gradcomp_lab.report"]


def test_every_library_module_imports_with_the_lab_blocked() -> None:
    out = subprocess.run([sys.executable, "-c", _IMPORT_ALL_WITHOUT_LAB], capture_output=True, text=True, cwd=ROOT,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]


def test_compressors_all_holds_every_registered_compressor() -> None:
    for name, (factory, _) in registry.COMPRESSORS.items():
        cls = factory if isinstance(factory, type) else type(factory())
        assert cls.__name__ in compressors.__all__, name
        assert getattr(compressors, cls.__name__) is cls, name
    for contract in ("Compressor", "Packet", "Aggregation", "MultiRoundCompressor"):
        assert contract in compressors.__all__


def test_top_level_exports_strategies_hook_and_registry_only() -> None:
    assert sorted(lightning_gradcomp.__all__) == [
        "DiLoCoStrategy", "GradCompFabricStrategy", "GradCompState", "GradCompStrategy", "OneBitAdamStrategy",
        "PresetFabricStrategy", "PresetStrategy", "ShardedDiLoCoStrategy", "ShardedGradCompFabricStrategy", "ShardedGradCompStrategy", "TowerStrategy",
        "WeightGradStrategy", "ZeroOneAdamStrategy",
        "compressor_names", "gradcomp_hook", "make_compressor", "register_compressor", "register_strategies",
        "strategy_names",
    ]
    for name in lightning_gradcomp.__all__:
        assert getattr(lightning_gradcomp, name) is not None
    # one spelling per compressor: lightning_gradcomp.compressors.X, never a second one at the top level (the
    # deprecated aliases of an earlier release resolve through the module's __getattr__, with a warning, and are
    # not attributes of the package: tests/unit/test_deprecated_aliases.py)
    assert [n for n in compressors.__all__ if n in vars(lightning_gradcomp)] == []


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


def test_every_dotted_name_in_docs_and_recipes_resolves() -> None:
    """``lightning_gradcomp.x.Y`` and ``gradcomp_lab.x.Y`` in README, docs and recipes name something that exists."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "recipes").rglob("*.yaml"))]
    assert len(files) > 60
    pattern = re.compile(r"(?<![\w/.])((?:lightning_gradcomp|gradcomp_lab)(?:\.[A-Za-z_]\w*)+)")
    names = {(path.relative_to(ROOT), name) for path in files for name in pattern.findall(path.read_text())}
    assert len(names) > 100  # the pattern finds the names, not nothing
    assert sorted(f"{path}: {name}" for path, name in names if not _resolves(name)) == []


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_a_moved_module_path_imports_the_module_at_its_new_place_with_a_warning(old: str) -> None:
    """Scripts and pickles that name a module's old path (``lightning_gradcomp.hook``) get the module itself, so
    its classes are the same objects, and a ``DeprecationWarning`` naming the new path."""
    new = importlib.import_module(MOVED_MODULES[old])
    sys.modules.pop(old, None)  # a previous import would answer from the cache, without the warning
    with pytest.warns(DeprecationWarning, match=re.escape(MOVED_MODULES[old])):
        moved = importlib.import_module(old)
    assert moved is new
