"""What a converted MLX directory holds: its precision, its weights
dequantized back to float32 (for implementation parity) and a fingerprint.

Read straight from the safetensors on disk and the ``quantization`` block of
config.json, independently of the runtime's loader, so that a loader bug
cannot hide itself from the implementation-parity check. Only one fact comes
from the loaded model: whether the runtime upcast its half-precision
parameters, quantization scales and biases included, to float32
(``LoadedModel.upcast``, the CPU backend's float32 compute). Dequantizing with
bfloat16 scales rounds every weight to bfloat16; with the float32 scales the
runtime really holds, it does not, so the same-weights reference must be told
which of the two the MLX model multiplies by.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dlm.runtime.models.quant_modes import module_quantization
from dlm.runtime.checkpoint import read_json, weight_files
from dlm.runtime.platform.errors import ConfigError, WeightError

from .dequant import maybe_dequantize


@dataclass(frozen=True)
class Precision:
    """How a converted model stores and computes."""

    label: str  # "float32" | "bfloat16" | "float16" | "q8" | "q4" | "mixed-q4" ...
    compute_dtype: str  # dtype of its unquantized floating tensors
    bits: int | None  # lowest bit width of a quantized module, None if unquantized
    mode: str | None  # quantization mode ("affine", "mxfp4", ...)

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def to_dict(self) -> dict:
        return dict(label=self.label, compute_dtype=self.compute_dtype, bits=self.bits, mode=self.mode)


def _quant_params(config: dict, module: str, has_biases: bool = False) -> dict | None:
    q = config.get("quantization") or config.get("quantization_config")
    if not q:
        return None
    try:
        return module_quantization(q, module, has_biases)
    except ValueError as exc:
        raise ConfigError(f"config.json quantization of {module}: {exc}") from None


def precision(model_dir: Path, config: dict | None = None,
              select: Callable[[str], bool] | None = None) -> Precision:
    """The precision of a converted directory, or of the tensors ``select``
    picks by name (the vision encoder's, for the image-feature rows)."""
    model_dir = Path(model_dir)
    config = config if config is not None else read_json(model_dir / "config.json", "config.json")
    import mlx.core as mx

    dtypes: dict[str, int] = {}
    bits: set[int] = set()
    modes: set[str] = set()
    for f in weight_files(model_dir):
        arrays = mx.load(str(f))
        for name, arr in arrays.items():
            if select is not None and not select(name):
                continue
            base = name.rsplit(".", 1)[0]
            if name.endswith(".scales"):
                params = _quant_params(config, base, base + ".biases" in arrays) or {}
                bits.add(int(params.get("bits", 4)))
                modes.add(str(params.get("mode", "affine")))
            elif base + ".scales" in arrays:
                continue  # packed weight or biases of a quantized module
            elif mx.issubdtype(arr.dtype, mx.floating):
                key = str(arr.dtype).replace("mlx.core.", "")
                dtypes[key] = dtypes.get(key, 0) + int(arr.size)
    compute = max(dtypes, key=dtypes.get) if dtypes else "float32"
    if not bits:
        return Precision(compute, compute, None, None)
    low = min(bits)
    label = f"q{low}" if len(bits) == 1 else f"mixed-q{low}"
    mode = ",".join(sorted(modes))
    if mode != "affine":
        label += f"-{mode}"
    return Precision(label, compute, low, mode)


_HALF = ("bfloat16", "float16")


def _upcast_half(arr):
    """``arr`` in float32 when it is half precision, as the runtime's
    ``compute_in_float32`` casts every half parameter (exactly)."""
    import mlx.core as mx

    if arr is not None and arr.dtype in (mx.bfloat16, mx.float16):
        return arr.astype(mx.float32)
    return arr


class DequantizedWeights(Mapping):
    """``{mlx_name: float32 numpy}`` of a converted directory, dequantized one
    tensor at a time on access (a 26B model never sits in memory twice).

    ``upcast``: dequantize with the scales and biases cast to float32, as the
    runtime holds them once it upcasts the model (``LoadedModel.upcast``);
    else in their stored dtype (what the runtime computes with when it keeps
    the stored precision: the quantized kernels, or the dequantize at load).
    Either way the result is exactly the weights the MLX model multiplies by.

    Every read maps the shard afresh and drops it after, so nothing read stays
    resident: a layer-streamed reference reads each layer again on every
    forward pass in bounded memory. 2/4/8-bit affine tensors with float32
    scales dequantize on torch's threads (``dlm.verify.dequant``, bit-identical
    to ``mx.dequantize``, ~5x faster on 2 cores); the rest through MLX."""

    def __init__(self, model_dir: Path, config: dict, upcast: bool = False):
        self.model_dir, self.config = Path(model_dir), config
        self.upcast = bool(upcast)
        import mlx.core as mx

        # mx.load maps lazily: only names, shapes and dtypes are read here.
        self._file: dict[str, Path] = {}
        meta: dict[str, tuple] = {}
        for f in weight_files(self.model_dir):
            try:
                arrays = mx.load(str(f))
            except Exception as exc:  # mlx raises plain RuntimeError/ValueError on bad files
                raise WeightError(f"{f}: cannot read safetensors ({exc})") from None
            for name, arr in arrays.items():
                self._file[name] = f
                meta[name] = (tuple(arr.shape), arr.dtype)
        self._names = sorted(
            n for n in meta
            if not (n.endswith((".scales", ".biases")) and n.rsplit(".", 1)[0] + ".scales" in meta)
        )
        self._set = set(self._names)
        self._meta = meta

    @property
    def scales_dtype(self) -> str | None:
        """The dtype the quantization scales are applied in ("float32",
        "bfloat16", ...; several joined by ","), None when nothing is quantized."""
        dtypes = set()
        for name, (_, dtype) in self._meta.items():
            if name.endswith(".scales") and name.rsplit(".", 1)[0] + ".weight" in self._meta:
                key = str(dtype).replace("mlx.core.", "")
                dtypes.add("float32" if self.upcast and key in _HALF else key)
        return ",".join(sorted(dtypes)) if dtypes else None

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __contains__(self, name) -> bool:
        return name in self._set

    def _module(self, name: str) -> str | None:
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        return module if module is not None and module + ".scales" in self._meta else None

    def _params(self, module: str) -> dict:
        params = _quant_params(self.config, module, module + ".biases" in self._meta)
        if params is None:
            raise ConfigError(
                f"{self.model_dir / 'config.json'}: {module} is stored quantized but the "
                "quantization block says it is not"
            )
        return params

    def shape(self, name: str) -> tuple:
        """The dequantized shape of a tensor (nothing is read)."""
        if name not in self._set:
            raise KeyError(name)
        shape = self._meta[name][0]
        module = self._module(name)
        if module is None:
            return shape
        bits = int(self._params(module)["bits"])
        return shape[:-1] + (shape[-1] * 32 // bits,)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._set:
            raise KeyError(name)
        return self.take([name])[name]

    def take(self, names: list[str]) -> dict[str, np.ndarray]:
        """Several tensors at once (each shard mapped once, then dropped)."""
        import mlx.core as mx

        by_file: dict[Path, list[str]] = {}
        for name in names:
            if name not in self._set:
                raise KeyError(name)
            by_file.setdefault(self._file[name], []).append(name)
        out = {}
        for f, group in by_file.items():
            raw = mx.load(str(f))
            for name in group:
                arr = raw[name]
                module = self._module(name)
                if module is not None:
                    params = self._params(module)
                    scales = self._lookup(raw, module + ".scales")
                    biases = self._lookup(raw, module + ".biases")
                    if self.upcast:
                        scales, biases = _upcast_half(scales), _upcast_half(biases)
                    fast = maybe_dequantize(arr, scales, biases, params) if self._shape_ok(name, params) else None
                    if fast is not None:
                        out[name] = fast
                        continue
                    try:
                        arr = mx.dequantize(
                            arr, scales, biases,
                            group_size=params["group_size"], bits=params["bits"], mode=params["mode"],
                        )
                    except Exception as exc:
                        raise WeightError(f"{name}: cannot dequantize with {params} ({exc})") from None
                if mx.issubdtype(arr.dtype, mx.floating):
                    arr = arr.astype(mx.float32)
                mx.eval(arr)
                out[name] = np.array(arr)
            del raw
        return out

    def _shape_ok(self, name: str, params: dict) -> bool:
        """Packed, scale and bias shapes agree (else mx.dequantize names the problem)."""
        module = name[: -len(".weight")]
        packed = self._meta[name][0]
        scales = self._meta[module + ".scales"][0]
        biases = self._meta.get(module + ".biases", (None,))[0]
        cols = self.shape(name)[-1]
        group = int(params["group_size"])
        return (biases == scales and cols % group == 0
                and tuple(scales) == tuple(packed[:-1]) + (cols // group,))

    def _lookup(self, raw: dict, name: str):
        """A companion tensor (scales / biases), possibly in another shard."""
        if name not in self._meta:
            return None
        if name in raw:
            return raw[name]
        import mlx.core as mx

        return mx.load(str(self._file[name]))[name]


def dequantized_weights(model_dir: Path, config: dict | None = None, upcast: bool = False) -> DequantizedWeights:
    """Every converted tensor under its MLX name, quantized ones dequantized,
    as float32 numpy (what the weights *mean*, whatever their storage).
    ``upcast``: the loaded MLX model's ``LoadedModel.upcast`` (its half scales
    and biases are float32: dequantize with them so)."""
    model_dir = Path(model_dir)
    config = config if config is not None else read_json(model_dir / "config.json", "config.json")
    return DequantizedWeights(model_dir, config, upcast)


def fingerprint(model_dir: Path) -> str:
    """sha256 over config.json's quantization block and the weight files' bytes."""
    h = hashlib.sha256()
    for f in weight_files(model_dir):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()[:32]
