"""Logits on disk, read back one case at a time.

A DiffusionGemma logits case at the released size is [256, 262144] float32,
268 MB; a parity run keeps three sets of them (original reference, MLX, the
same-weights reference) over some twenty cases with images, ~18 GB. The
suite therefore keeps them in ``ArrayStore`` (one ``.npy`` per case in a
temporary directory, read with ``np.load``, no mapping) and the checks compare
them case by case: two cases in memory at a time. Bundles write their arrays
one at a time (``write_safetensors``) and read them back by name
(``SafetensorsArrays``, plain reads at the header's offsets), so neither side
ever holds all the logits.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path

import numpy as np

from dlm.runtime.platform.errors import ConfigError

_TO_ST = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.float16): "F16",
          np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
          np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}
_FROM_ST = {v: k for k, v in _TO_ST.items()}


class ArrayStore(MutableMapping):
    """``{name: np.ndarray}`` kept on disk (a temporary directory removed with
    the store); each read returns a fresh array."""

    def __init__(self, prefix: str = "dlm-verify-"):
        self._dir = Path(tempfile.mkdtemp(prefix=prefix))
        self._files: dict[str, Path] = {}
        self._meta: dict[str, tuple] = {}
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self._dir), True)

    def __setitem__(self, name: str, value) -> None:
        arr = np.ascontiguousarray(value)
        path = self._dir / f"{len(self._files) if name not in self._files else self._files[name].stem}.npy"
        np.save(path, arr, allow_pickle=False)
        self._files[name] = path
        self._meta[name] = (tuple(arr.shape), arr.dtype)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._files:
            raise KeyError(name)
        return np.load(self._files[name], allow_pickle=False)

    def __delitem__(self, name: str) -> None:
        self._files.pop(name).unlink(missing_ok=True)
        del self._meta[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, name) -> bool:
        return name in self._files

    def meta(self, name: str) -> tuple:
        """(shape, dtype) without reading."""
        return self._meta[name]

    def close(self) -> None:
        self._finalizer()


class View(Mapping):
    """``{name: source[key]}`` read on access (a subset or a renaming of a lazy mapping)."""

    def __init__(self, source: Mapping, keys: dict[str, str]):
        self.source, self.keys_ = source, keys

    def __getitem__(self, name: str):
        return self.source[self.keys_[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys_)

    def __len__(self) -> int:
        return len(self.keys_)

    def __contains__(self, name) -> bool:
        return name in self.keys_

    def meta(self, name: str) -> tuple:
        return _meta(self.source, self.keys_[name])


def subset(d: Mapping, names) -> Mapping:
    """The entries of ``d`` named in ``names`` (those it has), read on access."""
    return View(d, {n: n for n in names if n in d})


def _meta(d: Mapping, name: str) -> tuple:
    if hasattr(d, "meta"):
        return d.meta(name)
    arr = np.asarray(d[name])
    return tuple(arr.shape), arr.dtype


def write_safetensors(path: Path, arrays: Mapping, metadata: dict | None = None) -> None:
    """The safetensors format, written one array at a time (each read from
    ``arrays`` when its turn comes)."""
    names = sorted(arrays)
    header: dict = {"__metadata__": dict(metadata or {})} if metadata else {}
    offset = 0
    metas = {}
    for name in names:
        shape, dtype = _meta(arrays, name)
        dtype = np.dtype(dtype)
        if dtype not in _TO_ST:
            raise ConfigError(f"bundle array {name}: dtype {dtype} cannot be stored")
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": _TO_ST[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        metas[name] = (shape, dtype, size)
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as fh:
        fh.write(len(blob).to_bytes(8, "little"))
        fh.write(blob)
        for name in names:
            shape, dtype, size = metas[name]
            arr = np.ascontiguousarray(arrays[name], dtype=dtype)
            if tuple(arr.shape) != tuple(shape) or arr.nbytes != size:
                raise ConfigError(f"bundle array {name} changed shape while being written")
            fh.write(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())


class SafetensorsArrays(Mapping):
    """A safetensors file's arrays by name, each read from disk on access."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if n <= 0 or n > 1 << 31:
                    raise ValueError("bad header length")
                header = json.loads(fh.read(n))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{self.path}: cannot read ({exc})") from None
        header.pop("__metadata__", None)
        self._start = 8 + n
        self._header = header
        for name, info in header.items():
            if info.get("dtype") not in _FROM_ST:
                raise ConfigError(f"{self.path}: array {name} has unsupported dtype {info.get('dtype')}")

    def __getitem__(self, name: str) -> np.ndarray:
        info = self._header[name]
        dtype = _FROM_ST[info["dtype"]].newbyteorder("<")
        lo, hi = info["data_offsets"]
        count = (hi - lo) // dtype.itemsize
        with open(self.path, "rb") as fh:
            arr = np.fromfile(fh, dtype=dtype, count=count, offset=self._start + lo)
        if arr.size != count:
            raise ConfigError(f"{self.path}: array {name} is truncated")
        return arr.astype(dtype.newbyteorder("="), copy=False).reshape(info["shape"])

    def __iter__(self) -> Iterator[str]:
        return iter(self._header)

    def __len__(self) -> int:
        return len(self._header)

    def __contains__(self, name) -> bool:
        return name in self._header

    def meta(self, name: str) -> tuple:
        info = self._header[name]
        return tuple(info["shape"]), _FROM_ST[info["dtype"]]
