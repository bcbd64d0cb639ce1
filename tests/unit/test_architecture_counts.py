"""``tools/architecture_counts.py`` counts what its rules say, on a small library written for the test (so the test
holds whatever the real library's counts become)."""

from pathlib import Path

from tools.architecture_counts import CONTRACT_LIMIT, LIBRARY, contract_names, count

FILES = {
    "compressors/base.py": '''
class Compressor:
    aggregation: "Aggregation" = None
    uses_memory: bool = False
    triton: Optional[bool] = None
    _private: bool = False

    def compress(self, x, name): ...
    def sent(self, x, packet): ...
    def _helper(self): ...

class Packet:
    @property
    def nbytes(self):
        return self.payload.numel() * self.payload.element_size()
''',
    "compressors/terngrad.py": "def compress(x):\n    return x.compress()\n",
    "compressors/terngrad_group.py": "x = 1\ny = 2\n",
    "kernels/csrc/terngrad.cpp": "int f();\n",
    "kernels/selection.py": "a = 1\n",
    "hook.py": '''
def _prepare(state, group, buffer): ...

def _compress_group(state, group, x):
    x = _prepare(state, group, x)
    packet = state.compressor.compress_flat(x, group.segments)
    sent = state.compressor.sent_flat(x, packet)  # the decoded contribution: a tensor, not bytes
    return packet

def _multiround(state, x):
    def finish(result):
        nbytes = tuple(n * x.element_size() for n in result.numels)
        return nbytes
    return state.compressor.exchange_flat(x, None, finish)

def _layout(buffer, span):
    return buffer.data_ptr() + span * buffer.element_size()  # an address: not bytes on the wire

def _announce(named, flat):
    dense = sum(dense_bytes(p.numel()) for p in named)  # the ledger's formulas: counted in the ledger
    lan = tensor_bytes(flat, flat.numel() - 1)
    return dense, lan
''',
    "towers.py": '''
from hook import _compress_group, _prepare

class Towers:
    def _exchange(self, states, x):
        prepared = [_prepare(s, None, x) for s in states]
        self.ledger.record_shared(0, 4 * x.numel())
        return [_compress_group(s, None, p) for s, p in zip(states, prepared)]
''',
    "weightgrad/quantize.py": '''
def stochastic_ternary(x, generator): ...
def pack_ternary(x): ...
''',
    "weightgrad/sync.py": '''
from weightgrad import quantize

class Sync:
    def _quantize(self, x):
        return quantize.stochastic_ternary(x, None)

    def launch(self, message):
        packed = quantize.pack_ternary(message)  # bit packing: the wire format, not a quantizer
        wan = message.numel() + 8
        return packed, wan

    def after_step(self, flags, site):
        self.wan.add(8)  # a RunBytes written beside the engine's
        site.lan_bytes[0] = 0  # a per-bucket byte table kept on a site
        self.wan_total += 8
        self.stats["bytes"] = 8  # a statistic's entry, read from elsewhere: not a count kept here
''',
    "callbacks/clip.py": '''
def own_clip(strategy):
    return getattr(strategy.compressor, "clip_factor", 0.0), getattr(type(strategy), "fset", None)
''',
    "ledger.py": '''
class Ledger:
    def bytes_per_step(self):
        return sum(r.nbytes for r in self.records.values())

    def record_lan(self, index, nbytes):
        self.lan_bytes[index] = nbytes  # the ledger's own table
''',
    "py.typed": "",
}


def _library(tmp_path: Path) -> Path:
    library = tmp_path / "lib"
    for name, text in FILES.items():
        path = library / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in ("compressors", "kernels", "weightgrad", "callbacks"):
        (library / package / "__init__.py").write_text("")
    (library / "__init__.py").write_text("")
    return library


