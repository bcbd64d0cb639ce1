"""A hierarchical, compressed reduce-scatter for FSDP2 models sharded across nodes (``set_custom_reduce_scatter``).

When a model is sharded over the ranks of several nodes, FSDP2's reduce-scatter of each unit's gradients crosses
the slow link between nodes every step, densely. :class:`HierarchicalReduceScatter` replaces it, unit by unit, in two
stages over the node and peer groups of a :class:`~lightning_gradcomp.sites.layout.SiteLayout` (nodes are sites of
equal size; rank ``n * L + l`` is local rank ``l`` of node ``n``):

1. inside each node, a dense reduce-scatter: local rank ``l`` ends with its node's sum of the pieces of every rank
   whose local rank is ``l`` (one piece per node);
2. between nodes, local rank ``l`` of every node (its *peers*) exchange those pieces: each rank sends piece ``m``
   to the peer of node ``m`` and sums the pieces it receives for itself. Every piece goes through the hook's group
   step (:func:`~lightning_gradcomp.exchange.hook.group_steps`: error feedback kept per piece, the shared
   statistics' max over the peers, compression, the residual update, the ledger's record), one group per piece so
   that each piece decodes with its own context; then the packets travel on the peers'
   :class:`~lightning_gradcomp.exchange.transport.Transport`: summed on the way where they are summable
   (``Transport.sum_to_owners``: fp32, bf16, TernGrad's int8 ternaries), else each piece to its owner
   (``Transport.scatter_to_owners``), which decodes and sums them in peer order (blockwise int8 as ZeRO++'s qgZ,
   QSGD, 1-bit).

With the identity compressor (``"fp32"``) nothing is compressed: FSDP2's own reduce-scatter runs over every rank,
so the shards are stock FSDP2's bit for bit at every step, while the ledger records the dense bytes of the two
stages on each link (the fp32 reference the compressed runs are measured against).

Only the gradients' reduce-scatter is compressed here; the weights' all-gather is
:mod:`~lightning_gradcomp.strategies.fsdp_all_gather`'s (it shares the units' checks and the groups made here), else
FSDP2's own. Every byte sent is recorded in a :class:`~lightning_gradcomp.exchange.ledger.Ledger`: between nodes as the
pieces' records (what :meth:`Ledger.bytes_per_step` reports; a rank's own piece is compressed but never sent, so it is
not counted), inside a node on the ``"lan"`` channel.
"""

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from typing_extensions import override

import lightning_gradcomp.registry as registry
from lightning_gradcomp.compressors.base import Aggregation, Compressor, SelectsElements
from lightning_gradcomp.compressors.blockint8 import BlockInt8
from lightning_gradcomp.compressors.identity import Identity
from lightning_gradcomp.compressors.int8 import Int8
from lightning_gradcomp.compressors.multiround import MultiRoundCompressor
from lightning_gradcomp.exchange.groups import LayerGroup
from lightning_gradcomp.exchange.hook import GroupState, group_steps
from lightning_gradcomp.exchange.ledger import Ledger, tensor_bytes
from lightning_gradcomp.exchange.transport import ProcessGroupTransport
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.sites.layout import SiteLayout, new_group
from lightning_gradcomp.strategies.shards import fsdp_units
from lightning_gradcomp.validation import check_int

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


