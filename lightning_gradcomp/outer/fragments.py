"""Fragments (Streaming DiLoCo): which layers sync together, and at which inner steps.

Streaming DiLoCo (Douillard et al., arXiv 2501.18512) splits the model into ``P`` fragments and syncs each
every ``H`` inner steps, the fragments staggered by ``H / P`` steps, so the outer traffic is spread over the
window instead of arriving as one burst. Its best layout is *strided*: fragment ``p`` holds layers ``p, p + P,
p + 2P, ...`` (each fragment spans the depth of the network). A *layer* here is a module that owns parameters:
its parameter tensors (weight, bias) always travel together.
"""

from collections.abc import Sequence

from lightning_gradcomp.validation import check_int


def layers_of(names: Sequence[str]) -> list[list[str]]:
    """Parameter names grouped by their owning module, in the model's order (``a.w, a.b, c.w`` -> 2 layers)."""
    layers: list[list[str]] = []
    owners: dict[str, int] = {}
    for name in names:
        owner = name.rpartition(".")[0]
        if owner not in owners:
            owners[owner] = len(layers)
            layers.append([])
        layers[owners[owner]].append(name)
    return layers


def strided_fragments(names: Sequence[str], fragments: int) -> list[list[str]]:
    """Split parameters into ``fragments`` strided groups of layers (layer ``j`` goes to fragment ``j % P``).

    Raises:
        ValueError: more fragments than layers (a fragment would hold nothing).
    """
    layers = layers_of(names)
    check_int("fragments", fragments, minimum=1, fix="use 1 for DiLoCo, or a few (e.g. 4) for Streaming DiLoCo")
    if fragments > len(layers):
        raise ValueError(
            f"Expected `fragments` to be at most the model's {len(layers)} layers (modules with trainable "
            f"parameters), but got {fragments}. Fix: use `fragments` <= {len(layers)}."
        )
    out: list[list[str]] = [[] for _ in range(fragments)]
    for j, layer in enumerate(layers):
        out[j % fragments].extend(layer)
    return out


def sync_offset(fragment: int, fragments: int, sync_every: int) -> int:
    """The inner step (1-based, in ``1 .. H``) of the first sync of ``fragment``: ``(p + 1) * H // P``.

    With one fragment that is ``H``: DiLoCo's rounds at ``H, 2H, ...``.
    """
    return (fragment + 1) * sync_every // fragments


def due(step: int, offset: int, sync_every: int) -> bool:
    """Whether a fragment first synced at ``offset`` syncs again at inner step ``step`` (1-based)."""
    return step >= offset and (step - offset) % sync_every == 0
