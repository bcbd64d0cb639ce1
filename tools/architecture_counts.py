"""Counts that show how many times the library writes each mechanism down (the one-exchange refactor states them
before and after).

Prints, for one checkout of the library package (default: this repository's ``lightning_gradcomp``):

* lines per compressor: every file named after it (its compressor module and twins, its kernels in Python, C++ and
  Triton), and the lines under ``compressors/`` and ``kernels/`` that belong to no single compressor (the contract,
  kernels and helpers several compressors share);
* the functions that perform a group step (the target is one): outside ``compressors/`` and ``kernels/``, every
  function that itself encodes with a compressor (calls ``compress``, ``compress_flat``, or a multi-round
  ``exchange``/``exchange_flat``), that reassembles the step from the hook's private pieces outside ``hook.py``
  (``_prepare``, ``_compress_group``, ``_transform_group``), or that quantizes with a quantizer written outside the
  ``Compressor`` contract (a public ``*ternary*``/``*quantiz*`` function defined outside ``compressors/`` and
  ``kernels/``, such as WeightGrad's);
* the functions that compute bytes on the wire (the target is the ledger alone): every function that derives a
  byte count from tensor sizes (``numel()``, ``element_size()``, ``.nbytes``) and stores it under a byte name
  (``nbytes``, ``*_bytes``, ``wan``, ``lan``: a variable, attribute, keyword, or the return of a function so named),
  hands it to the ledger (``record_*``), sums or tuples packet sizes (``.nbytes``, ``element_size()``), or writes
  fp32's width by hand (``4 * x.numel()``); the packets' own ``nbytes`` and the sparse formats' size formulas
  included. Sizes handed to the ledger's formulas (``dense_bytes``, ``tensor_bytes``) are counted in the ledger. A compressor's ``sent``/``sent_flat`` (the decoded contribution, a tensor) and sizes used for layout
  (offsets, byte-balanced shares, chunks: :data:`LAYOUT_SIZES`) are not bytes on the wire;
* the functions that keep a byte count outside the ledger (the target: the outer engine's run bytes alone, fed from
  its exchange's ledger): outside ``ledger.py``, every function that stores into a byte-named attribute's entries
  (``site.lan_bytes[i] = ...``), adds to a byte-named attribute (``self.wan_total += n``) or steps one
  (``self.wan.add(n)``, ``end_step()``, ``fold_into_last()``: a ``RunBytes``);
* the compressor contract: public methods and class attributes of ``Compressor`` (the flags among them: those
  typed ``bool`` or ``Optional[bool]``), and the attributes the runtime reads off a compressor by name
  (``getattr(compressor, "...", default)``, ``hasattr``) that the contract does not declare; the contract's names
  in all (the kernel choice is the kernel provider's, not the contract's) are held to :data:`CONTRACT_LIMIT`
  (``tests/unit/test_architecture_counts.py``);
* the strategy options written in both front ends of an engine (:data:`FRONT_END_PAIRS`: the parameter names both
  constructors spell out, of the larger one's), and the hook state's pass-through properties (a ``GradCompState``
  property whose body is ``return self.<owner>.<value>``);
* the backend branches at call sites (the target is none: the kernels come from one provider object, chosen
  once): in ``compressors/`` outside the providers (``backends.py``, ``*_kernels.py``), every ``if``, conditional
  expression or ``and``/``or`` whose condition asks which kernels run (calls ``uses_triton``, ``_kernels``,
  ``native``, ``_native_decode``, ``_triton_wire``, ``_selecting``, ``_torch_ops_form``; reads a variable named
  ``fused``, ``ext``, ``triton``, ``selecting``, ``in_place``; or compares with ``"fused"`` or ``"triton"``);
* the entries at the library's root (modules, packages, other files).

Usage: ``python tools/architecture_counts.py [--list] [LIBRARY]`` (``--list`` names every place counted); for the
counts of an older commit, ``git worktree add /tmp/before <commit>`` and pass ``/tmp/before/lightning_gradcomp``.
The counts are syntactic (``ast``), so they are exact for what they count and blind to what a call does at run time.
"""

from __future__ import annotations

import argparse
import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