def test_the_counts_follow_their_rules(tmp_path: Path) -> None:
    counts = count(_library(tmp_path))
    lines, files = counts.compressor_lines["TernGrad"]
    assert (lines, len(files)) == (2 + 2 + 1, 3)  # every file named after it, the C++ kernel included
    # files under compressors/ and kernels/ of no single compressor: the contract, a shared kernel, the inits
    assert counts.shared_lines[0] == len(FILES["compressors/base.py"].splitlines()) + 1
    # the group step: the hook's own encoders, the towers' reassembly of the hook's pieces, a quantizer written
    # outside the contract; not the compressors' own calls, not the bit packing, not the hook's private helpers
    assert counts.group_step_functions == [
        "hook.py::_compress_group",
        "hook.py::_multiround",
        "towers.py::Towers._exchange",
        "weightgrad/sync.py::Sync._quantize",
    ]
    # bytes: a packet's size, a per-layer tuple of widths, fp32's width by hand, WeightGrad's own count, the
    # ledger's sum; not `sent_flat` (a tensor), not an address computed from `element_size()`, not sizes handed to
    # the ledger's formulas
    assert counts.byte_places == [
        "compressors/base.py::Packet.nbytes",
        "hook.py::_multiround.finish",
        "ledger.py::Ledger.bytes_per_step",
        "towers.py::Towers._exchange",
        "weightgrad/sync.py::Sync.launch",
    ]
    # byte counts kept outside the ledger: a RunBytes stepped, a byte table's entry, a byte total added to; not the
    # ledger's own, not a statistic's entry
    assert counts.byte_counters == ["weightgrad/sync.py::Sync.after_step"]
    assert counts.contract_methods == ["compress", "sent"]
    assert counts.contract_attributes == ["aggregation", "uses_memory", "triton"]
    assert counts.contract_flags == ["uses_memory", "triton"]  # `Optional[bool]` is a (three-state) flag
    assert counts.undeclared_attributes == ["clip_factor"]  # read off a compressor; `fset` is read off a type
    assert counts.root_modules == ["hook.py", "ledger.py", "towers.py"]
    assert counts.root_packages == ["callbacks", "compressors", "kernels", "weightgrad"]
    assert len(counts.root_entries) == 9  # the modules, the packages, __init__.py, py.typed


FRONT_ENDS = {
    "compressors/base.py": "class Compressor: ...\n",
    "strategies/sharded.py": """
class ShardedGradCompStrategy:
    def __init__(self, compressor="terngrad", shard_size=None, node_size=None, **kwargs): ...
""",
    "strategies/strategy.py": """
class GradCompStrategy:
    @with_options(DDPOptions)
    def __init__(self, options, precision_plugin=None, **kwargs): ...
""",
    "strategies/fabric.py": """
class GradCompFabricStrategy:
    def __init__(self, compressor="terngrad", exclude=None, transforms=(), precision=None, **kwargs): ...

class ShardedGradCompFabricStrategy:
    def __init__(self, parallelize_fn=None, compressor="terngrad", shard_size=None): ...
""",
    "exchange/hook.py": """
class GradCompState:
    @property
    def world_size(self):
        \"\"\"Ranks in the group.\"\"\"
        return self.peers.world_size

    @property
    def stats(self):
        return self.observer if isinstance(self.observer, HookStats) else None

    def bytes_per_step(self):
        return self.ledger.bytes_per_step()
""",
}


def test_mirrored_options_and_pass_through_properties_are_counted(tmp_path: Path) -> None:
    for relative, text in FRONT_ENDS.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    counts = count(tmp_path)
    # the names both constructors write out; the options object's fields are not written in the constructor
    assert counts.mirrored_options == {"DDP": ([], 4), "sharded": (["compressor", "shard_size"], 3)}
    # a property returning another owner's value; not a computed view, not a method
    assert counts.pass_through_properties == ["world_size"]


def test_the_compressor_contract_has_at_most_twelve_names() -> None:
    """The real library's ``Compressor``: its public methods and class attributes (flags included) are at most
    :data:`~tools.architecture_counts.CONTRACT_LIMIT`: one small contract for every compressor; the kernel choice
    is the kernel provider's (``KernelBacked``), not the contract's."""
    counts = count(LIBRARY)
    names = contract_names(counts)
    assert len(names) <= CONTRACT_LIMIT == 12, names
    assert {"aggregation", "compress_flat", "decompress_flat"} <= set(names)  # what every compressor writes
    assert not {"kernels", "uses_triton", "triton", "compress", "decompress"} & set(names)
