"""Layer-streamed PyTorch references: peak memory flat in model depth.

The reference keeps its own module code (transformers' DiffusionGemma, dlm's
LLaDA-2 reference or a checkpoint's modeling code) and only its *weights*
stream. ``empty_parameters()`` builds the skeleton with every parameter on
the meta device (no memory; buffers stay real, so RoPE tables are what the
module computes). A ``LayerStreamer`` then

* loads the always-needed tensors once (embeddings, final norm, DiffusionGemma's
  self-conditioning, every buffer the weights hold): the *resident* set;
* gives each transformer layer a forward pre-hook that reads that layer's
  parameters from a weight source, one tensor at a time, cast to the reference
  dtype, and a forward hook that puts them back on the meta device.

Tied parameters are one object with several names (DiffusionGemma's encoder
layer ``N`` and decoder layer ``N`` share every weight; only the
``layer_scalar`` buffers differ): the streamer resolves each object to the one
name the weight source holds and materializes it under all of its names, so
one read serves both and nothing of the encoder's copy stays resident. At most
one layer is materialized at a time, whatever calls it (the reference's
forward or its own ``generate``), so peak memory is the resident tensors, one
layer, the activations and the KV cache. ``LayerStreamer.lockstep`` runs
independent passes (the logits cases, a commit stream's runs) in threads that
share each layer load (``dlm.verify.lockstep``).

Weight sources: ``CheckpointSource`` (a checkpoint's safetensors, read with
``safetensors.safe_open`` per layer and closed again, so the file pages do not
stay mapped) and ``MlxSource`` (a converted directory's tensors dequantized on
demand, under the reference's names through the family's ``to_hf``).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Optional

import numpy as np

from dlm.runtime.platform.errors import DlmError, WeightError

from . import memory as M
from .progress import LayerBar

# Stream when what a whole-model run holds at its peak (the reference in its
# dtype and, for the same-weights reference, the loaded MLX model and the
# dequantized weights: ``whole_parts``) would take more than this share of the
# memory budget (dlm.runtime.platform.memory.budget_bytes).
AUTO_FRACTION = 0.5

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_ST_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
              "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@contextlib.contextmanager
def empty_parameters():
    """Build modules whose parameters live on the meta device (buffers stay real).

    Parameters are moved to meta as they are registered, and weight
    initialisation is skipped (transformers' ``no_init_weights``), so no
    parameter memory is ever touched."""
    import torch
    from torch import nn

    real = nn.Module.register_parameter

    def register(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=False)
        real(self, name, param)

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - transformers is a verify dependency
        no_init_weights = contextlib.nullcontext
    nn.Module.register_parameter = register
    try:
        with no_init_weights(), torch.no_grad():
            yield
    finally:
        nn.Module.register_parameter = real


# ---------------------------------------------------------------------------
# Weight sources
# ---------------------------------------------------------------------------


class CheckpointSource:
    """The tensors of a checkpoint directory's ``*.safetensors`` files, read by name."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.where = str(self.path)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise WeightError(
                f"{self.path}: no *.safetensors files (dlm-verify loads reference weights only from safetensors)"
            )
        self._file: dict[str, Path] = {}
        self._shape: dict[str, tuple] = {}
        self._bytes = 0
        for f in files:
            for name, info in _header(f).items():
                self._file[name] = f
                self._shape[name] = tuple(info["shape"])
                self._bytes += int(np.prod(info["shape"], dtype=np.int64))

    def keys(self) -> Iterable[str]:
        return self._file.keys()

    def __contains__(self, name) -> bool:
        return name in self._file

    def shape(self, name: str) -> tuple:
        return self._shape[name]

    def numel(self) -> int:
        return self._bytes

    def read(self, names: list[str]) -> dict:
        """``{name: torch tensor}``; each file is opened once per call and closed after."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self._file[n], []).append(n)
        out = {}
        for f, group in by_file.items():
            try:
                with safe_open(str(f), framework="pt") as fh:
                    for n in group:
                        out[n] = fh.get_tensor(n)
            except Exception as exc:  # safetensors raises its own error types
                raise WeightError(f"{f}: cannot read tensor {group[0]} ({exc})") from None
        return out


def _header(path: Path) -> dict:
    """A safetensors file's header: {name: {dtype, shape, data_offsets}} (no data read)."""
    try:
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if n <= 0 or n > 1 << 30:
                raise ValueError("bad header length")
            doc = json.loads(fh.read(n))
    except (OSError, ValueError) as exc:
        raise WeightError(f"{path}: not a readable safetensors file ({exc})") from None
    doc.pop("__metadata__", None)
    return doc