def check_compressor(compressor: Union[Compressor, str], block_size: int = 256,
                     error_feedback: bool = True) -> Compressor:
    """The compressor of the stage between nodes, if it can serve a reduce-scatter.

    A reduce-scatter delivers each piece to its owner, who decodes every peer's packet of it and sums them: the
    packets must encode every element (not a sparse selection, whose point is a gather to every rank), have a size
    known from the piece's alone, and be made in one round. ``Int8`` (the registered
    ``"int8"``) runs as :class:`~lightning_gradcomp.compressors.blockint8.BlockInt8`: blockwise int8 rounded to
    nearest with ``block_size`` elements per scale, as ZeRO++'s qgZ (its shared scale and stochastic rounding are
    made for an all-reduce); every other compressor as it is.

    Raises:
        ValueError: a sparse compressor (TopK, Gradient Dropping, DeMo, ...) or a multi-round one (PowerSGD: its
            rounds are all-reduces of the whole tensor).
    """
    check_int("block_size", block_size, minimum=1, fix="use e.g. 256 elements per int8 scale")
    if isinstance(compressor, str):
        compressor = registry.make_compressor(compressor)
    name = type(compressor).__name__
    if isinstance(compressor, MultiRoundCompressor):
        raise ValueError(
            f"Expected a one-round compressor for the compressed reduce-scatter, but got {name}: its rounds are "
            f"all-reduces of the whole tensor, and a reduce-scatter leaves each rank one piece of it. Fix: use "
            f"`compressor='int8'` (blockwise int8), 'terngrad', 'qsgd' or 'fp32' across nodes, or {name} between "
            f"replicas with `compress_across_nodes=False` (HSDP, a node per replica)."
        )
    if isinstance(compressor, SelectsElements) or not compressor.fixed_size:
        raise ValueError(
            f"Expected a compressor that encodes every element of a piece for the compressed reduce-scatter, but got "
            f"{name} (aggregation `{compressor.aggregation.value}`, sparse: its packets select elements, made to be "
            f"gathered to every rank, where the owner of a piece would decode each peer's selection alone). Fix: use "
            f"`compressor='int8'` (blockwise int8), 'terngrad', 'qsgd' or 'fp32' across nodes, or {name} between "
            f"replicas with `compress_across_nodes=False` (HSDP, a node per replica)."
        )
    if type(compressor) is Int8:  # a subclass may travel otherwise
        return BlockInt8(block_size, error_feedback)
    return compressor


def _as_bytes(payload: Tensor) -> Tensor:
    return payload.contiguous().reshape(-1).view(torch.uint8)


