"""A quantized weight all-gather for FSDP2 models sharded across nodes (``set_custom_all_gather``): ZeRO++'s qwZ.

When a model is sharded over the ranks of several nodes, FSDP2 all-gathers each unit's weights before its forward
(and again before its backward, for a unit that reshards after forward), and every all-gather crosses the slow link
between nodes densely. :class:`HierarchicalAllGather` replaces it, unit by unit, mirroring
:class:`~lightning_gradcomp.strategies.fsdp_collectives.HierarchicalReduceScatter`'s two stages in reverse (nodes of
``node_size`` consecutive ranks; local rank ``l`` of every node is a *peer* group):

1. between nodes, each rank quantizes its own piece (FSDP2's all-gather input: the unit's parameter shards back to
   back) to blockwise int8, one fp32 scale per block of ``block_size`` elements
   (:class:`~lightning_gradcomp.compressors.blockint8.BlockInt8`, the compressed reduce-scatter's), and all-gathers
   codes and scales over its peers; every peer decodes every piece the same way;
2. inside each node, a dense all-gather of the decoded pieces (one per node) over the node's ranks.

Every rank then computes with the same weights, bit for bit: each piece decoded from the same codes and scales,
including the rank's own piece and its node's (the rank replaces its own full-precision piece with the decoded one,
so the ranks of a node do not compute with weights that the other nodes see quantized). The master shard, which the
optimizer updates, stays full precision: FSDP2 copies it into the all-gather's buffer, and only that copy is
replaced. The backward's all-gather quantizes the same master shard again, so forward and backward see the same
weights.

ZeRO++ (Wang et al., 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model Training", qwZ)
quantizes the weights of ZeRO-3's all-gather blockwise to int8; DeepSpeed's ``CUDAQuantizer`` picks blocks of up to
8,000 elements. The default block here is 256 elements, the reduce-scatter's: a scale costs 4 bytes per 256 (1.6 %),
and the rounding error per block is its largest magnitude / 254.

Bytes are recorded in a :class:`~lightning_gradcomp.exchange.ledger.Ledger` of the all-gather's own: between nodes
per unit (what :meth:`Ledger.bytes_per_step` reports), inside a node on the ``"lan"`` channel. Its steps are training
steps: each opens at the forward of the model's outermost FSDP2 unit with gradients enabled; all-gathers of a forward
without gradients (validation, inference) are quantized the same way but not counted.
"""

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
from typing_extensions import override

from lightning_gradcomp.compressors.base import Aggregation
from lightning_gradcomp.compressors.blockint8 import BlockInt8
from lightning_gradcomp.exchange.ledger import LayerRecord, Ledger, tensor_bytes
from lightning_gradcomp.flat import Segments
from lightning_gradcomp.sites.layout import SiteLayout
from lightning_gradcomp.strategies.shards import fsdp_units
from lightning_gradcomp.strategies.fsdp_collectives import LAN, cross_node_units, node_groups, node_layout

#: the default elements per int8 block (one fp32 scale each): the compressed reduce-scatter's
BLOCK_SIZE = 256