class _Slot:
    """A stand-in for one converted tensor (or one row of it, ``index``) that
    the family's ``to_hf`` renames and splits like an array."""

    def __init__(self, name: str, shape: tuple, index: Optional[int] = None):
        self.name, self.shape, self.index = name, tuple(shape), index

    def __getitem__(self, i: int) -> "_Slot":
        if self.index is not None or not isinstance(i, int):
            raise TypeError("to_hf may only split a converted tensor along its first axis")
        return _Slot(self.name, self.shape[1:], i)


class _SlotView(Mapping):
    def __init__(self, weights):
        self.weights = weights

    def __len__(self):
        return len(self.weights)

    def __iter__(self):
        return iter(self.weights)

    def __getitem__(self, name):
        return _Slot(name, self.weights.shape(name))


class MlxSource:
    """A converted directory's weights, dequantized to float32 on demand, under
    the reference's names (``to_hf``: the family's renaming, given stand-ins so
    that nothing is read until a layer needs it)."""

    def __init__(self, weights, to_hf: Callable):
        self.weights = weights  # dlm.verify.weights.DequantizedWeights
        self.where = f"{getattr(weights, 'model_dir', 'the MLX model')} (MLX weights)"
        view = to_hf(_SlotView(weights))
        self._slots: dict[str, _Slot] = {k: view[k] for k in view}
        # A plain dict from to_hf, given real arrays, holds every dequantized
        # tensor at once (LLaDA-2 splits its stacked experts into one); a lazy
        # view (DiffusionGemma's Renamed) hands them over one at a time.
        self.eager = isinstance(view, dict)

    def keys(self) -> Iterable[str]:
        return self._slots.keys()

    def __contains__(self, name) -> bool:
        return name in self._slots

    def shape(self, name: str) -> tuple:
        return self._slots[name].shape

    def numel(self) -> int:
        return sum(int(np.prod(s.shape, dtype=np.int64)) for s in self._slots.values())

    def groups(self) -> list[list[str]]:
        """The reference's names, grouped by the converted tensor they come from
        (LLaDA-2's per-expert names of one stacked tensor together): read a
        group at once to dequantize each converted tensor once."""
        out: dict[str, list[str]] = {}
        for name, slot in self._slots.items():
            out.setdefault(slot.name, []).append(name)
        return list(out.values())

    def largest(self) -> int:
        """Elements of the largest converted tensor (the unit a lazy to_hf hands over)."""
        sizes = {s.name: int(np.prod(self.weights.shape(s.name), dtype=np.int64)) for s in self._slots.values()}
        return max(sizes.values(), default=0)

    def read(self, names: list[str]) -> dict:
        import torch

        needed = sorted({self._slots[n].name for n in names})
        arrays = self.weights.take(needed)
        out = {}
        for n in names:
            slot = self._slots[n]
            value = arrays[slot.name] if slot.index is None else arrays[slot.name][slot.index]
            out[n] = torch.from_numpy(np.ascontiguousarray(value))
        return out


def reference_bytes(source, dtype: str) -> int:
    """What the whole reference would hold in ``dtype``."""
    return source.numel() * _ITEMSIZE.get(dtype, 4)


