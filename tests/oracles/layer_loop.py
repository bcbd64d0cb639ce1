"""What every per-layer oracle shares: the library's loop over per-layer methods, ahead of a subclass's group code.

An oracle subclasses the library's compressor (for its settings and state) and puts :class:`LayerLoop` first, so
the library's group code is bypassed and a group is compressed, decoded and fed back one layer at a time.
"""

from lightning_gradcomp.compressors.per_tensor import LayerLoop

__all__ = ["LayerLoop"]