class HierarchicalAllGather(AllGather):
    """FSDP2's all-gather of one unit, blockwise int8 between nodes and dense inside a node (module docstring).

    Args:
        name: the unit's name in the ledger.
        layout: the nodes (equal sizes).
        node_group: this rank's node's group.
        peer_group: the group of this rank's peers (its local rank in every node), in node order.
        ledger: where the bytes go.
        quantizer: the blockwise int8 (the compressed reduce-scatter's, without error feedback).
        counting: whether the current call belongs to a training step (its bytes are recorded).
    """

    def __init__(self, name: str, layout: SiteLayout, node_group: Optional[dist.ProcessGroup],
                 peer_group: Optional[dist.ProcessGroup], ledger: Ledger, quantizer: BlockInt8,
                 counting: Callable[[], bool]) -> None:
        self.name = name
        self.layout = layout
        self.node_group = node_group
        self.peer_group = peer_group
        self.ledger = ledger
        self.quantizer = quantizer
        self.counting = counting
        self._segments: dict[int, Segments] = {}

    @override
    def allocate(self, size: Sequence[Union[int, torch.SymInt]], *, dtype: torch.dtype,
                 device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @override
    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> Optional[dist.Work]:
        nodes, local = self.layout.num_sites, self.layout.sizes[0]
        if group.size() != nodes * local:
            raise RuntimeError(
                f"Expected FSDP2 to all-gather over the {nodes * local} ranks of the node layout, but got a group of "
                f"{group.size()}. Fix: shard the model with `fully_shard` over every rank (a 1-D mesh)."
            )
        if not output_tensor.is_floating_point():
            raise RuntimeError(
                f"Expected a floating-point all-gather buffer for the quantized all-gather, but got "
                f"{output_tensor.dtype} (a unit whose parameters have different dtypes). Fix: give every parameter "
                f"of a `fully_shard` unit one floating dtype, or use `MixedPrecisionPolicy(param_dtype=...)`."
            )
        piece = input_tensor.numel()
        segments = self._segments.get(piece)
        if segments is None:
            segments = self._segments[piece] = Segments([self.name], [torch.Size([piece])])
        # the reduce-scatter's blockwise int8 (read before the output, which holds the input, is overwritten)
        packet = self.quantizer.compress_flat(input_tensor, segments)
        size = packet.payload.numel()
        received = packet.payload
        if nodes > 1:
            received = packet.payload.new_empty(nodes * size)
            dist.all_gather_single(received, packet.payload, group=self.peer_group)
        # [node, piece]: the pieces of this rank's peers, decoded as every other rank decodes them
        decoded = torch.stack([self.quantizer.decompress_flat(packet.with_payload(received[m * size : (m + 1) * size]))
                               for m in range(nodes)]).to(output_tensor.dtype)
        by_rank = output_tensor.view(nodes, local, piece)  # rank n * local + l holds piece [n, l]
        if local > 1:
            gathered = decoded.new_empty(local, nodes, piece)
            dist.all_gather_single(gathered.view(-1), decoded.reshape(-1), group=self.node_group)
            by_rank.copy_(gathered.transpose(0, 1))
        else:
            by_rank[:, 0].copy_(decoded)
        if self.counting():
            self._record(tensor_bytes(packet.payload), piece, tensor_bytes(decoded))
        return None

    def _record(self, own_bytes: int, piece: int, node_bytes: int) -> None:
        """This call's bytes: its own codes and scales to each of the ``nodes - 1`` other nodes, and its node's
        decoded pieces (``node_bytes``) to each of the other ranks of its node."""
        nodes, local = self.layout.num_sites, self.layout.sizes[0]
        # the elements sent between nodes: their fp32 is the dense reference; a unit gathers twice a step
        self.ledger.record_more(self.name, LayerRecord((nodes - 1) * own_bytes, (nodes - 1) * piece,
                                                       Aggregation.GATHER, {}))
        if local > 1:
            self.ledger.record_channel(LAN, (local - 1) * node_bytes)


class QuantizedAllGather:
    """Installs :class:`HierarchicalAllGather` on every FSDP2 unit of a model sharded over all ranks.

    Every rank must call this, in the same order (it makes the node and peer groups, unless ``groups`` are given).

    Args:
        model: the model, already sharded by ``fully_shard`` over a 1-D mesh of every rank.
        node_size: ranks per node (consecutive ranks).
        block_size: elements per int8 block (each block sends one fp32 scale).
        timeout: the groups' collective timeout.
        groups: this rank's node group and peer group, to share those of a
            :class:`~lightning_gradcomp.strategies.fsdp_collectives.CompressedReduceScatter` (its ``groups``) over
            the same nodes; ``None``: made here.

    Raises:
        ValueError: bad input (a node size that does not divide the world, a model not sharded over every rank in
            rank order, a unit whose parameters are not all of one floating dtype), before any collective.
    """

    def __init__(self, model: nn.Module, node_size: int, block_size: int = BLOCK_SIZE,
                 timeout: Optional[timedelta] = None,
                 groups: Optional[tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]] = None) -> None:
        quantizer = BlockInt8(block_size, error_feedback=False)  # checks block_size
        world, rank = dist.get_world_size(), dist.get_rank()
        self.layout = node_layout(world, node_size)
        self.units = cross_node_units(model, world, "quantized all-gather")
        for unit in self.units:
            _check_dtypes(unit)
            _check_reshard(unit, world)
        node_group, peer_group = node_groups(self.layout, rank, timeout) if groups is None else groups
        self.ledger = Ledger()
        self._counting = False
        names = {id(m): n or "<root>" for n, m in model.named_modules()}
        self.comms: list[HierarchicalAllGather] = []
        for unit in self.units:
            comm = HierarchicalAllGather(names[id(unit)], self.layout, node_group, peer_group, self.ledger,
                                         quantizer, self._is_counting)
            unit.set_custom_all_gather(comm)  # type: ignore[operator]
            self.comms.append(comm)
        # a training step begins with the forward of the outermost unit: before FSDP2's own pre-forward hook
        # (prepended too, earlier), which issues that unit's all-gather
        self._handle = fsdp_roots(model)[0].register_forward_pre_hook(self._step_begins, prepend=True)

    def _is_counting(self) -> bool:
        return self._counting

    def _step_begins(self, module: nn.Module, args: Any) -> None:
        # a forward with gradients is a training step's: its all-gathers and its backward's are that step's bytes
        self._counting = torch.is_grad_enabled()
        if self._counting:
            self.ledger.bucket_called(False, first=True)

    def bytes_per_step(self) -> int:
        """Bytes this rank sent to the other nodes per training step, averaged over the steps so far (the ledger's
        :meth:`~lightning_gradcomp.exchange.ledger.Ledger.bytes_per_step`)."""
        return self.ledger.bytes_per_step()

    def last_step_bytes(self) -> int:
        """Bytes this rank sent to the other nodes in the latest training step."""
        return self.ledger.last_step_bytes()