LIBRARY = Path(__file__).resolve().parent.parent / "lightning_gradcomp"

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
#: where compressors and their kernels live: their own calls are the compressors' inside, not the runtime's
COMPRESSOR_DIRS = ("compressors", "kernels")
#: a compressor's encoding entry points (single-round and multi-round)
ENCODE_CALLS = {"compress", "compress_flat", "exchange", "exchange_flat"}
#: the hook's group-step pieces: calling them outside ``hook.py`` reassembles the step elsewhere
HOOK_STEP_PIECES = {"_prepare", "_compress_group", "_transform_group"}
#: a quantizer's name (bit packing, ``pack_*``/``unpack_*``, is the wire format's, not a quantizer)
QUANTIZER_NAME = re.compile(r"^(?!(un)?pack_).*(ternary|quantiz)")
SIZES = frozenset({"numel", "element_size", "nbytes"})
#: names a byte count is stored under
BYTE_NAME = re.compile(r"(^|_)(n?bytes|wan|lan)(_|$)")
#: the ledger's recording methods
LEDGER_CALLS = re.compile(r"^record")
#: the ledger's formulas (``lightning_gradcomp/exchange/ledger.py``): a size handed to one is counted there, not by the caller
LEDGER_FORMULAS = frozenset({"dense_bytes", "tensor_bytes"})
#: the most public names (methods and class attributes, flags included) the compressor contract may have
CONTRACT_LIMIT = 12
#: the methods that change a ``RunBytes`` (``exchange/ledger.py``)
RUN_BYTES_WRITERS = frozenset({"add", "end_step", "fold_into_last"})
#: functions whose byte sizes are of layout, not of the wire (syntactically alike), with the reason
LAYOUT_SIZES = {
    "groups.py::Layouts.groups": "input bytes per pipeline chunk",
    "exchange/groups.py::Layouts.groups": "input bytes per pipeline chunk",
}
#: what asks which kernels run (see the module docstring): calls, variable names, and the kernel sets' names
BACKEND_CALLS = frozenset({"uses_triton", "_kernels", "native", "_native_decode", "_triton_wire", "_selecting",
                           "_torch_ops_form"})
BACKEND_NAMES = frozenset({"fused", "ext", "triton", "selecting", "in_place"})
BACKEND_STRINGS = frozenset({"fused", "triton"})
#: the provider modules, where choosing among kernels is the job
PROVIDER_FILE = re.compile(r"^(backends|.*_kernels)\.py$")
#: an expression that is a compressor (``compressor``, ``state.compressor``)
COMPRESSOR_EXPRESSION = re.compile(r"(^|\.)compressor$")


#: the Trainer and Fabric front ends of each engine: (label, module, class), twice
FRONT_END_PAIRS = (
    ("DDP", ("strategies/strategy.py", "GradCompStrategy"), ("strategies/fabric.py", "GradCompFabricStrategy")),
    ("sharded", ("strategies/sharded.py", "ShardedGradCompStrategy"),
     ("strategies/fabric.py", "ShardedGradCompFabricStrategy")),
)


@dataclass
class Counts:
    compressor_lines: dict[str, tuple[int, list[str]]] = field(default_factory=dict)
    shared_lines: tuple[int, list[str]] = (0, [])
    group_step_functions: list[str] = field(default_factory=list)
    byte_places: list[str] = field(default_factory=list)
    byte_counters: list[str] = field(default_factory=list)
    contract_methods: list[str] = field(default_factory=list)
    contract_flags: list[str] = field(default_factory=list)
    contract_attributes: list[str] = field(default_factory=list)
    undeclared_attributes: list[str] = field(default_factory=list)
    root_entries: list[str] = field(default_factory=list)
    root_modules: list[str] = field(default_factory=list)
    root_packages: list[str] = field(default_factory=list)
    #: per engine: the options both front ends write out, and the larger constructor's parameter count
    mirrored_options: dict[str, tuple[list[str], int]] = field(default_factory=dict)
    pass_through_properties: list[str] = field(default_factory=list)
    backend_branches: list[str] = field(default_factory=list)


def _library_files(library: Path) -> list[Path]:
    return sorted(p for p in library.rglob("*") if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts)


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


def _called_name(node: ast.AST) -> str | None:
    """The name a call calls (``f(...)``: ``f``; ``x.f(...)``: ``f``), else ``None``."""
    if not isinstance(node, ast.Call):
        return None
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    if isinstance(node.func, ast.Name):
        return node.func.id
    return None


