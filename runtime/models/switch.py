"""Stacked-expert ("switch") layers shared by the MoE families.

``weight`` is [experts, out, in] (the HF / mlx-lm layout) and is applied with
``gather_mm``; the quantized twin uses ``gather_qmm``. ``SwitchMLP`` is the
routed experts' MLP with the choice of kernel written once for the families
(as mlx-lm's ``switch_layers.SwitchGLU``): each family gives its projections
and activation. The CPU backend's expert kernels and the decisions between
them live in cpu/experts.py; the families reach them through this module.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .quant_modes import mode_defaults
from .cpu.streams import parallel, split_rows
from .cpu import dequant as quantized
from .cpu.dequant import per_call
from .cpu.experts import by_count, by_expert, cpu_eager_experts, dense, grouped, stacks
from .rows import per_sequence

# What the families import from here (``dense``: LLaDA-2's all-experts path, cpu/experts.py).
__all__ = ["QuantizedSwitchLinear", "SwitchLinear", "SwitchMLP", "dense", "project"]


def project(x: mx.array, w: mx.array) -> mx.array:
    """``x`` [rows, in] @ ``w.T`` for one expert's weight ``w`` [out, in]: computed
    in the weight's dtype, returned in ``x``'s."""
    xd = x.astype(w.dtype) if x.dtype != w.dtype else x
    return (xd @ w.T).astype(x.dtype)


class SwitchLinear(nn.Module):
    def __init__(self, input_dims: int, output_dims: int, num_experts: int):
        super().__init__()
        self.weight = mx.zeros((num_experts, output_dims, input_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        w = self["weight"]
        if w.dtype != mx.float32 and mx.default_device() == mx.cpu:
            w = w.astype(mx.float32)  # a model built outside the loader
        xd = x.astype(w.dtype) if x.dtype != w.dtype else x
        y = mx.gather_mm(xd, w.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
        return y.astype(x.dtype)

    def expert_weight(self, expert: int) -> mx.array:
        """One expert's weight [out, in], as its grouped products read it."""
        return self["weight"][expert]

    def to_quantized(self, group_size: int = None, bits: int = None, mode: str = "affine", **_):
        return QuantizedSwitchLinear.from_float(self, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    """SwitchLinear with a packed weight + scales (+ biases for affine), as mx.quantize writes."""

    def __init__(self, weight, scales, biases, group_size: int, bits: int, mode: str):
        super().__init__()
        self.weight, self.scales = weight, scales
        if biases is not None:
            self.biases = biases
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.freeze()

    def expert_weight(self, expert: int) -> mx.array:
        """One expert's weight [out, in] dequantized to float32 (for this call)."""
        return quantized.dequantized(self, expert=expert)

    @classmethod
    def from_float(cls, layer: SwitchLinear, group_size, bits, mode):
        group_size, bits = mode_defaults(mode, group_size, bits)
        w, scales, *biases = mx.quantize(layer.weight, group_size, bits, mode=mode)
        return cls(w, scales, biases[0] if biases else None, group_size, bits, mode)

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        def qmm(xs, ids):
            return mx.gather_qmm(
                xs, self["weight"], self["scales"], self.get("biases"), rhs_indices=ids,
                transpose=True, group_size=self.group_size, bits=self.bits, mode=self.mode,
                sorted_indices=sorted_indices,
            )

        if parallel():  # CPU: rows over one stream per core (cpu/streams.py); callers run this eagerly
            return split_rows(qmm, x, indices)
        return qmm(x, indices)


class SwitchMLP(nn.Module):
    """Routed experts: ``down_proj(activate(*inputs(x)))`` for each (token,
    slot), through the kernel the backend and the shapes choose:

    * ``stacks``: large float experts on the CPU backend, ``by_count`` (one
      GEMM per expert, the experts with as many token copies stacked);
    * ``grouped``: experts dequantized per call on the CPU backend (float ones
      too under DLM_CPU_EXPERTS=each), one expert at a time (``by_expert``);
    * 64 token copies a sequence or more: the copies sorted by expert and one
      sorted ``gather_mm``, which reads each expert's weight once;
    * else the plain ``gather_mm``, one row per token copy.

    A family's subclass sets ``down_proj`` and the input projections that
    ``inputs`` lists (``SwitchLinear``, or their quantized twins), and defines
    ``activate``: the input projections' products of the same rows, in
    ``inputs``' order, -> the activations ``down_proj`` multiplies.
    """

    @property
    def inputs(self) -> list:
        """The projections of the experts' input, in the order ``activate`` takes their products."""
        raise NotImplementedError

    def activate(self, *products: mx.array) -> mx.array:
        raise NotImplementedError

    @property
    def projections(self) -> list:
        """Every projection of the experts: ``inputs``, then ``down_proj``."""
        return [*self.inputs, self.down_proj]

    @property
    def eager(self) -> bool:
        """CPU backend: large float experts (run ``by_count`` or ``by_expert``,
        which read the routing on the host) and quantized ones (their kernel
        split over the CPU streams) run outside mx.compile."""
        return cpu_eager_experts(*self.projections)

    def _expert(self, e: int, blocks: list[mx.array]) -> list[mx.array]:
        """``by_expert``'s ``expert_fn``: expert ``e``'s MLP of each block of
        rows, its weights read (or dequantized) once for all of them."""
        inputs, down = [p.expert_weight(e) for p in self.inputs], self.down_proj.expert_weight(e)
        return [project(self.activate(*(project(rows, w) for w in inputs)), down) for rows in blocks]

    def _through(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        """The experts' MLP through ``gather_mm`` (each projection called with ``indices``)."""
        h = self.activate(*(p(x, indices, sorted_indices=sorted_indices) for p in self.inputs))
        return self.down_proj(h, indices, sorted_indices=sorted_indices)

    def dispatch(self, x: mx.array, indices: mx.array, sequences: int = 1) -> mx.array:
        """``x`` [N, in], ``indices`` [N, K] -> each token copy's output [N, K,
        out]. ``sequences``: ``x`` holds that many equal-length sequences' rows,
        in order (batched generation): the kernel is the one each gets alone,
        and grouped experts multiply each sequence's rows on their own
        (dlm.runtime.models.rows)."""
        N, K = indices.shape
        E = self.inputs[0]["weight"].shape[0]
        copies = per_sequence(N, sequences) * K  # token copies of one sequence
        if stacks(*self.projections):  # one GEMM per expert
            return by_count(x, indices, self._through, sequences)
        if grouped(copies, E, *self.projections):  # one expert at a time
            return by_expert(x, indices, E, self._expert, per_call(self.inputs[0]), sequences)
        if copies >= 64:
            # Sort token copies by expert so gather_mm reads each expert once.
            flat = indices.flatten()
            order = mx.argsort(flat)
            y = self._through(x[order // K][:, None, :], flat[order], sorted_indices=True)
            return y[mx.argsort(order)].reshape(N, K, -1)
        return self._through(x[:, None, None, :], indices).reshape(N, K, -1)

    def __call__(self, x: mx.array, indices: mx.array, sequences: int = 1) -> mx.array:
        return self.dispatch(x, indices, sequences)
