"""A hierarchical, compressed reduce-scatter for FSDP2 models sharded across nodes (``set_custom_reduce_scatter``).

When a model is sharded over the ranks of several nodes, FSDP2's reduce-scatter of each unit's gradients crosses
the slow link between nodes every step, densely. :class:`HierarchicalReduceScatter` replaces it, unit by unit, in two
stages over the node and peer groups of a :class:`~lightning_gradcomp.sites.layout.SiteLayout` (nodes are sites of
equal size; rank ``n * L + l`` is local rank ``l`` of node ``n``):

1. inside each node, a dense reduce-scatter: local rank ``l`` ends with its node's sum of the pieces of every rank
   whose local rank is ``l`` (one piece per node);
2. between nodes, local rank ``l`` of every node (its *peers*) exchange those pieces: each rank sends piece ``m``
   to the peer of node ``m`` and sums the pieces it receives for itself. Dense (``Identity``: a reduce-scatter over
   the peers) or blockwise int8 (``Int8``: as ZeRO++'s qgZ, each block of ``block_size`` elements travels as int8
   codes with its own fp32 scale, by an all-to-all; each piece is decoded and summed by its owner only, in peer
   order), with error feedback on what this rank quantized.

Only the gradients' reduce-scatter is compressed here; the weights' all-gather is
:mod:`~lightning_gradcomp.strategies.fsdp_all_gather`'s (blockwise int8 maths and groups from here), else FSDP2's own.
Every byte sent is recorded in a :class:`~lightning_gradcomp.exchange.ledger.Ledger`: between nodes as the unit's
record (what :meth:`Ledger.bytes_per_step` reports), inside a node on the ``"lan"`` channel.
"""

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from typing_extensions import override

import lightning_gradcomp.registry as registry
from lightning_gradcomp.compressors.base import Aggregation, Compressor
from lightning_gradcomp.compressors.identity import Identity
from lightning_gradcomp.compressors.int8 import Int8
from lightning_gradcomp.exchange.ledger import LayerRecord, Ledger, tensor_bytes
from lightning_gradcomp.sites.layout import SiteLayout, new_group
from lightning_gradcomp.strategies.shards import fsdp_units
from lightning_gradcomp.validation import check_int

#: the largest int8 code: a block's largest magnitude maps to it
_INT8_MAX = 127
#: the ledger's channel for the dense stage inside a node
LAN = "lan"