def fsdp_roots(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 units of ``model`` that no other unit contains, in module order (the root, when it is sharded)."""
    units = fsdp_units(model)
    inner = {id(m) for u in units for m in u.modules() if m is not u}
    return [u for u in units if id(u) not in inner]


def _check_dtypes(unit: nn.Module) -> None:
    """Refuse a unit whose all-gather would not be one floating dtype (FSDP2 then gathers raw bytes).

    Raises:
        ValueError: parameters of several dtypes (after the unit's mixed-precision ``param_dtype``), or integers.
    """
    group = unit._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
    # FSDP2 casts a floating parameter to the policy's ``param_dtype`` for the all-gather (its own record of that is
    # made at the first forward)
    cast = group.mp_policy.param_dtype
    dtypes = {cast if cast is not None and p.sharded_param.is_floating_point() else p.sharded_param.dtype
              for p in group.fsdp_params}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise ValueError(
            f"Expected the parameters of every `fully_shard` unit to share one floating dtype for the quantized "
            f"all-gather, but got {sorted(str(d) for d in dtypes)} in {type(unit).__name__}. Fix: cast the unit's "
            f"parameters to one dtype, or set `MixedPrecisionPolicy(param_dtype=...)` on its `fully_shard`."
        )


def _check_reshard(unit: nn.Module, world: int) -> None:
    """Refuse a unit that reshards after forward to fewer ranks (``reshard_after_forward=<int>``): its backward
    all-gather would run over a group inside a node, which this all-gather does not serve.

    Raises:
        ValueError: ``reshard_after_forward`` of fewer ranks than the world.
    """
    info = unit._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info  # type: ignore[operator]
    if info is not None and info.shard_mesh_size != world:
        raise ValueError(
            f"Expected `reshard_after_forward` to be True or False on every `fully_shard` unit for the quantized "
            f"all-gather, but got {type(unit).__name__} resharding to {info.shard_mesh_size} ranks. Fix: pass "
            f"`reshard_after_forward=True` (or False) to `fully_shard`."
        )