def _has_size(node: ast.AST, kinds: frozenset[str] = SIZES) -> bool:
    """Whether an expression reads a tensor's or record's size: ``x.numel()`` (or a record's ``numel``),
    ``x.element_size()``, ``x.nbytes`` (those of ``kinds``)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if _called_name(n) in LEDGER_FORMULAS:
            continue
        if isinstance(n, ast.Attribute) and n.attr in kinds:
            return True
        stack.extend(ast.iter_child_nodes(n))
    return False


def _target_name(node: ast.AST) -> str | None:
    """The name an assignment stores under (``x``, ``self.x``, ``self.x[i]``: ``x``)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_byte_name(name: str | None) -> bool:
    return name is not None and bool(BYTE_NAME.search(name))


def _performs_group_step(function: ast.AST, in_hook: bool, quantizers: set[str]) -> bool:
    for node in _own_nodes(function):
        called = _called_name(node)
        if called is None:
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and called in ENCODE_CALLS:
            return True
        if called in HOOK_STEP_PIECES and not in_hook:
            return True
        if called in quantizers:
            return True
    return False


def _computes_bytes(name: str, function: ast.AST) -> bool:
    for node in _own_nodes(function):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_is_byte_name(_target_name(t)) for t in targets) and _has_size(node.value):
                return True
        if isinstance(node, ast.Return) and node.value is not None and _is_byte_name(name.rpartition(".")[2]):
            if _has_size(node.value):
                return True
        if isinstance(node, ast.keyword) and _is_byte_name(node.arg) and _has_size(node.value):
            return True
        called = _called_name(node)
        if called is not None and LEDGER_CALLS.match(called) and isinstance(node, ast.Call):
            if any(_has_size(a) for a in node.args):
                return True
        if called in ("sum", "tuple") and isinstance(node, ast.Call):
            # packet sizes summed or listed per layer
            if any(_has_size(a, frozenset({"element_size", "nbytes"})) for a in node.args):
                return True
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            sides = (node.left, node.right)
            if any(isinstance(s, ast.Constant) and s.value == 4 for s in sides) and any(
                _has_size(s, frozenset({"numel"})) for s in sides
            ):
                return True  # fp32's width written by hand
    return False


def _keeps_byte_count(function: ast.AST) -> bool:
    """Whether a function writes a byte count kept on an object (see the module docstring)."""
    for node in _own_nodes(function):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = [t.value for t in node.targets if isinstance(t, ast.Subscript)]
        elif isinstance(node, ast.AugAssign):
            targets = [node.target.value if isinstance(node.target, ast.Subscript) else node.target]
        if any(isinstance(t, ast.Attribute) and _is_byte_name(t.attr) for t in targets):
            return True
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in RUN_BYTES_WRITERS
                and isinstance(node.func.value, ast.Attribute) and _is_byte_name(node.func.value.attr)):
            return True
    return False


def _quantizers(library: Path, files: list[Path]) -> set[str]:
    """Public module-level quantizers defined outside the compressors and kernels (written beside the contract)."""
    found: set[str] = set()
    for path in files:
        if path.suffix != ".py" or path.relative_to(library).parts[0] in COMPRESSOR_DIRS:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and QUANTIZER_NAME.search(node.name):
                found.add(node.name)
    return found