def whole_parts(source, dtype: str, mlx_bytes: int = 0) -> dict[str, int]:
    """``{part: bytes}`` a whole-model (not layer-streamed) reference run holds
    at its peak: the reference in ``dtype`` and, for the same-weights
    reference (``source`` an ``MlxSource``), the MLX model loaded in this
    process (``mlx_bytes``: its parameters as the runtime holds them, float32
    where it upcast or dequantized at load) and the dequantized float32 weights
    the reference is loaded from: all of them at once when the family's
    ``to_hf`` builds a dict, else one tensor at a time (the largest, twice:
    the dequantized array and its copy into the reference)."""
    parts: dict[str, int] = {}
    if mlx_bytes:
        parts["the MLX model"] = int(mlx_bytes)
    if isinstance(source, MlxSource):
        if source.eager:
            parts["its dequantized float32 weights"] = source.numel() * 4
        else:
            parts["its largest dequantized float32 tensor, twice"] = 2 * source.largest() * 4
        parts[f"the reference with its weights in {dtype}"] = reference_bytes(source, dtype)
    else:
        parts[f"the reference in {dtype}"] = reference_bytes(source, dtype)
    return parts


def decide(option: Optional[bool], need: int | Mapping[str, int], held: int = 0) -> tuple[bool, str]:
    """(stream?, why): ``option`` True/False forces it; None streams when a
    whole-model run would take over AUTO_FRACTION of the memory budget.

    ``need``: bytes, or ``{part: bytes}`` of everything the run would hold at
    once (``whole_parts``; the why names each part). ``held``: bytes of it
    already allocated by MLX (the loaded MLX model), which ``budget_bytes``
    leaves out of the budget already: added back so it is not counted twice."""
    if option is not None:
        return bool(option), "--stream-layers" if option else "--no-stream-layers"
    from dlm.runtime.platform.memory import budget_bytes

    parts = dict(need) if isinstance(need, Mapping) else {"the reference": int(need)}
    total = sum(parts.values())
    budget = budget_bytes() + int(held)
    stream = total > AUTO_FRACTION * budget
    word = "over" if stream else "within"
    share = f"{word} {int(AUTO_FRACTION * 100)}% of the memory budget of {budget / 1e9:.2f} GB"
    if len(parts) == 1:
        (name, size), = parts.items()
        return stream, f"{name} takes {size / 1e9:.2f} GB, {share}"
    listed = " + ".join(f"{name} {size / 1e9:.2f} GB" for name, size in parts.items())
    return stream, f"a whole-model run holds {total / 1e9:.2f} GB ({listed}), {share}"


# ---------------------------------------------------------------------------
# The streamer
# ---------------------------------------------------------------------------