class PieceSteps:
    """The stage between nodes for every unit: the group step's state over the peers (one residual per unit and
    piece, the shared statistics' max, the ledger) and each unit's groups, one per piece.

    Args:
        compressor: the compressor between nodes (set up here for the peer group: this rank's node of ``nodes``).
        layout: the nodes.
        rank: this rank's global rank.
        peer_group: the group of this rank's peers, in node order.
        device: where the gradients live.
    """

    def __init__(self, compressor: Compressor, layout: SiteLayout, rank: int,
                 peer_group: Optional[dist.ProcessGroup], device: torch.device) -> None:
        self.compressor = compressor
        self.layout = layout
        self.node = layout.site_of(rank)
        nodes = layout.num_sites
        compressor.setup(self.node, nodes, device)
        self.state = GroupState(ProcessGroupTransport(peer_group, nodes))
        self.summed = compressor.aggregation is Aggregation.SUM  # set up for the peers above
        #: the identity compressor: FSDP2's own reduce-scatter runs (:meth:`HierarchicalReduceScatter._stock`)
        self.dense = type(compressor) is Identity
        self._groups: dict[tuple[str, int], list[LayerGroup]] = {}

    @property
    def ledger(self) -> Ledger:
        return self.state.ledger

    def groups(self, unit: str, piece: int) -> list[LayerGroup]:
        """Unit ``unit``'s groups for pieces of ``piece`` elements, one per node (``"<unit>/node<m>"``: the piece
        that node ``m``'s peer owns), made once."""
        key = (unit, piece)
        groups = self._groups.get(key)
        if groups is None:
            groups = self._groups[key] = [
                LayerGroup(self.compressor, Segments([f"{unit}/node{m}"], [torch.Size([piece])]), (m,), 0, (m * piece,))
                for m in range(self.layout.num_sites)
            ]
        return groups

    def step(self, key: int, unit: str, pieces: Tensor, piece: int) -> tuple[list[LayerGroup], list[FlatPacket]]:
        """The group step of the ``[nodes * piece]`` pieces: their packets, each recorded in the ledger but this
        rank's own (compressed like the others, its error kept, never sent)."""
        groups = self.groups(unit, piece)
        packets = group_steps(self.state, groups, pieces, key)
        self.ledger.drop_group(groups[self.node].segments.names)
        return groups, packets

    def reduce_to_owners(self, key: int, unit: str, output: Tensor, pieces: Tensor) -> None:
        """Compress the ``[nodes * piece]`` pieces, send each to its owner, and write the sum of this rank's piece
        (decoded) into ``output``."""
        nodes, piece, own = self.layout.num_sites, output.numel(), self.node
        groups, packets = self.step(key, unit, pieces, piece)
        if self.compressor.uses_memory:
            # a non-finite piece travels as such (as stock FSDP2 passes it on); its error is dropped so that one bad
            # step does not poison the residual for good (the strategy's guard rolls a skipped step back anyway)
            for group in groups:
                residual = self.state.memory.residuals.get(group.segments.names[0])
                if residual is not None:
                    torch.nan_to_num_(residual, nan=0.0, posinf=0.0, neginf=0.0)
        if self.summed:
            payload = torch.cat([p.payload.reshape(-1) for p in packets])
            total = payload.new_empty(payload.numel() // nodes)
            self.state.transport.sum_to_owners(total, payload)
            self.ledger.count("sum_to_owners")
            decoded = self.compressor.decompress_flat(packets[own].with_payload(total))
        else:
            size = packets[own].payload.numel() * packets[own].payload.element_size()
            received = pieces.new_empty(nodes * size, dtype=torch.uint8)
            self.state.transport.scatter_to_owners(received, torch.cat([_as_bytes(p.payload) for p in packets]),
                                                   [size] * nodes)
            self.ledger.count("scatter_to_owners")
            dtype = packets[own].payload.dtype
            parts = []
            for peer in range(nodes):
                raw = received[peer * size : (peer + 1) * size]
                parts.append(self.compressor.decompress_flat(packets[own].with_payload(
                    raw if dtype == torch.uint8 else raw.clone().view(dtype))))
            decoded = parts[0].clone()
            for part in parts[1:]:  # in peer order: the owner alone sums its piece
                decoded.add_(part)
        output.copy_(decoded.reshape(-1).to(output.dtype))

    def state_dict(self) -> dict[str, Any]:
        """Every residual (this rank's pieces of every unit), the compressor's state and the bytes so far."""
        return {"nodes": list(self.layout.sizes), "memory": self.state.memory.state_dict(),
                "compressor": self.compressor.state_dict(), "bytes": self.ledger.run_state()}

    def load_state_dict(self, saved: dict[str, Any], device: torch.device) -> None:
        """Restore :meth:`state_dict`'s state.

        Raises:
            ValueError: it was written with other nodes (each residual is a node's sum of another piece).
        """
        nodes = list(self.layout.sizes)
        if saved["nodes"] != nodes:
            raise ValueError(
                f"Expected the checkpoint's reduce-scatter state to come from nodes {nodes} (`node_size="
                f"{nodes[0]}`) as this run, but got one written with nodes {saved['nodes']}: each residual is a "
                f"node's sum of the piece another node owns. Fix: resume with `node_size={saved['nodes'][0]}`, or "
                f"pass `resume_compression='reset'` to start the residuals afresh."
            )
        self.state.memory.load_state_dict(saved["memory"], device)
        self.compressor.load_state_dict(saved["compressor"])
        self.ledger.load_run_state(saved["bytes"])


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
        name: the unit's name (its pieces' residuals and records are named after it).
        key: the unit's index (its shared statistics' record in the ledger).
        layout: the nodes (equal sizes).
        node_group: this rank's node's group.
        steps: the stage between nodes (shared by every unit).
        on_call: called first at every call (the ledger's step count: see :class:`CompressedReduceScatter`).
    """

    def __init__(self, name: str, key: int, layout: SiteLayout, node_group: Optional[dist.ProcessGroup],
                 steps: PieceSteps, on_call: Optional[Callable[[], None]] = None) -> None:
        self.name = name
        self.key = key
        self.layout = layout
        self.node_group = node_group
        self.steps = steps
        self.on_call = on_call

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
        if self.steps.dense:
            return self._stock(output_tensor, input_tensor, group, op, async_op)
        # [node, local, piece] -> [local, node, piece]: local rank l's row holds the pieces of its peers
        by_local = input_tensor.view(nodes, local, piece).transpose(0, 1).contiguous()
        mine = by_local[0].reshape(-1) if local == 1 else by_local.new_empty(nodes * piece)
        if local > 1:
            dist.reduce_scatter_single(mine, by_local.view(-1), op=dist.ReduceOp.SUM, group=self.node_group)
            self.steps.ledger.record_channel(LAN, tensor_bytes(by_local, (local - 1) * nodes * piece))
        if nodes == 1:
            output_tensor.copy_(mine)
        else:
            self.steps.reduce_to_owners(self.key, self.name, output_tensor, mine)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(nodes * local)
        return None


    def _stock(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op: object,
               async_op: bool) -> Optional[dist.Work]:
        """The identity between nodes: FSDP2's own reduce-scatter over every rank (its sums in its order, so stock
        FSDP2's bits at every step), the ledger recording what the two stages send dense on each link."""
        nodes, local, piece = self.layout.num_sites, self.layout.sizes[0], output_tensor.numel()
        # the identity's packets are their input: only their sizes reach the ledger, so any piece-sized view serves
        self.steps.step(self.key, self.name, input_tensor[: nodes * piece], piece)
        if local > 1:
            self.steps.ledger.record_channel(LAN, tensor_bytes(input_tensor, (local - 1) * nodes * piece))
        return dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op, async_op=async_op)