def _undeclared_attributes(tree: ast.AST, declared: set[str]) -> set[str]:
    """Attributes read off a compressor by name (``getattr(<...compressor...>, "x", ...)``, ``hasattr``) that the
    contract does not declare."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if _called_name(node) in ("getattr", "hasattr") and isinstance(node, ast.Call) and len(node.args) >= 2:
            owner, attr = node.args[0], node.args[1]
            if (isinstance(attr, ast.Constant) and isinstance(attr.value, str)
                    and COMPRESSOR_EXPRESSION.search(ast.unparse(owner)) and attr.value not in declared):
                found.add(attr.value)
    return found


def _asks_backend(test: ast.AST) -> bool:
    """Whether a condition asks which kernels run (see :data:`BACKEND_CALLS`)."""
    for node in ast.walk(test):
        if _called_name(node) in BACKEND_CALLS and isinstance(node, ast.Call):
            return True
        if isinstance(node, ast.Name) and node.id in BACKEND_NAMES:
            return True
        if isinstance(node, ast.Compare) and any(
            isinstance(c, ast.Constant) and c.value in BACKEND_STRINGS for c in [node.left, *node.comparators]
        ):
            return True
    return False


def _backend_branches(tree: ast.AST) -> list[int]:
    """Lines of the conditions in ``tree`` that ask which kernels run (an ``and``/``or`` inside a counted condition
    is that condition's)."""
    lines: list[int] = []
    inside: set[int] = set()
    for node in ast.walk(tree):
        test = node.test if isinstance(node, (ast.If, ast.IfExp, ast.While)) else node if isinstance(node, ast.BoolOp) else None
        if test is None or id(node) in inside:
            continue
        if _asks_backend(test):
            lines.append(test.lineno)
            inside.update(id(n) for n in ast.walk(test))
    return sorted(lines)


def _is_flag(annotation: ast.AST | None) -> bool:
    """``bool`` or ``Optional[bool]`` (a tri-state: ``None`` lets the runtime choose)."""
    return annotation is not None and ast.unparse(annotation).replace(" ", "") in ("bool", "Optional[bool]", "bool|None")


def count(library: Path = LIBRARY) -> Counts:
    counts = Counts()
    files = _library_files(library)
    root = library.parent
    attributed: set[Path] = set()
    for label, stems in COMPRESSOR_STEMS.items():
        stems = (stems,) if isinstance(stems, str) else stems
        mine = [p for p in files if any(stem in p.name for stem in stems)]
        attributed.update(mine)
        counts.compressor_lines[label] = (sum(_lines(p) for p in mine), [str(p.relative_to(root)) for p in mine])
    shared = [p for p in files if p.relative_to(library).parts[0] in COMPRESSOR_DIRS and p not in attributed]
    counts.shared_lines = (sum(_lines(p) for p in shared), [str(p.relative_to(root)) for p in shared])
    quantizers = _quantizers(library, files)
    base = ast.parse((library / "compressors" / "base.py").read_text())
    for node in ast.walk(base):
        if isinstance(node, ast.ClassDef) and node.name == "Compressor":
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                    counts.contract_methods.append(item.name)
                targets: list[tuple[str, ast.AST | None]] = []
                if isinstance(item, ast.Assign):
                    targets = [(t.id, None) for t in item.targets if isinstance(t, ast.Name)]
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    targets = [(item.target.id, item.annotation)]
                for attr, annotation in targets:
                    if attr.startswith("_"):
                        continue
                    counts.contract_attributes.append(attr)
                    if _is_flag(annotation):
                        counts.contract_flags.append(attr)
    for path in files:
        if path.suffix == ".py" and path.parent == library / "compressors" and not PROVIDER_FILE.match(path.name):
            where = str(path.relative_to(library))
            counts.backend_branches += [f"{where}::{line}" for line in _backend_branches(ast.parse(path.read_text()))]
    declared = set(counts.contract_methods) | set(counts.contract_attributes)
    undeclared: set[str] = set()
    for path in files:
        if path.suffix != ".py":
            continue
        relative = path.relative_to(library)
        tree = ast.parse(path.read_text())
        runtime = relative.parts[0] not in COMPRESSOR_DIRS
        if runtime:
            undeclared |= _undeclared_attributes(tree, declared)
        for name, function in _functions(tree):
            where = f"{relative}::{name}"
            if runtime and _performs_group_step(function, relative.name == "hook.py", quantizers):
                counts.group_step_functions.append(where)
            if _computes_bytes(name, function) and where not in LAYOUT_SIZES:
                counts.byte_places.append(where)
            if relative.name != "ledger.py" and _keeps_byte_count(function):
                counts.byte_counters.append(where)
    counts.undeclared_attributes = sorted(undeclared)
    entries = sorted(p for p in library.iterdir() if p.name != "__pycache__")
    counts.root_entries = [p.name for p in entries]
    counts.root_modules = [p.name for p in entries if p.suffix == ".py" and not p.name.startswith("_")]
    counts.root_packages = [p.name for p in entries if p.is_dir() and (p / "__init__.py").exists()]
    for label, trainer, fabric in FRONT_END_PAIRS:
        a, b = (_constructor_parameters(library, *side) for side in (trainer, fabric))
        counts.mirrored_options[label] = ([n for n in a if n in b], max(len(a), len(b)))
    counts.pass_through_properties = _pass_through_properties(library)
    return counts


def _constructor_parameters(library: Path, module: str, cls: str) -> list[str]:
    """The parameter names ``cls.__init__`` writes out (``self``, ``*args``, ``**kwargs`` and a ``with_options``
    constructor's ``options`` aside: the options object's fields are declared in its dataclass)."""
    path = library / module
    for node in ast.walk(ast.parse(path.read_text())) if path.exists() else ():
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    args = item.args.posonlyargs + item.args.args + item.args.kwonlyargs
                    return [a.arg for a in args if a.arg not in ("self", "options")]
    return []


def _pass_through_properties(library: Path) -> list[str]:
    """``GradCompState``'s properties whose body is ``return self.<owner>.<value>``."""
    found: list[str] = []
    path = library / "exchange/hook.py"
    for node in ast.walk(ast.parse(path.read_text())) if path.exists() else ():
        if isinstance(node, ast.ClassDef) and node.name == "GradCompState":
            for item in node.body:
                body = [b for b in getattr(item, "body", []) if not (isinstance(b, ast.Expr)
                                                                     and isinstance(b.value, ast.Constant))]
                if (isinstance(item, ast.FunctionDef) and any(ast.unparse(d) == "property" for d in item.decorator_list)
                        and len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None
                        and re.fullmatch(r"self\.\w+\.\w+", ast.unparse(body[0].value))):
                    found.append(item.name)
    return found
def contract_names(counts: Counts) -> list[str]:
    """The compressor contract's public names: methods, then class attributes."""
    return counts.contract_methods + counts.contract_attributes


def _modules(places: list[str]) -> int:
    return len({p.partition("::")[0] for p in places})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("library", nargs="?", type=Path, default=LIBRARY,
                        help="the library package to count (default: this checkout's lightning_gradcomp)")
    parser.add_argument("--list", action="store_true", help="name every file, function and entry counted")
    args = parser.parse_args()
    counts = count(args.library.resolve())
    print("| what | count |")
    print("| --- | --- |")
    for label, (lines, paths) in counts.compressor_lines.items():
        print(f"| lines of {label} ({len(paths)} files) | {lines} |")
    print(f"| lines under compressors/ and kernels/ of no single compressor ({len(counts.shared_lines[1])} files) | "
          f"{counts.shared_lines[0]} |")
    print(f"| functions that perform a group step (outside compressors/, kernels/; in modules) | "
          f"{len(counts.group_step_functions)} ({_modules(counts.group_step_functions)}) |")
    runtime = [p for p in counts.byte_places if p.partition("/")[0] not in COMPRESSOR_DIRS]
    print(f"| functions that compute bytes on the wire (in modules; of them outside compressors/, kernels/) | "
          f"{len(counts.byte_places)} ({_modules(counts.byte_places)}; {len(runtime)}) |")
    print(f"| functions that keep a byte count outside the ledger (in modules) | "
          f"{len(counts.byte_counters)} ({_modules(counts.byte_counters)}) |")
    print(f"| Compressor's public methods | {len(counts.contract_methods)} |")
    print(f"| Compressor's public class attributes (flags among them) | "
          f"{len(counts.contract_attributes)} ({len(counts.contract_flags)}) |")
    print(f"| Compressor's public names in all (methods and class attributes) | {len(contract_names(counts))} |")
    print(f"| compressor attributes the runtime reads by name, undeclared by the contract | "
          f"{len(counts.undeclared_attributes)} |")
    print(f"| entries at the library's root (public modules, packages) | {len(counts.root_entries)} "
          f"({len(counts.root_modules)}, {len(counts.root_packages)}) |")
    for label, (names, total) in counts.mirrored_options.items():
        print(f"| {label} strategy options written in both the Trainer's and the Fabric front end (of the larger's "
              f"parameters) | {len(names)} ({total}) |")
    print(f"| GradCompState's pass-through properties | {len(counts.pass_through_properties)} |")
    print(f"| backend branches at call sites (compressors/ outside the providers; in modules) | "
          f"{len(counts.backend_branches)} ({_modules(counts.backend_branches)}) |")
    if args.list:
        for label, (names, _) in counts.mirrored_options.items():
            print(f"\n{label} options in both front ends: " + ", ".join(names))
        print("\npass-through properties: " + ", ".join(counts.pass_through_properties))
        for label, (_, paths) in counts.compressor_lines.items():
            print(f"\n{label}: " + ", ".join(paths))
        print("\nno single compressor: " + ", ".join(counts.shared_lines[1]))
        for title, names in (
            ("group step", counts.group_step_functions),
            ("bytes on the wire", counts.byte_places),
            ("byte counts outside the ledger", counts.byte_counters),
            ("contract methods", counts.contract_methods),
            ("contract attributes", counts.contract_attributes),
            ("contract flags", counts.contract_flags),
            ("contract names", contract_names(counts)),
            ("undeclared attributes", counts.undeclared_attributes),
            ("root entries", counts.root_entries),
            ("backend branches", counts.backend_branches),
        ):
            print(f"\n{title}:")
            for name in names:
                print(f"  {name}")


if __name__ == "__main__":
    main()