class LayerStreamer:
    """Stream the parameters of ``stacks`` (``{name: [layer modules]}``) of
    ``model`` from ``source``; every other parameter and every buffer the
    source holds is loaded now. ``optional(name)``: parameters the source may
    lack (left on meta; a layer needing one raises naming it). ``strict``:
    every source tensor must have a counterpart in the model."""

    def __init__(self, model, source, dtype, stacks: dict[str, list], *, optional=None,
                 strict: bool = False, progress: bool = False, label: str = "reference"):
        import torch

        self.model, self.source, self.dtype = model, source, dtype
        self.stacks = stacks
        self.label = label
        self.bar = LayerBar(progress)
        self.layer_loads = 0
        self.load_seconds = 0.0
        self.load_bytes = 0
        # Released layers' tensors, by (shape, dtype), reused by the next layer:
        # no fresh pages to fault in per layer (at most one layer's worth is kept).
        self._pool: dict[tuple, list] = {}
        optional = optional or (lambda name: False)
        where = getattr(source, "where", "the weights")
        # One entry per parameter object: (its source name, every (owner, attr) holding it).
        aliases: dict[int, list] = {}
        names: dict[int, list[str]] = {}
        for full, param in model.named_parameters(remove_duplicate=False):
            owner_name, _, attr = full.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            aliases.setdefault(id(param), []).append((owner, attr))
            names.setdefault(id(param), []).append(full)
        self._key: dict[int, Optional[str]] = {}
        self._meta: dict[int, object] = {}
        for pid, ns in names.items():
            key = next((n for n in ns if n in source), None)
            owner, attr = aliases[pid][0]
            param = owner._parameters[attr]
            if key is None and not any(optional(n) for n in ns):
                raise WeightError(f"{where}: no tensor {ns[0]} (the reference needs shape {list(param.shape)})")
            if key is not None and tuple(source.shape(key)) != tuple(param.shape):
                raise WeightError(f"{where}: tensor {key} has shape {list(source.shape(key))}; the reference "
                                  f"expects {list(param.shape)}")
            self._key[pid], self._meta[pid] = key, param
        self._aliases = aliases
        self._names = names
        if strict:
            known = {n for ns in names.values() for n in ns} | {n for n, _ in model.named_buffers(remove_duplicate=False)}
            extra = sorted(k for k in source.keys() if k not in known)
            if extra:
                raise WeightError(f"{where}: tensor {extra[0]} has no counterpart in the PyTorch reference")
        # Which parameter objects each layer owns; everything else is resident.
        self._layer_params: dict[int, list[int]] = {}
        streamed: set[int] = set()
        self._where: dict[int, tuple[str, int, int]] = {}
        for stack, layers in stacks.items():
            for i, layer in enumerate(layers):
                ids = list(dict.fromkeys(id(p) for _, p in layer.named_parameters(remove_duplicate=False)))
                self._layer_params[id(layer)] = ids
                self._where[id(layer)] = (stack, i, len(layers))
                streamed.update(ids)
        # Layers holding the very same parameters (DiffusionGemma's encoder layer N is its
        # decoder layer N) share one load: each maps to the first of them.
        first: dict[frozenset, int] = {}
        self._shared = {lid: first.setdefault(frozenset(ids), lid) for lid, ids in self._layer_params.items()}
        resident = [pid for pid in self._key if pid not in streamed and self._key[pid] is not None]
        self._where_src = where
        self._put(resident)
        self._load_buffers(optional)
        self._current: Optional[int] = None
        self._gate = None  # a running Lockstep
        self._rank = {lid: r for r, lid in enumerate(self._where)}
        self._hooks = []
        for layers in stacks.values():
            for layer in layers:
                self._hooks.append(layer.register_forward_pre_hook(self._before))
                self._hooks.append(layer.register_forward_hook(self._after))
        self.resident_bytes = sum(
            int(np.prod(self._meta[pid].shape, dtype=np.int64)) for pid in resident
        ) * torch.empty((), dtype=dtype).element_size()

    # -- loading --------------------------------------------------------------

    def _put(self, pids: list[int], pooled: bool = False) -> None:
        import torch
        from torch import nn

        keys = [self._key[p] for p in pids if self._key[p] is not None]
        t = time.perf_counter()
        values = self.source.read(keys) if keys else {}
        for pid in pids:
            key = self._key[pid]
            if key is None:
                continue
            src = values.pop(key)
            spare = self._pool.get((tuple(src.shape), self.dtype)) if pooled else None
            if spare:
                value = spare.pop()
                value.copy_(src)  # cast into a buffer a released layer left
            elif pooled:
                value = torch.empty(src.shape, dtype=self.dtype)
                value.copy_(src)
            else:
                value = src.to(self.dtype)
            del src
            self.load_bytes += value.numel() * value.element_size()
            param = nn.Parameter(value, requires_grad=False)
            for owner, attr in self._aliases[pid]:
                owner._parameters[attr] = param
        self.load_seconds += time.perf_counter() - t

    def _load_buffers(self, optional) -> None:
        """Every buffer the source holds (layer scalars, expert biases, vision
        statistics); persistent buffers it lacks must be optional."""
        model = self.model
        found = []
        for full, buf in model.named_buffers(remove_duplicate=False):
            owner_name, _, attr = full.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            if full in self.source:
                found.append((full, owner, attr, buf))
            elif attr not in owner._non_persistent_buffers_set and not optional(full) \
                    and "rotary" not in full and not full.endswith("inv_freq"):
                raise WeightError(f"{self._where_src}: no tensor {full} (the reference needs shape "
                                  f"{list(buf.shape)})")
        values = self.source.read([f for f, *_ in found]) if found else {}
        for full, owner, attr, buf in found:
            value = values[full]
            if tuple(value.shape) != tuple(buf.shape):
                raise WeightError(f"{self._where_src}: tensor {full} has shape {list(value.shape)}; the "
                                  f"reference expects {list(buf.shape)}")
            owner._buffers[attr] = value.to(self.dtype if buf.is_floating_point() else buf.dtype)

    def _release(self, layer_id: int) -> None:
        for pid in self._layer_params[layer_id]:
            meta = self._meta[pid]
            owner, attr = self._aliases[pid][0]
            live = owner._parameters[attr]
            for owner, attr in self._aliases[pid]:
                owner._parameters[attr] = meta
            if live is not meta and live.device.type != "meta":
                self._pool.setdefault((tuple(live.shape), live.dtype), []).append(live.data)

    def _materialize(self, lid: int) -> None:
        """Make layer ``lid`` the one materialized layer (no read when the
        current one holds the same parameters)."""
        if self._current is not None and self._shared[self._current] == self._shared[lid]:
            self._current = lid
            return
        if self._current is not None:
            self._release(self._current)
            self._current = None
        missing = [self._names[p][0] for p in self._layer_params[lid] if self._key[p] is None]
        if missing:
            raise WeightError(f"{self._where_src}: no tensor {missing[0]}, which this forward pass needs")
        stack, i, n = self._where[lid]
        self._put(self._layer_params[lid], pooled=True)
        M.trim()  # the read's transient tensors (memory.py: why)
        self._current = lid
        self.layer_loads += 1
        self.bar.step(f"{self.label}: {stack} layers", i, n)

    def _order(self, lid: int) -> int:
        return self._rank[lid]

    def _share(self, lid: int) -> int:
        """The layer whose load serves ``lid`` (itself unless it shares parameters)."""
        return self._shared[lid]

    def _before(self, module, args):
        if self._gate is not None and self._gate.owns():
            self._gate.before(id(module))
        else:
            self._materialize(id(module))

    def _after(self, module, args, output):
        if self._gate is not None and self._gate.owns():
            self._gate.after()  # the layer stays until the next one is chosen
        elif self._current == id(module):
            self._release(self._current)
            self._current = None

    def lockstep(self, jobs: list) -> list:
        """Run independent forward passes (callables) so that they share each
        layer load (``dlm.verify.lockstep``); their results, in order."""
        from .lockstep import Lockstep

        if len(jobs) <= 1:
            return [job() for job in jobs]
        self._gate = Lockstep(self)
        try:
            return self._gate.run(jobs)
        finally:
            self._gate = None
            if self._current is not None:
                self._release(self._current)
                self._current = None

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._current is not None:
            self._release(self._current)
            self._current = None
        self._pool = {}
        M.trim()
        self.bar.close()

    def stats(self) -> dict:
        """Layer loads, seconds spent reading and casting weights, GB materialized, GB resident."""
        return dict(layer_loads=self.layer_loads, load_seconds=round(self.load_seconds, 3),
                    load_gb=round(self.load_bytes / 1e9, 3), resident_gb=round(self.resident_bytes / 1e9, 3))


