"""A small reader for W&B offline run files (``run-<id>.wandb``); wandb 0.31 ships none.

The file is a LevelDB-log-style record log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then
32 KiB blocks of chunks. Each chunk has a 7-byte header: checksum (uint32, zlib CRC-32 of the type byte and
the data), length (uint16) and type (1 FULL, 2 FIRST, 3 MIDDLE, 4 LAST); a block tail shorter than a header
is zero padding. Reassembled records are ``wandb_internal_pb2.Record`` protobufs.
"""

import json
import struct
import zlib
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2 as pb

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[pb.Record]:
    """Every record of a run file, in order; raises ``ValueError`` on a bad header or checksum."""
    data = Path(path).read_bytes()
    if data[:4] != b":W&B" or struct.unpack("<HB", data[4:7]) != (0xBEE1, 0):
        raise ValueError(f"{path} is not a W&B run file: header {data[:7]!r}")
    records: list[pb.Record] = []
    pending = b""
    pos = _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:
            pos += left
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0 and length == 0:  # zero padding up to the end of the block
            pos += left
            continue
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != checksum:
            raise ValueError(f"{path}: checksum mismatch at byte {pos}")
        pos += _HEADER + length
        if kind == _FULL:
            payload = chunk
        elif kind == _FIRST:
            pending = chunk
            continue
        elif kind == _MIDDLE:
            pending += chunk
            continue
        elif kind == _LAST:
            payload, pending = pending + chunk, b""
        else:
            raise ValueError(f"{path}: unknown chunk type {kind} at byte {pos}")
        record = pb.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def _assign(target: dict[str, Any], item: Any) -> None:
    path = list(item.nested_key) or [item.key]
    node = target
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = json.loads(item.value_json)


def history(records: list[pb.Record]) -> list[dict[str, Any]]:
    """One dict per history row (one per ``run.log`` call); nested values (histograms) as dicts."""
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                _assign(row, item)
            rows.append(row)
    return rows


def summary(records: list[pb.Record]) -> dict[str, Any]:
    """The run summary after every summary update in the file."""
    out: dict[str, Any] = {}
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                _assign(out, item)
    return out


def config(records: list[pb.Record]) -> dict[str, Any]:
    """The run config: the run record's config and every later config update."""
    out: dict[str, Any] = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        items = record.run.config.update if kind == "run" else record.config.update if kind == "config" else ()
        for item in items:
            _assign(out, item)
    return out


def metric_definitions(records: list[pb.Record]) -> dict[str, pb.MetricRecord]:
    """``define_metric`` records by name or glob."""
    return {
        (r.metric.name or r.metric.glob_name): r.metric
        for r in records
        if r.WhichOneof("record_type") == "metric"
    }
