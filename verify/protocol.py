"""The family plug-in protocol of ``dlm-verify`` and the data it exchanges.

dlm-verify never branches on ``model_type``. It asks the registry
(``dlm.runtime.registry.family_for_config(config)``) for the family, whose
declaration names its *verify adapter* (``Family.reference``:
``dlm.verify.<family>.adapter``, imported by ``adapter_for``). That module
exposes the functions below; everything else (metrics, thresholds, checks,
bundles, reports, CLI) is shared.

Adapter functions (module level, in ``verify/<family>/adapter.py``)
---------------------------------------------------------------------

``load_reference(path, *, dtype="float32", weights=None, trust_remote_code=False, stream=False) -> object``
    Build the PyTorch reference on CPU from a local checkpoint directory
    (``path``: already resolved, see ``dlm.verify.source``) in ``dtype``
    ("float32" | "bfloat16" | "float16"). Load weights only from safetensors.
    ``weights``: optional mapping ``{hf_name: np.ndarray}`` (possibly lazy:
    read each tensor once, by key, while loading) that replaces the
    checkpoint's weights (implementation parity of a quantized model: these
    are the MLX model's dequantized weights, already mapped back to HF names by
    the family's ``to_hf``, in ``runtime/models/<family>/weights.py``). With ``weights`` given, ``path`` may be the
    converted MLX directory (only its config.json is then read). Never run
    checkpoint code unless ``trust_remote_code``. Raise
    ``dlm.runtime.platform.errors.DlmError`` (or a subclass) with a clear message when
    the reference cannot be built. Returns an opaque handle that the other
    ``reference_*`` functions receive. ``stream``: build the same reference
    with its layers' weights streamed from disk (``dlm.verify.streaming``:
    skeleton on the meta device, a ``LayerStreamer`` as the handle's
    ``streamer`` attribute, whose weight source is ``weights`` when given,
    then a source with ``read``/``shape``/``keys``, else the checkpoint); the
    results must be the whole-model reference's, to float rounding.

``logit_cases(config, prompts, generation_config) -> list[LogitCase]``
    The fixed forward passes compared by the logits checks, for every prompt
    (``list[list[int]]``). Pure function of its inputs (no model needed): e.g.
    DiffusionGemma builds prefill + decoder step on an arange canvas and on the
    debug-canvas pattern, each without and with self-conditioning, plus a
    decoder step after one committed canvas. Case names must be unique and
    safe in a file name (letters, digits, ``._-/``).

``reference_logits(ref, case, done) -> np.ndarray``
    float32 logits ``[positions, vocab]`` of the reference for one case.
    ``done`` maps earlier case names to their reference logits, so a case may
    derive inputs from an earlier one (DiffusionGemma's self-conditioning input
    is the previous step's processed logits). Derived inputs must be written
    into ``case.arrays`` so that the MLX side and recorded bundles see exactly
    the same inputs; when they are already present, use them unchanged.

``mlx_logits(loaded, case, collect=None, feed=None) -> np.ndarray``
    The same forward pass on the converted MLX model (``loaded``: a
    ``dlm.runtime.loader.LoadedModel``, loaded with ``tokenizer=False``:
    prompts are token ids already), float32 ``[positions, vocab]``. With
    ``reference_layers`` (below), ``collect`` (a dict) gets ``{stack:
    [float32 [positions, hidden] per layer]}``: each layer's output over all of
    the case's positions (the calls concatenated), None for a layer whose
    output the runtime does not compute. ``feed`` (with ``collect``; only
    for families with ``reference_layers``): ``{stack: dlm.verify.local.Feed}``,
    passed as that stack's ``collect`` list to the model's forward methods,
    which hands each layer the reference's input (the layer-local check).

``reference_layers(ref) -> dict[str, list[torch.nn.Module]]`` (optional)
    The reference's layer stacks, in computation order, for the per-layer
    hidden-state diagnostic (``dlm.verify.layers``): the suite hooks their
    outputs while ``reference_logits`` runs, and compares them with
    ``mlx_logits(..., collect=...)``'s.

``case_waves(cases) -> list[list[LogitCase]]`` (optional)
    The logits cases in waves whose members need nothing of each other (a
    case that reads another case's logits comes in a later wave). A
    layer-streamed reference runs each wave's cases in lockstep
    (``dlm.verify.lockstep``). Default: one wave. ``reference_logits`` must
    then be safe to call from several threads at once.

``stream_settings(config, generation_config, *, blocks, steps) -> dict``
    JSON-able settings of the deterministic generation compared by the commit
    stream check: ``blocks`` canvases/blocks, at most ``steps`` denoising steps
    each (None: the checkpoint's default). Stored in bundles.

``reference_commit_stream(ref, prompt_ids, settings) -> CommitStream``
``mlx_commit_stream(loaded, prompt_ids, settings) -> CommitStream``
    Deterministic generation in each framework (DiffusionGemma: the debug
    canvas, as lablup/mlxcel's ``debug_canvas_pattern``; LLaDA-2: greedy-fixed sampling), with a per-step
    trace: the argmax of every denoising step and the top-K logits at every
    position (``CommitStream`` below; build it with ``TraceRecorder``). The
    MLX side must drive the runtime's own loop (``dlm.runtime.api
    .stream_generate``, per-step logits through its ``on_step`` hook), not a
    copy of it. Block tokens are the committed tokens as the runtime emits
    them (DiffusionGemma: cut before the first EOS; apply the same cut to the
    reference); ``finish_reason`` "stop" | "length".

``compute_dtype(loaded) -> str`` (optional)
    The dtype the MLX model computes in ("float32", "bfloat16", ...). Default:
    the dtype of its unquantized floating-point weights.

Image hooks (optional, all or none; a family without images defines none)
--------------------------------------------------------------------------

With them the suite also checks the image path on the built-in test images
(``dlm.verify.images``), whose prompts it encodes with ``dlm.runtime.api
.encode_inputs``; then ``reference_logits`` / ``mlx_logits`` also get cases
whose ``images`` are set (their preprocessed images, in prompt order), and
``reference_commit_stream`` / ``mlx_commit_stream`` also get a
``dlm.runtime.generation.inputs.PromptInputs`` in place of the ids.

``has_vision(config) -> bool``
    Whether a config.json (original or converted) describes a vision tower
    whose weights the checkpoint holds (False for a text-only conversion).

``image_support(path, config) -> str | None``
    None when the reference checkpoint at ``path`` can take images, else why
    not (shown as a note: no vision tower, no image processor files, ...).

``image_logit_cases(config, prompts, generation_config) -> list[LogitCase]``
    The fixed forward passes on the image prompts (``list[PromptInputs]``),
    each case with ``images`` set; names start with ``image.`` and are unique.

``reference_image_features(ref, image) -> np.ndarray``
``mlx_image_features(loaded, image) -> np.ndarray``
    float32 ``[soft_tokens, hidden]``: one preprocessed image
    (``dlm.runtime.generation.inputs.ImageInput``) through the vision tower and its
    projection into the text embedding space, as the prompt embeds it.

``is_vision_weight(name) -> bool``
    Whether a converted (MLX) tensor belongs to the vision encoder: the
    precision of those tensors sets the image-feature thresholds.

Import torch and transformers inside the ``reference_*`` / ``load_reference``
functions, never at module level: ``dlm-verify --parity MLX_DIR --bundle B``
imports the adapter for its MLX half on machines without torch.

Shared data (this module)
-------------------------
``LogitCase`` (inputs of one forward pass), ``BlockTrace`` / ``CommitStream``
(a generation and its per-step trace). Arrays are numpy so that bundles load on
a machine without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from dlm.runtime.platform.errors import ConfigError

REFERENCE_DTYPES = ("float32", "bfloat16", "float16")


def torch_dtype(dtype: str):
    """The torch dtype a reference computes in (--reference-dtype)."""
    import torch

    if dtype not in REFERENCE_DTYPES:
        raise ConfigError(
            f"--reference-dtype must be one of {', '.join(REFERENCE_DTYPES)}, not {dtype!r}"
        )
    return getattr(torch, dtype)

TOPK = 16  # candidates kept per position and step in commit-stream traces


@dataclass
class LogitCase:
    """One fixed forward pass: a prompt plus family-specific inputs."""

    name: str
    prompt_ids: list[int]
    # Family-specific inputs (canvas ids, self-conditioning logits, ...), numpy.
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    # JSON-able description (kind, canvas pattern, dependencies, ...).
    meta: dict = field(default_factory=dict)
    # Image cases: the prompt's preprocessed images (dlm.runtime.generation.inputs.ImageInput), in order.
    images: list = field(default_factory=list)

    def describe(self) -> str:
        return f"{self.name} (prompt of {len(self.prompt_ids)} tokens)"


@dataclass
class BlockTrace:
    """One committed canvas/block and the denoising steps that produced it."""

    tokens: list[int]
    steps: int
    # [steps, positions] argmax of every step (int32).
    step_argmax: np.ndarray
    # [steps, positions, TOPK] candidate ids and their logits (raw, before any
    # temperature), best first.
    topk_ids: np.ndarray
    topk_logits: np.ndarray
    # [steps, positions] the statistic the family's sampler accepts positions
    # by (DiffusionGemma: entropy at the step's temperature) and the positions
    # its rule accepts by it; None where the family records none. They tell an
    # acceptance near-tie (equal argmaxes, different positions kept) apart
    # from a real divergence (metrics.acceptance_tie).
    step_scores: Optional[np.ndarray] = None
    step_accept: Optional[np.ndarray] = None


@dataclass
class CommitStream:
    prompt_ids: list[int]
    blocks: list[BlockTrace]
    finish_reason: Optional[str] = None

    @property
    def tokens(self) -> list[int]:
        return [t for b in self.blocks for t in b.tokens]

    @property
    def steps_per_block(self) -> list[int]:
        return [b.steps for b in self.blocks]


class TraceRecorder:
    """Builds a CommitStream step by step without keeping full logits around.

    Call ``step(logits)`` once per denoising step with that step's raw logits
    ``[positions, vocab]`` (numpy, or anything ``np.asarray`` accepts), then
    ``commit(tokens)`` once per committed canvas/block. ``acceptance(logits,
    step_index)``, optional: ``(scores, accepted)`` per position of the step
    (BlockTrace.step_scores / step_accept).
    """

    def __init__(self, prompt_ids: list[int], k: int = TOPK, acceptance=None):
        self.stream = CommitStream(prompt_ids=list(prompt_ids), blocks=[])
        self.k = k
        self.acceptance = acceptance
        self._scores: list[np.ndarray] = []
        self._accept: list[np.ndarray] = []
        self._argmax: list[np.ndarray] = []
        self._ids: list[np.ndarray] = []
        self._vals: list[np.ndarray] = []

    def step(self, logits) -> None:
        x = np.asarray(logits, dtype=np.float32)
        x = x.reshape(-1, x.shape[-1])
        k = min(self.k, x.shape[-1])
        part = np.argpartition(-x, k - 1, axis=-1)[:, :k]
        vals = np.take_along_axis(x, part, axis=-1)
        order = np.argsort(-vals, axis=-1, kind="stable")
        self._ids.append(np.take_along_axis(part, order, axis=-1).astype(np.int32))
        self._vals.append(np.take_along_axis(vals, order, axis=-1).astype(np.float32))
        self._argmax.append(x.argmax(-1).astype(np.int32))
        if self.acceptance is not None:
            scores, accepted = self.acceptance(x, len(self._argmax) - 1)
            self._scores.append(np.asarray(scores, np.float32).reshape(-1))
            self._accept.append(np.asarray(accepted, bool).reshape(-1))

    def commit(self, tokens) -> None:
        n = len(self._argmax)
        L = len(tokens)
        self.stream.blocks.append(
            BlockTrace(
                tokens=[int(t) for t in tokens],
                steps=n,
                step_argmax=np.stack(self._argmax) if n else np.zeros((0, L), np.int32),
                topk_ids=np.stack(self._ids) if n else np.zeros((0, L, self.k), np.int32),
                topk_logits=np.stack(self._vals) if n else np.zeros((0, L, self.k), np.float32),
                step_scores=np.stack(self._scores) if self._scores else None,
                step_accept=np.stack(self._accept) if self._accept else None,
            )
        )
        self._argmax, self._ids, self._vals, self._scores, self._accept = [], [], [], [], []


REQUIRED = (
    "load_reference",
    "logit_cases",
    "reference_logits",
    "mlx_logits",
    "stream_settings",
    "reference_commit_stream",
    "mlx_commit_stream",
)


IMAGE_HOOKS = (
    "has_vision",
    "image_support",
    "image_logit_cases",
    "reference_image_features",
    "mlx_image_features",
    "is_vision_weight",
)


def adapter_for(family):
    """The family's verify adapter module (``Family.reference``), imported on first use."""
    import importlib

    return importlib.import_module(family.reference)


def has_image_hooks(module) -> bool:
    """Whether a (checked) adapter checks the image path."""
    return all(callable(getattr(module, name, None)) for name in IMAGE_HOOKS)


def check_adapter(module) -> None:
    """Raise TypeError naming what a family's verify adapter lacks (the image
    hooks are optional, but all or none)."""
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise TypeError(f"{module.__name__} lacks verify adapter functions: {', '.join(missing)}")
    some = [name for name in IMAGE_HOOKS if callable(getattr(module, name, None))]
    if some and len(some) != len(IMAGE_HOOKS):
        lacking = [name for name in IMAGE_HOOKS if name not in some]
        raise TypeError(f"{module.__name__} has only some image hooks; it lacks {', '.join(lacking)}")