def stacks_of(model, *paths: str) -> dict[str, list]:
    """``{path: list(layers)}`` for the ModuleLists at dotted ``paths`` that exist."""
    out = {}
    for path in paths:
        try:
            layers = model.get_submodule(path)
        except AttributeError:
            continue
        out[path] = list(layers)
    if not out:
        raise DlmError(f"the reference has none of the layer stacks {', '.join(paths)}")
    return out


class MappingSource:
    """A plain ``{name: array}`` mapping (numpy or torch) as a weight source."""

    def __init__(self, weights: Mapping):
        self.weights = weights
        self.where = "the given weights"

    def keys(self):
        return self.weights.keys()

    def __contains__(self, name) -> bool:
        return name in self.weights

    def shape(self, name: str) -> tuple:
        return tuple(self.weights[name].shape)

    def numel(self) -> int:
        return sum(int(np.prod(self.shape(k), dtype=np.int64)) for k in self.keys())

    def read(self, names: list[str]) -> dict:
        import torch

        out = {}
        for n in names:
            v = self.weights[n]
            out[n] = v if isinstance(v, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(v))
        return out


def as_source(weights, path: Path):
    """The weight source of a streamed reference: ``weights`` (a source, or a
    mapping), else the checkpoint at ``path``."""
    if weights is None:
        return CheckpointSource(path)
    if hasattr(weights, "read") and hasattr(weights, "shape"):
        return weights
    return MappingSource(weights)
