"""Streaming safetensors writer: shards of at most 5 GiB, planned before any data exists.

Every output tensor's shape and dtype is known before conversion starts (MLX
computes shapes lazily), so each shard's header -- with exact offsets -- is
written first and tensor data is then written in place, in row chunks, with
``pwrite``.  Peak memory is one chunk, whatever the shard or tensor size.
The files follow the layout mlx-lm / mlx-vlm write: ``model.safetensors`` or
``model-0000i-of-0000N.safetensors``, ``{"format": "mlx"}`` metadata, and a
``model.safetensors.index.json`` even for a single shard.
"""

from __future__ import annotations

import errno
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..runtime.platform.errors import DlmError
from .reader import INDEX_NAME, row_count

MAX_SHARD_BYTES = 5 << 30  # the mlx-lm / mlx-vlm limit

_ST_DTYPES = {
    mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16",
    mx.int64: "I64", mx.int32: "I32", mx.int16: "I16", mx.int8: "I8",
    mx.uint64: "U64", mx.uint32: "U32", mx.uint16: "U16", mx.uint8: "U8", mx.bool_: "BOOL",
}
# MLX dtypes numpy cannot hold, viewed as same-size integers to get their bytes.
_BYTES_VIEW = {mx.bfloat16: mx.uint16}


class OutputError(DlmError):
    """The output directory cannot be written (exists, unwritable, disk full)."""


def describe_os_error(exc: OSError, what: str) -> OutputError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutputError(f"disk full while writing {what}")
    return OutputError(f"cannot write {what}: {exc.strerror or exc}")


@dataclass
class OutTensor:
    name: str
    shape: tuple[int, ...]
    dtype: mx.Dtype
    shard: int = -1
    offset: int = 0  # within the shard's data section

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.size

    @property
    def rows(self) -> int:
        return row_count(self.shape)


@dataclass
class Shard:
    tensors: list[OutTensor] = field(default_factory=list)
    data_bytes: int = 0
    file: str = ""


def plan_shards(groups: list[list[OutTensor]], max_bytes: int = MAX_SHARD_BYTES) -> list[Shard]:
    """Fill shards greedily in order; a group (a module's weight/scales/biases) never splits.

    A group larger than ``max_bytes`` gets a shard of its own.
    """
    shards: list[Shard] = []
    for group in groups:
        size = sum(t.nbytes for t in group)
        if not shards or (shards[-1].tensors and shards[-1].data_bytes + size > max_bytes):
            shards.append(Shard())
        shard = shards[-1]
        for t in group:
            t.shard, t.offset = len(shards) - 1, shard.data_bytes
            shard.tensors.append(t)
            shard.data_bytes += t.nbytes
    n = len(shards)
    for i, shard in enumerate(shards):
        shard.file = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
    return shards


def _header(shard: Shard) -> bytes:
    header: dict = {"__metadata__": {"format": "mlx"}}
    for t in shard.tensors:
        header[t.name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [t.offset, t.offset + t.nbytes],
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned (padding allowed by the spec)
    return len(raw).to_bytes(8, "little") + raw


def shards_total_bytes(shards: list[Shard]) -> int:
    return sum(len(_header(s)) + s.data_bytes for s in shards)


class ShardWriter:
    """Writes planned shards into ``directory``; refuses to finish with a gap in any tensor."""

    def __init__(self, directory: Path, shards: list[Shard]):
        self.directory = Path(directory)
        self.shards = shards
        self.by_name = {t.name: t for s in shards for t in s.tensors}
        self._written = {name: 0 for name in self.by_name}
        self._fds: dict[int, int] = {}
        self._data_start: dict[int, int] = {}

    def _open(self, index: int) -> int:
        fd = self._fds.get(index)
        if fd is not None:
            return fd
        shard = self.shards[index]
        path = self.directory / shard.file
        head = _header(shard)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._fds[index] = fd
            try:
                # Reserve the space now: a full disk fails here, not half-way through.
                os.posix_fallocate(fd, 0, len(head) + shard.data_bytes)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
            self._pwrite(fd, memoryview(head), 0)
        except OSError as exc:
            raise describe_os_error(exc, str(path)) from exc
        self._data_start[index] = len(head)
        return fd

    @staticmethod
    def _pwrite(fd: int, data: memoryview, offset: int) -> None:
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset + done)

    def write_rows(self, name: str, row_start: int, array: mx.array) -> None:
        """Write ``array`` (rows [row_start, row_start + len) of tensor ``name``)."""
        t = self.by_name[name]
        if array.dtype != t.dtype:
            raise AssertionError(f"{name}: writing {array.dtype}, planned {t.dtype}")
        if array.dtype in _BYTES_VIEW:
            array = array.view(_BYTES_VIEW[array.dtype])
        data = np.ascontiguousarray(np.asarray(array))
        row_bytes = t.nbytes // t.rows if t.rows else 0
        offset = t.offset + row_start * row_bytes
        if offset + data.nbytes > t.offset + t.nbytes:
            raise AssertionError(f"{name}: write past the planned end of the tensor")
        fd = self._open(t.shard)
        try:
            self._pwrite(fd, memoryview(data).cast("B"), self._data_start[t.shard] + offset)
        except OSError as exc:
            raise describe_os_error(exc, str(self.directory / self.shards[t.shard].file)) from exc
        self._written[name] += data.nbytes

    def close_shard(self, index: int) -> None:
        shard = self.shards[index]
        for t in shard.tensors:
            if self._written[t.name] != t.nbytes:
                raise AssertionError(
                    f"{t.name}: wrote {self._written[t.name]} of {t.nbytes} bytes"
                )
        fd = self._open(index)  # a shard of empty tensors still gets its file
        try:
            os.fsync(fd)
        except OSError as exc:
            raise describe_os_error(exc, str(self.directory / shard.file)) from exc
        finally:
            os.close(fd)
            del self._fds[index]

    def abort(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def write_index(self, total_parameters: int) -> None:
        weight_map = {t.name: self.shards[t.shard].file for t in self.by_name.values()}
        index = {
            "metadata": {
                "total_size": sum(s.data_bytes for s in self.shards),
                "total_parameters": total_parameters,
            },
            "weight_map": dict(sorted(weight_map.items())),
        }
        write_text(self.directory / INDEX_NAME, json.dumps(index, indent=4) + "\n")


def write_text(path: Path, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as exc:
        raise describe_os_error(exc, str(path)) from exc