def node_layout(world_size: int, node_size: int) -> SiteLayout:
    """Nodes of ``node_size`` consecutive ranks (the site layout the two stages use).

    Raises:
        ValueError: ``node_size`` is not a positive divisor of ``world_size``.
    """
    check_int("node_size", node_size, minimum=1, fix="pass the ranks of one node, e.g. 8")
    if world_size % node_size:
        raise ValueError(
            f"Expected `node_size` to divide the world size ({world_size} ranks), but got {node_size}. Fix: pass "
            f"the ranks of one node, a divisor of {world_size}."
        )
    return SiteLayout((node_size,) * (world_size // node_size))


def check_compressor(compressor: Union[Compressor, str]) -> Compressor:
    """The compressor of the stage between nodes, if it can serve a reduce-scatter.

    A reduce-scatter sums each piece over the ranks: the compressor's packets must be summable (``Aggregation.SUM``).
    ``Identity`` sends the pieces densely, ``Int8`` as blockwise int8 rounded to nearest (its shared scale and its
    stochastic rounding, made for an all-reduce, play no part here).

    Raises:
        ValueError: a compressor whose packets are gathered, or one this reduce-scatter does not run yet.
    """
    if isinstance(compressor, str):
        compressor = registry.make_compressor(compressor)
    name = type(compressor).__name__
    if compressor.aggregation != Aggregation.SUM and not any(
        v.aggregation == Aggregation.SUM for v in compressor.collectives(2)
    ):
        raise ValueError(
            f"Expected a compressor whose packets can be summed (aggregation `sum`) for the compressed "
            f"reduce-scatter, but got {name} (aggregation `{compressor.aggregation.value}`): its packets are "
            f"gathered and decoded one by one, which a reduce-scatter cannot do. Fix: use `compressor='int8'` "
            f"(blockwise int8) or `'fp32'` (dense)."
        )
    if type(compressor) not in (Identity, Int8):  # a subclass may travel otherwise
        raise ValueError(
            f"Expected `compressor` to be 'int8' or 'fp32' for the compressed reduce-scatter, but got {name}. Fix: "
            f"use `compressor='int8'` (blockwise int8 between nodes) or `'fp32'` (dense, as stock FSDP2)."
        )
    return compressor


def int8_blocks(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Blockwise int8 rounded to nearest: ``blocks`` (``[..., block]``, fp32) as int8 codes and one fp32 scale per
    block (its largest magnitude, which maps to 127; an all-zero block has scale 0). A non-finite block's scale is
    NaN or Inf, so it decodes non-finite (:func:`decode_blocks`) instead of hiding the value."""
    scales = blocks.abs().amax(dim=-1)
    inverse = torch.where(scales > 0, _INT8_MAX / scales.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return torch.round(blocks * inverse.unsqueeze(-1)).to(torch.int8), scales


def decode_blocks(codes: Tensor, scales: Tensor) -> Tensor:
    """What :func:`int8_blocks` sent, in fp32: the same bits on every rank that decodes the same codes and scales."""
    return codes.float() * (scales / _INT8_MAX).unsqueeze(-1)


def cross_node_units(model: nn.Module, world: int, collective: str) -> list[nn.Module]:
    """The FSDP2 units of ``model`` that hold parameters, checked to be sharded over every rank in rank order (a
    collective across nodes finds a node's pieces by global rank). ``collective`` names the caller in the errors.

    Raises:
        ValueError: no ``fully_shard`` unit, a unit sharded over fewer ranks (an HSDP mesh), or a mesh that does not
            list the ranks in order.
    """
    units = [u for u in fsdp_units(model) if u._get_fsdp_state()._fsdp_param_group is not None]  # type: ignore[operator]
    if not units:
        raise ValueError(
            f"Expected a model sharded with FSDP2, but got {type(model).__name__} with no `fully_shard` module. "
            f"Fix: call `fully_shard(block, mesh=mesh)` for each block, then on the root, before this."
        )
    for unit in units:
        group = unit._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
        size = group.mesh_info.shard_mesh_size
        if size != world or getattr(group.mesh_info, "replicate_mesh_size", 1) != 1:
            raise ValueError(
                f"Expected every unit sharded over all {world} ranks (a 1-D mesh) for the {collective} across "
                f"nodes, but got {type(unit).__name__} sharded over {size}. Fix: pass a 1-D mesh of every rank "
                f"to `fully_shard` (or use `ShardedGradCompStrategy` for HSDP with a node per replica)."
            )
        order = group.mesh_info.mesh.mesh.reshape(-1).tolist()
        if order != list(range(world)):
            # FSDP2 gives piece i to the mesh's i-th rank: the nodes' pieces are found by global rank
            raise ValueError(
                f"Expected the mesh of `fully_shard` to list the ranks in order (0 .. {world - 1}), so that the "
                f"pieces of a node are its ranks', but got {order}. Fix: `init_device_mesh(device, ({world},))`."
            )
    return units


def node_groups(layout: SiteLayout, rank: int, timeout: Optional[timedelta]
                ) -> tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]:
    """This rank's node group and peer group (its local rank in every node, in node order). Every rank makes every
    group, in the same order."""
    node_group = peer_group = None
    for node in range(layout.num_sites):
        group = new_group(layout.ranks(node), timeout)
        if node == layout.site_of(rank):
            node_group = group
    for local in range(layout.sizes[0]):
        group = new_group([start + local for start in layout.starts], timeout)
        if local == rank - layout.starts[layout.site_of(rank)]:
            peer_group = group
    return node_group, peer_group


class HierarchicalReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter of one unit, dense inside a node and compressed between nodes (module docstring).

    Args:
        name: the unit's name in the ledger.
        layout: the nodes (equal sizes).
        rank: this rank's global rank.
        node_group: this rank's node's group.
        peer_group: the group of this rank's peers (its local rank in every node), in node order.
        ledger: where the bytes go.
        blocks: ``None``: dense between nodes; else the int8 block size.
        error_feedback: with ``blocks``, keep what quantization dropped and add it back next step.
        on_call: called first at every call (the ledger's step count: see :class:`CompressedReduceScatter`).
    """

    def __init__(self, name: str, layout: SiteLayout, rank: int, node_group: Optional[dist.ProcessGroup],
                 peer_group: Optional[dist.ProcessGroup], ledger: Ledger, blocks: Optional[int] = None,
                 error_feedback: bool = True, on_call: Optional[Callable[[], None]] = None) -> None:
        self.name = name
        self.layout = layout
        self.rank = rank
        self.node_group = node_group
        self.peer_group = peer_group
        self.ledger = ledger
        self.blocks = blocks
        self.error_feedback = error_feedback
        self.on_call = on_call
        self.residual: Optional[Tensor] = None
        # the residual the latest call replaced, for :meth:`rollback` (a step skipped after the exchange)
        self._previous: Optional[Tensor] = None

    def rollback(self) -> None:
        """Restore the residual from before the latest call: that step was skipped, so its gradient (and what the
        residual added to it) never reached the optimizer, and is carried to the next step as if never sent."""
        self.residual = self._previous

    @override
    def allocate(self, size: Sequence[Union[int, torch.SymInt]], *, dtype: torch.dtype,
                 device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @override
    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup,
                 op: object, async_op: bool = False) -> Optional[dist.Work]:
        nodes, local = self.layout.num_sites, self.layout.sizes[0]
        if group.size() != nodes * local:
            raise RuntimeError(
                f"Expected FSDP2 to reduce-scatter over the {nodes * local} ranks of the node layout, but got a "
                f"group of {group.size()}. Fix: shard the model with `fully_shard` over every rank (a 1-D mesh)."
            )
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise RuntimeError(
                f"Expected FSDP2 to reduce with SUM or AVG, but got {op}. Fix: leave `gradient_divide_factor` unset "
                f"under the compressed reduce-scatter."
            )
        if self.on_call is not None:
            self.on_call()
        piece = output_tensor.numel()
        # [node, local, piece] -> [local, node, piece]: local rank l's row holds the pieces of its peers
        by_local = input_tensor.view(nodes, local, piece).transpose(0, 1).contiguous()
        mine = by_local[0].reshape(-1) if local == 1 else by_local.new_empty(nodes * piece)
        if local > 1:
            dist.reduce_scatter_single(mine, by_local.view(-1), op=dist.ReduceOp.SUM, group=self.node_group)
            self.ledger.record_channel(LAN, tensor_bytes(by_local, (local - 1) * nodes * piece))
        if nodes == 1:
            output_tensor.copy_(mine)
            nbytes = 0
        elif self.blocks is None:
            dist.reduce_scatter_single(output_tensor, mine, op=dist.ReduceOp.SUM, group=self.peer_group)
            nbytes = tensor_bytes(mine, (nodes - 1) * piece)
        else:
            nbytes = self._int8_blocks(output_tensor, mine.view(nodes, piece), self.blocks)
        # numel: the elements sent between nodes (their fp32 bytes are the ledger's dense reference)
        self.ledger.record(self.name, LayerRecord(nbytes, (nodes - 1) * piece, Aggregation.SUM, {}))
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(nodes * local)
        return None

    def _int8_blocks(self, output: Tensor, pieces: Tensor, block: int) -> int:
        """Blockwise int8 between nodes: quantize every piece (``[nodes, piece]``), send piece ``m`` to peer ``m``,
        decode and sum what the peers sent for this rank. Returns the bytes this rank sent."""
        nodes, piece = pieces.shape
        block = min(block, piece)  # a piece smaller than a block is one block, unpadded
        padded = -(-piece // block) * block
        x = torch.zeros(nodes, padded, dtype=torch.float32, device=pieces.device)
        x[:, :piece] = pieces
        if self.error_feedback:
            if self.residual is None or self.residual.shape != x.shape:
                self.residual = torch.zeros_like(x)
            x += self.residual
        blocks = x.view(nodes, padded // block, block)
        codes, scales = int8_blocks(blocks)
        if self.error_feedback:
            assert self.residual is not None
            sent = decode_blocks(codes, scales)
            # a non-finite block travels as NaN (its scale), as stock FSDP2 would pass it on; its error is dropped
            # so that one bad step does not poison the residual for good
            self._previous = self.residual
            self.residual = torch.nan_to_num(blocks - sent, nan=0.0, posinf=0.0, neginf=0.0).view(nodes, padded)
        got_codes, got_scales = torch.empty_like(codes), torch.empty_like(scales)
        dist.all_to_all_single(got_codes, codes, group=self.peer_group)
        dist.all_to_all_single(got_scales, scales, group=self.peer_group)
        decoded = decode_blocks(got_codes, got_scales)  # [peers, blocks, block]
        total = decoded[0].reshape(-1)
        for peer in range(1, nodes):  # in peer order: the owner alone sums its piece
            total = total + decoded[peer].reshape(-1)
        output.copy_(total[:piece].to(output.dtype))
        own = self.layout.site_of(self.rank)
        return (nodes - 1) * (tensor_bytes(codes[own]) + tensor_bytes(scales[own]))


class CompressedReduceScatter:
    """Installs :class:`HierarchicalReduceScatter` on every FSDP2 unit of a model sharded over all ranks.

    Every rank must call this, in the same order (it makes the node and peer groups).

    Args:
        model: the model, already sharded by ``fully_shard`` over a 1-D mesh of every rank.
        node_size: ranks per node (consecutive ranks).
        compressor: between nodes, ``"fp32"``/``Identity`` (dense) or ``"int8"``/``Int8`` (blockwise int8).
        block_size: elements per int8 block (each block sends one fp32 scale).
        error_feedback: keep each rank's quantization error and add it back at the next step (int8).
        timeout: the groups' collective timeout.

    Raises:
        ValueError: bad input (a compressor that cannot serve a reduce-scatter, a node size that does not divide the
            world, a model not sharded over every rank), before any collective.
    """

    def __init__(self, model: nn.Module, node_size: int, compressor: Union[Compressor, str] = "int8",
                 block_size: int = 256, error_feedback: bool = True, timeout: Optional[timedelta] = None) -> None:
        check_int("block_size", block_size, minimum=1, fix="use e.g. 256 elements per int8 scale")
        self.compressor = check_compressor(compressor)
        world, rank = dist.get_world_size(), dist.get_rank()
        self.layout = node_layout(world, node_size)
        self.units = cross_node_units(model, world, "reduce-scatter")
        self.ledger = Ledger()
        self._calls = 0
        #: this rank's node group and peer group (:func:`node_groups`), for a quantized all-gather to share
        self.groups = node_groups(self.layout, rank, timeout)
        node_group, peer_group = self.groups
        blocks = block_size if isinstance(self.compressor, Int8) else None
        names = {id(m): n or "<root>" for n, m in model.named_modules()}
        self.comms = []
        for unit in self.units:
            comm = HierarchicalReduceScatter(names[id(unit)], self.layout, rank, node_group, peer_group, self.ledger,
                                             blocks, error_feedback, self._unit_called)
            unit.set_custom_reduce_scatter(comm)  # type: ignore[operator]
            self.comms.append(comm)

    def _unit_called(self) -> None:
        # every backward reduce-scatters every unit once: the first of a backward opens a step in the ledger (the
        # previous step's bytes, complete by then, join the run's total)
        first = self._calls == 0
        self._calls = (self._calls + 1) % len(self.comms)
        self.ledger.bucket_called(self._calls == 0, first=first)

    def rollback(self) -> None:
        """The latest step was skipped (a non-finite gradient): every unit's residual as before that step."""
        for comm in self.comms:
            comm.rollback()

    def bytes_per_step(self) -> int:
        """Bytes this rank sent to the other nodes per step, averaged over the steps so far (the ledger's
        :meth:`~lightning_gradcomp.exchange.ledger.Ledger.bytes_per_step`)."""
        return self.ledger.bytes_per_step()

    def last_step_bytes(self) -> int:
        """Bytes this rank sent to the other nodes in the latest step."""
        return self.ledger.last_step_bytes()