class CompressedReduceScatter:
    """Installs :class:`HierarchicalReduceScatter` on every FSDP2 unit of a model sharded over all ranks.

    Every rank must call this, in the same order (it makes the node and peer groups).

    Args:
        model: the model, already sharded by ``fully_shard`` over a 1-D mesh of every rank.
        node_size: ranks per node (consecutive ranks).
        compressor: between nodes: a compressor or a registered name whose packets have a fixed size and are made in
            one round (:func:`check_compressor`): ``"int8"`` (blockwise int8), ``"terngrad"``, ``"qsgd"``, ``"fp32"``
            (dense), ``"bf16"``, ``"onebit"``, ...
        block_size: elements per int8 block (each block sends one fp32 scale).
        error_feedback: with ``"int8"``, keep each rank's quantization error and add it back at the next step (the
            other compressors keep theirs as they do under DDP).
        timeout: the groups' collective timeout.

    Attributes:
        steps: the stage between nodes (:class:`PieceSteps`): its residuals, ledger and compressor.
        ledger: where the bytes go (``steps.ledger``).

    Raises:
        ValueError: bad input (a compressor that cannot serve a reduce-scatter, a node size that does not divide the
            world, a model not sharded over every rank), before any collective.
    """

    def __init__(self, model: nn.Module, node_size: int, compressor: Union[Compressor, str] = "int8",
                 block_size: int = 256, error_feedback: bool = True, timeout: Optional[timedelta] = None) -> None:
        self.compressor = check_compressor(compressor, block_size, error_feedback)
        world, rank = dist.get_world_size(), dist.get_rank()
        self.layout = node_layout(world, node_size)
        self.units = cross_node_units(model, world, "reduce-scatter")
        self._calls = 0
        #: this rank's node group and peer group (:func:`node_groups`), for a quantized all-gather to share
        self.groups = node_groups(self.layout, rank, timeout)
        node_group, peer_group = self.groups
        device = next(p.device for p in model.parameters())
        self.device = device
        self.steps = PieceSteps(self.compressor, self.layout, rank, peer_group, device)
        names = {id(m): n or "<root>" for n, m in model.named_modules()}
        self.comms = []
        for key, unit in enumerate(self.units):
            comm = HierarchicalReduceScatter(names[id(unit)], key, self.layout, node_group, self.steps,
                                             self._unit_called)
            unit.set_custom_reduce_scatter(comm)  # type: ignore[operator]
            self.comms.append(comm)

    @property
    def ledger(self) -> Ledger:
        return self.steps.ledger

    def _unit_called(self) -> None:
        # every backward reduce-scatters every unit once: the first of a backward opens a step in the ledger (the
        # previous step's bytes, complete by then, join the run's total)
        first = self._calls == 0
        self._calls = (self._calls + 1) % len(self.comms)
        self.ledger.bucket_called(self._calls == 0, first=first)
        if first:  # a step a non-finite gradient skips on every rank is rolled back (:meth:`rollback`)
            self.steps.state.memory.begin_step()

    def rollback(self) -> None:
        """The latest step was skipped (a non-finite gradient): every residual as before that step."""
        self.steps.state.memory.rollback()

    def residuals(self) -> dict[str, Tensor]:
        """This rank's residuals by unit and piece (``"<unit>/node<m>"``), empty without error feedback."""
        return dict(self.steps.state.memory.residuals)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state between nodes, for a checkpoint (:meth:`PieceSteps.state_dict`)."""
        return self.steps.state_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the same model, node size and compressor)."""
        self.steps.load_state_dict(saved, self.device)

    def bytes_per_step(self) -> int:
        """Bytes this rank sent to the other nodes per step, averaged over the steps so far (the ledger's
        :meth:`~lightning_gradcomp.exchange.ledger.Ledger.bytes_per_step`)."""
        return self.ledger.bytes_per_step()

    def last_step_bytes(self) -> int:
        """Bytes this rank sent to the other nodes in the latest step."""
        return self.ledger.last_step_bytes()
