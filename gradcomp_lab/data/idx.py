"""Reader and writer for the IDX format of MNIST and Fashion-MNIST (plain or gzipped).

Layout (LeCun's spec): two zero bytes, a type byte, a byte with the number of dimensions, one big-endian
uint32 per dimension, then the data in big-endian C order.
"""

import gzip
import struct
from pathlib import Path
from typing import IO, Any

import numpy as np

from gradcomp_lab.data.files import PathLike

# annotated: dtype[uint8] and the string-built dtype[Any] would otherwise join to dict[int, object]
_CODE_TO_DTYPE: dict[int, np.dtype[Any]] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_KIND_TO_CODE = {("u", 1): 0x08, ("i", 1): 0x09, ("i", 2): 0x0B, ("i", 4): 0x0C, ("f", 4): 0x0D, ("f", 8): 0x0E}


def _open(path: Path, mode: str) -> IO[bytes]:
    # the gzip magic decides on reading, so a decompressed file that kept its ``.gz`` name still loads
    if "r" in mode:
        with open(path, "rb") as probe:
            gzipped = probe.read(2) == b"\x1f\x8b"
    else:
        gzipped = path.suffix == ".gz"
    return gzip.open(path, mode) if gzipped else open(path, mode)  # type: ignore[return-value]


def read_idx(path: PathLike) -> np.ndarray:
    """Read an IDX file into a native-endian numpy array.

    Raises:
        ValueError: the file is not IDX (bad magic, unknown type code, or a size that disagrees with the header).
    """
    path = Path(path)
    with _open(path, "rb") as handle:
        raw = handle.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _CODE_TO_DTYPE:
        raise ValueError(f"Expected an IDX file at {str(path)!r}, but its header is {raw[:4]!r}.")
    dtype, ndim = _CODE_TO_DTYPE[raw[2]], raw[3]
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    offset = 4 + 4 * ndim
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - offset != expected:
        raise ValueError(
            f"Expected {expected} data bytes in {str(path)!r} for shape {shape}, but found {len(raw) - offset}."
        )
    data = np.frombuffer(raw, dtype=dtype, offset=offset).reshape(shape)
    return data.astype(dtype.newbyteorder("="), copy=True)


def write_idx(path: PathLike, array: np.ndarray) -> None:
    """Write ``array`` as IDX, gzipped when ``path`` ends in ``.gz``.

    Raises:
        ValueError: the dtype has no IDX type code (IDX knows uint8, int8, int16, int32, float32, float64).
    """
    array = np.asarray(array)
    code = _KIND_TO_CODE.get((array.dtype.kind, array.dtype.itemsize))
    if code is None or array.ndim > 255:
        raise ValueError(
            f"Expected `array` to have an IDX dtype (uint8, int8, int16, int32, float32, float64) and at most "
            f"255 dimensions, but got {array.dtype} with {array.ndim}."
        )
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    body = np.ascontiguousarray(array, dtype=_CODE_TO_DTYPE[code]).tobytes()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _open(path, "wb") as handle:
        handle.write(header + body)
