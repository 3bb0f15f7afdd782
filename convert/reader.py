"""Lazy, per-tensor reader for safetensors checkpoints (one file or an indexed set of shards).

Only headers are read up front: they give every tensor's shape and dtype and
let us name a missing or truncated shard before any output exists.  Tensor
data is read on demand with ``pread`` -- whole tensors, or ranges of rows so
that a 1 GB expert tensor never has to sit in memory at once.

Why not ``mx.load``: it is lazy too, but evaluating any slice of a tensor
reads the whole tensor, so the peak grows with the largest tensor (measured:
a 253 MB bf16 tensor sliced to 1/8 still cost 260 MB RSS; chunked pread 160 MB
for the same file, flat in tensor size).  ``safe_open(framework="mlx")`` goes
through numpy and cannot return bfloat16.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..runtime.checkpoint import INDEX_NAME, read_weight_map, weight_files
from ..runtime.platform.errors import WeightError

# safetensors dtype -> (numpy dtype used for the raw bytes, mlx dtype)
_DTYPES: dict[str, tuple[np.dtype, mx.Dtype]] = {
    "F32": (np.dtype("<f4"), mx.float32),
    "F16": (np.dtype("<f2"), mx.float16),
    "BF16": (np.dtype("<u2"), mx.bfloat16),  # numpy has no bfloat16: read bits, view in MLX
    "I64": (np.dtype("<i8"), mx.int64),
    "I32": (np.dtype("<i4"), mx.int32),
    "I16": (np.dtype("<i2"), mx.int16),
    "I8": (np.dtype("i1"), mx.int8),
    "U64": (np.dtype("<u8"), mx.uint64),
    "U32": (np.dtype("<u4"), mx.uint32),
    "U16": (np.dtype("<u2"), mx.uint16),
    "U8": (np.dtype("u1"), mx.uint8),
    "BOOL": (np.dtype("?"), mx.bool_),
}
_MAX_HEADER = 100 << 20  # the safetensors spec limit


def row_count(shape: tuple[int, ...]) -> int:
    """Rows of a tensor seen as [prod(shape[:-1]), shape[-1]] (1-D and scalars: one row)."""
    return math.prod(shape[:-1]) if len(shape) > 1 else 1


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string (F32, BF16, ...)
    file: Path
    start: int  # absolute byte offset of the data in ``file``
    nbytes: int

    @property
    def rows(self) -> int:
        return row_count(self.shape)

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.rows if self.rows else 0


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header and check that the file holds all its data."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightError(f"{path.name} is truncated or not a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise WeightError(
                    f"{path.name} is truncated or not a safetensors file "
                    f"(header claims {n} bytes, file has {size})"
                )
            raw = f.read(n)
    except OSError as exc:
        raise WeightError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightError(f"{path.name} has a corrupt safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise WeightError(f"{path.name} has a corrupt safetensors header")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = entry["dtype"], tuple(int(d) for d in entry["shape"])
            begin, stop = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightError(f"{path.name}: malformed header entry for tensor {name}") from exc
        if dtype not in _DTYPES:
            raise WeightError(
                f"{path.name}: tensor {name} has dtype {dtype}, which dlm cannot convert "
                f"(supported: {', '.join(_DTYPES)})"
            )
        want = math.prod(shape) * _DTYPES[dtype][0].itemsize
        if stop - begin != want:
            raise WeightError(
                f"{path.name}: tensor {name} has {stop - begin} bytes for shape {list(shape)} {dtype}"
            )
        if begin < 0 or stop < begin:
            raise WeightError(f"{path.name}: tensor {name} has invalid data_offsets [{begin}, {stop}]")
        out[name] = TensorInfo(name, shape, dtype, path, base + begin, want)
        end = max(end, stop)
    # The format (and its official parser) forbids tensors sharing bytes.
    spans = sorted((t.start, t.start + t.nbytes, t.name) for t in out.values() if t.nbytes)
    for (a0, a1, a), (b0, b1, b) in zip(spans, spans[1:]):
        if b0 < a1:
            raise WeightError(f"{path.name}: tensors {a} and {b} overlap in the file "
                              f"(bytes {b0 - base}..{min(a1, b1) - base}); the safetensors header is corrupt")
    if base + end > size:
        raise WeightError(
            f"shard {path.name} is truncated: its header describes {base + end} bytes "
            f"but the file has {size} (re-download it)"
        )
    return out


class CheckpointReader:
    """All tensors of a checkpoint directory, read lazily.

    With ``model.safetensors.index.json`` the shards are the files its
    weight_map names (each must exist and hold the tensors mapped to it);
    without one, every ``*.safetensors`` file in the directory.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.tensors: dict[str, TensorInfo] = {}
        self._fds: dict[Path, int] = {}
        self.shards = self._find_shards()
        for shard in self.shards:
            for name, info in read_header(shard).items():
                if name in self.tensors:
                    raise WeightError(
                        f"tensor {name} appears in both {self.tensors[name].file.name} and {shard.name}"
                    )
                self.tensors[name] = info
        self._check_index()

    def _find_shards(self) -> list[Path]:
        self.weight_map = read_weight_map(self.directory)
        return weight_files(self.directory)

    def _check_index(self) -> None:
        if self.weight_map is None:
            return
        for name, file in self.weight_map.items():
            info = self.tensors.get(name)
            if info is None or info.file.name != file:
                raise WeightError(
                    f"{INDEX_NAME} maps tensor {name} to {file}, but {file} does not contain it "
                    "(incomplete or mismatched shard)"
                )

    # -- metadata ---------------------------------------------------------

    def metadata(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """{name: (shape, dtype)} for a family's ``plan_weights``."""
        return {n: (t.shape, t.dtype) for n, t in self.tensors.items()}

    def mx_dtype(self, name: str) -> mx.Dtype:
        return _DTYPES[self.tensors[name].dtype][1]

    # -- data -------------------------------------------------------------

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def read_rows(self, name: str, start: int, stop: int) -> mx.array:
        """Rows [start, stop) of tensor ``name`` viewed as [rows, last_dim]; 1-D tensors: the tensor."""
        info = self.tensors[name]
        np_dtype, mx_dtype = _DTYPES[info.dtype]
        nbytes = (stop - start) * info.row_bytes
        buf = np.empty(nbytes, dtype=np.uint8)
        offset = info.start + start * info.row_bytes
        view = memoryview(buf)
        done = 0
        fd = self._fd(info.file)
        while done < nbytes:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise WeightError(f"{info.file.name} ended while reading tensor {name} (truncated?)")
            done += got
        arr = mx.array(buf.view(np_dtype))
        if mx_dtype != arr.dtype:
            arr = arr.view(mx_dtype)
        shape = (stop - start, info.shape[-1]) if len(info.shape) > 1 else info.shape
        return arr.reshape(shape)

    def read(self, name: str) -> mx.array:
        """The whole tensor, in its checkpoint shape and dtype."""
        info = self.tensors[name]
        return self.read_rows(name, 0, info.rows).reshape(info.shape)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
