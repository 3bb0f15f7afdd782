"""DiffusionGemma verify adapter: the PyTorch reference (transformers'
``DiffusionGemmaForBlockDiffusion``) and the matching MLX calls.

Implements the protocol of ``dlm.verify.protocol``. The reference is the
transformers 5.24 implementation itself, run on CPU; the deterministic
generation is its own ``generate`` with a debug canvas (every
``torch.randint`` draw of the sampler replaced by the n-th pattern of
lablup/mlxcel's ``debug_canvas_pattern``, ``torch.multinomial`` by the
argmax). torch and transformers are
imported lazily: the MLX half of this module runs on machines without them
(bundle comparisons).
"""

from __future__ import annotations

import contextlib
import copy
import math
import numpy as np

from dlm.runtime.platform.errors import DlmError

from dlm.runtime.generation.inputs import split_prompt

from ..protocol import CommitStream, LogitCase, TraceRecorder
from .loading import (  # noqa: F401  (the protocol's load_reference / reference_layers)
    TEXT_STACKS,
    Reference,
    load_reference,
    reference_layers,
    reference_routers,
)
from .routing import force_reference_routes, record_mlx_routes  # noqa: F401  (dlm.verify.routes)
from .images import (  # noqa: F401  (the adapter's image hooks)
    VISION_PREFIXES,
    has_vision,
    image_support,
    is_vision_weight,
    mlx_image_features,
    mlx_prefill,
    reference_image_features,
    torch_image_kwargs,
)

SC_TOPK = 64  # self-conditioning inputs are stored as top-K + tail mass (bundles stay small)
_GEN_KEYS = (
    "max_denoising_steps", "t_min", "t_max", "stability_threshold", "confidence_threshold",
    "eos_token_id", "pad_token_id", "bos_token_id",
)
_GEN_DEFAULTS = dict(
    max_denoising_steps=48, t_min=0.4, t_max=0.8, stability_threshold=1, confidence_threshold=0.005,
    entropy_bound=0.1,
)


def debug_pattern(n: int, length: int, vocab: int) -> np.ndarray:
    """The n-th debug canvas (lablup/mlxcel's ``debug_canvas_pattern``): x[i] = ((i+1)*7919 + n*104729) mod V."""
    i = np.arange(length, dtype=np.int64)
    return (((i + 1) * 7919 + n * 104729) % vocab).astype(np.int64)


def _text_config(config: dict) -> dict:
    return config["text_config"] if config.get("model_type") == "diffusion_gemma" else config


def _vocab(config: dict) -> int:
    return int(_text_config(config)["vocab_size"])


def _canvas_length(config: dict) -> int:
    return int(config.get("canvas_length", 256))




# ---------------------------------------------------------------------------
# Logit cases
# ---------------------------------------------------------------------------


def logit_cases(config: dict, prompts: list[list[int]], generation_config: dict) -> list[LogitCase]:
    """Per prompt: prefill + one decoder step on the arange canvas (as
    transformers' integration test) and on the first debug-canvas pattern,
    each without and with self-conditioning; for the first and the last
    prompt also a decoder step on the next canvas after committing one canvas
    (re-encode at the same positions, sliding window across canvases)."""
    L, V = _canvas_length(config), _vocab(config)
    t_max = float(generation_config.get("t_max") or _GEN_DEFAULTS["t_max"])
    canvases = {"arange": np.arange(L, dtype=np.int64) % V, "debug": debug_pattern(0, L, V)}
    cases: list[LogitCase] = []
    for i, prompt in enumerate(prompts):
        for cname, canvas in canvases.items():
            base = f"p{i}.{cname}"
            cases.append(LogitCase(base, list(prompt), {"canvas": canvas}, {"canvas": cname}))
            cases.append(
                LogitCase(
                    base + ".sc", list(prompt), {"canvas": canvas},
                    {"canvas": cname, "sc_from": base, "sc_temperature": t_max},
                )
            )
        if i in (0, len(prompts) - 1) and (i == 0 or len(prompts) > 1):
            cases.append(
                LogitCase(
                    f"p{i}.next", list(prompt),
                    {"committed": debug_pattern(1, L, V), "canvas": debug_pattern(2, L, V)},
                    {"canvas": "debug", "committed": "debug"},
                )
            )
    return cases


def image_logit_cases(config: dict, prompts: list, generation_config: dict) -> list[LogitCase]:
    """Per image prompt (a PromptInputs): prefill with the images + one decoder
    step on the first debug-canvas pattern, without and with
    self-conditioning; for the first prompt also a decoder step after one
    committed canvas (the cache holds the image blocks)."""
    L, V = _canvas_length(config), _vocab(config)
    t_max = float(generation_config.get("t_max") or _GEN_DEFAULTS["t_max"])
    canvas = debug_pattern(0, L, V)
    cases: list[LogitCase] = []
    for i, prompt in enumerate(prompts):
        ids, images = split_prompt(prompt)
        base = f"image.p{i}.debug"
        cases.append(LogitCase(base, ids, {"canvas": canvas}, {"canvas": "debug"}, images))
        cases.append(LogitCase(base + ".sc", ids, {"canvas": canvas},
                               {"canvas": "debug", "sc_from": base, "sc_temperature": t_max}, images))
        if i == 0:
            cases.append(LogitCase(
                f"image.p{i}.next", ids, {"committed": debug_pattern(1, L, V), "canvas": debug_pattern(2, L, V)},
                {"canvas": "debug", "committed": "debug"}, images,
            ))
    return cases


def sc_inputs(logits: np.ndarray, temperature: float, k: int = SC_TOPK) -> dict[str, np.ndarray]:
    """Self-conditioning input = the previous step's processed logits
    (logits / T), stored as the top-k entries per position plus one fill value
    that keeps the tail's total probability mass."""
    x = np.asarray(logits, np.float64) / temperature
    V = x.shape[-1]
    k = min(k, V - 1)
    ids = np.argpartition(-x, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(x, ids, axis=-1)
    mask = np.ones_like(x, dtype=bool)
    np.put_along_axis(mask, ids, False, axis=-1)
    tail = np.where(mask, x, -np.inf)
    m = tail.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(tail - m).sum(-1, keepdims=True)))[:, 0]
    fill = lse - math.log(V - k)
    return {
        "sc_ids": ids.astype(np.int32),
        "sc_vals": vals.astype(np.float32),
        "sc_fill": fill.astype(np.float32),
    }


def dense_sc(arrays: dict, vocab: int) -> np.ndarray | None:
    """[L, V] float32 self-conditioning logits from a case's sparse inputs."""
    if "sc_ids" not in arrays:
        return None
    fill = np.asarray(arrays["sc_fill"], np.float32)
    dense = np.repeat(fill[:, None], vocab, axis=1)
    np.put_along_axis(dense, np.asarray(arrays["sc_ids"], np.int64), np.asarray(arrays["sc_vals"], np.float32), -1)
    return dense


def _complete_case(case: LogitCase, done: dict) -> None:
    src = case.meta.get("sc_from")
    if src and "sc_ids" not in case.arrays:
        if src not in done:
            raise DlmError(f"case {case.name} needs the logits of case {src} first")
        case.arrays.update(sc_inputs(done[src], float(case.meta["sc_temperature"])))


def case_waves(cases: list[LogitCase]) -> list[list[LogitCase]]:
    """The cases in waves: a self-conditioned case comes after the case whose
    logits it is conditioned on (the suite runs each wave's cases together)."""
    wave: dict[str, int] = {}
    for case in cases:
        src = case.meta.get("sc_from")
        wave[case.name] = wave.get(src, -1) + 1 if src else 0
    out: list[list[LogitCase]] = [[] for _ in range(max(wave.values(), default=-1) + 1)]
    for case in cases:
        out[wave[case.name]].append(case)
    return out


def reference_logits(ref: Reference, case: LogitCase, done: dict) -> np.ndarray:
    """Prefill (+ optional committed canvas) then one decoder step, exactly as
    ``generate`` calls the encoder and the decoder (dynamic cache)."""
    import torch
    from transformers import DynamicCache

    _complete_case(case, done)
    model = ref.model
    L = _canvas_length(ref.config)
    V = _vocab(ref.config)
    with torch.no_grad():
        ids = torch.tensor([case.prompt_ids], dtype=torch.long)
        key = (tuple(case.prompt_ids), tuple(id(i) for i in case.images))
        shared = ref.prefilled  # read once: lockstep cases may replace it meanwhile
        if ref.streamer is not None and shared is not None and shared[0] == key:
            # Layer-streamed: the cases of one prompt share its prefill (a copy of
            # the encoder's cache), so each reads the layers for its decoder pass only.
            cache, pos = copy.deepcopy(shared[1]), len(case.prompt_ids)
        else:
            cache = DynamicCache(config=model.config.get_text_config(decoder=True))
            pos = _encode(model, ids, cache, start=0, prefill=True, images=case.images)
            if ref.streamer is not None:
                ref.prefilled = (key, copy.deepcopy(cache))
        if "committed" in case.arrays:
            committed = torch.from_numpy(np.asarray(case.arrays["committed"], np.int64))[None]
            ids = torch.cat([ids, committed], dim=-1)
            pos = _encode(model, ids, cache, start=pos, prefill=False)
        canvas = torch.from_numpy(np.asarray(case.arrays["canvas"], np.int64))[None]
        sc = dense_sc(case.arrays, V)
        sc_t = None
        if sc is not None:
            sc_t = torch.from_numpy(sc)[None].to(model.model.decoder.embed_tokens.weight.dtype)
        out = _decode(model, canvas, sc_t, cache, pos, L)
    return out[0].float().numpy()


def _encode(model, ids, cache, *, start: int, prefill: bool, images: list | None = None) -> int:
    """Run the encoder on the uncached tokens of ``ids`` (the prefill call also
    takes the prompt's images, as ``generate`` passes them); returns the new length."""
    import torch

    L = model.config.canvas_length
    total = ids.shape[1]
    new = total - start
    if not prefill and new != L:
        raise DlmError("a committed canvas must be exactly canvas_length tokens")
    positions = torch.arange(start, total, dtype=torch.int32)[None]
    attention = torch.ones((1, total), dtype=torch.bool)
    extra = torch_image_kwargs(model, ids, images) if prefill and images else {}
    mm = {"mm_token_type_ids": extra["mm_token_type_ids"]} if extra else {}
    unprocessed, masks = model._prepare_encoder_inputs(
        input_ids=ids, attention_mask=attention, encoder_position_ids=positions, cache=cache,
        is_prefill=prefill, canvas_length=L, batch_size=1, **mm,
    )
    model.model.encoder(input_ids=unprocessed, attention_mask=masks, cache=cache, position_ids=positions,
                        **extra)
    return total


def _decode(model, canvas, sc_logits, cache, start: int, L: int):
    import torch

    positions = torch.arange(start, start + L, dtype=torch.int32)[None]
    decoder_mask = torch.ones((1, start + L), dtype=torch.bool)
    masks = model.model.decoder.create_diffusion_decoder_attention_mask(
        config=model.config, inputs_embeds=canvas.unsqueeze(-1), cache=cache,
        decoder_attention_mask=decoder_mask,
    )
    out = model(
        decoder_input_ids=canvas, self_conditioning_logits=sc_logits, decoder_attention_mask=masks,
        cache=cache, decoder_position_ids=positions,
    )
    return out.logits


# ---------------------------------------------------------------------------
# Deterministic generation (debug canvas)
# ---------------------------------------------------------------------------


def stream_settings(config: dict, generation_config: dict, *, blocks: int = 2,
                    steps: int | None = None) -> dict:
    gen = dict(_GEN_DEFAULTS)
    gen.update({k: generation_config[k] for k in _GEN_KEYS if generation_config.get(k) is not None})
    sampler = generation_config.get("sampler_config") or {}
    if isinstance(sampler, dict) and sampler.get("entropy_bound") is not None:
        gen["entropy_bound"] = float(sampler["entropy_bound"])
    if steps is not None:
        gen["max_denoising_steps"] = int(steps)
    eos = gen.get("eos_token_id", _text_config(config).get("eos_token_id", 1))
    gen["eos_token_id"] = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    gen["max_new_tokens"] = int(blocks) * _canvas_length(config)
    gen["debug_canvas"] = True
    return gen


def acceptance(settings: dict):
    """The entropy-bound sampler's statistic and rule, per step, for the trace
    (protocol.TraceRecorder): the runtime's own ``token_entropy`` of the logits
    at the step's scheduled temperature (step index 0 at cur_step = N; T = 1
    without a schedule) and ``entropy_bound_accept``. Applied to each
    framework's recorded logits alike, so a difference in what they keep comes
    from their logits, not from the rule."""
    import mlx.core as mx

    from dlm.runtime.models.diffusion_gemma import sampling as S

    n, bound = int(settings["max_denoising_steps"]), float(settings["entropy_bound"])
    t_min, t_max = settings.get("t_min"), settings.get("t_max")

    def score(logits: np.ndarray, index: int):
        t = S.linear_temperature(n - index, n, t_min, t_max) if t_min is not None and t_max is not None else 1.0
        entropy = S.token_entropy(mx.array(logits) / mx.array(t, dtype=mx.float32))
        return np.array(entropy), np.array(S.entropy_bound_accept(entropy, bound))

    return score


def _truncate_at_eos(tokens: list[int], eos: list[int]) -> tuple[list[int], bool]:
    for j, t in enumerate(tokens):
        if t in eos:
            return tokens[:j], True
    return tokens, False


@contextlib.contextmanager
def _no_cudagraph_marks(model):
    """transformers' denoising step calls ``torch.compiler.cudagraph_mark_step_begin``
    (for CUDA graphs), whose first call imports torch's inductor: ~2-3 s of a
    small model's verify. On a CPU reference it marks nothing: skip it there."""
    import torch

    marker = torch.compiler.cudagraph_mark_step_begin
    on_cpu = all(p.device.type in ("cpu", "meta") for p in model.parameters())
    if on_cpu:
        torch.compiler.cudagraph_mark_step_begin = lambda: None
    try:
        yield
    finally:
        torch.compiler.cudagraph_mark_step_begin = marker


@contextlib.contextmanager
def debug_canvas_rng(vocab: int, length: int):
    """Replace the sampler's randomness by the debug canvas (mlxcel's ``debug_canvas_pattern``).

    Every ``torch.randint(0, V, (B, L))`` returns the n-th pattern (n counts
    draws: canvas init and per-step renoise, in call order);
    ``torch.multinomial`` returns the argmax of the probabilities."""
    import torch

    real_randint, real_multinomial = torch.randint, torch.multinomial
    counter = {"n": 0}

    def randint(*args, **kwargs):
        rest = list(args)
        size = kwargs.get("size")
        if size is None and rest and isinstance(rest[-1], (tuple, list, torch.Size)):
            size = rest.pop()
        if "high" in kwargs:
            low, high = kwargs.get("low", rest[0] if rest else 0), kwargs["high"]
        elif len(rest) >= 2:
            low, high = rest[0], rest[1]
        elif len(rest) == 1:
            low, high = kwargs.get("low", 0), rest[0]
        else:
            low = high = None
        if low == 0 and high == vocab and size is not None and tuple(size)[-1] == length:
            n = counter["n"]
            counter["n"] += 1
            row = torch.from_numpy(debug_pattern(n, length, vocab))
            return row.expand(tuple(size)).clone().to(kwargs.get("device") or "cpu")
        return real_randint(*args, **kwargs)

    def multinomial(probs, num_samples, *args, **kwargs):
        if num_samples != 1:
            return real_multinomial(probs, num_samples, *args, **kwargs)
        return probs.argmax(dim=-1, keepdim=True)

    torch.randint, torch.multinomial = randint, multinomial
    try:
        yield counter
    finally:
        torch.randint, torch.multinomial = real_randint, real_multinomial


class _CanvasStreamer:
    """Collects what generate() commits (``put``) per canvas."""

    def __init__(self):
        self.puts: list[list[int]] = []

    def put(self, value):
        self.puts.append([int(t) for t in value.reshape(-1).tolist()])

    def put_draft(self, value=None, logits=None):
        pass

    def end(self):
        pass


def reference_commit_stream(ref: Reference, prompt, settings: dict) -> CommitStream:
    """transformers' own ``generate`` under the debug canvas, with a per-step
    trace. ``prompt``: token ids, or a PromptInputs (its images go to generate)."""
    import torch
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        DiffusionGemmaGenerationConfig,
    )

    model = ref.model
    prompt_ids, images = split_prompt(prompt)
    L, V = _canvas_length(ref.config), _vocab(ref.config)
    gen = DiffusionGemmaGenerationConfig(
        max_new_tokens=settings["max_new_tokens"],
        max_denoising_steps=settings["max_denoising_steps"],
        sampler_config={"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": settings["entropy_bound"]},
        t_min=float(settings["t_min"]), t_max=float(settings["t_max"]),
        stability_threshold=int(settings["stability_threshold"]),
        confidence_threshold=float(settings["confidence_threshold"]),
        eos_token_id=settings["eos_token_id"], pad_token_id=settings.get("pad_token_id"),
    )
    # One recorder per canvas, keyed by the canvas's first decoder position.
    canvases: dict[int, TraceRecorder] = {}
    scorer = acceptance(settings)
    streamer = _CanvasStreamer()
    real_forward = model.forward
    shadowed = model.__dict__.get("forward")  # an instance-level wrapper to restore

    def forward(*args, **kwargs):
        out = real_forward(*args, **kwargs)
        positions = kwargs.get("decoder_position_ids")
        if kwargs.get("decoder_input_ids") is not None and positions is not None:
            start = int(positions.reshape(-1)[0])
            canvases.setdefault(start, TraceRecorder(prompt_ids, acceptance=scorer)).step(
                out.logits[0].float().numpy())
        return out

    model.forward = forward
    try:
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        with torch.no_grad(), debug_canvas_rng(V, L), _no_cudagraph_marks(model):
            model.generate(ids, generation_config=gen, streamer=streamer,
                           **torch_image_kwargs(model, ids, images))
    finally:
        if shadowed is not None:
            model.forward = shadowed
        else:
            del model.forward
    committed = streamer.puts[1:]  # the first put is the prompt
    return assemble_stream(prompt_ids, [canvases[k] for k in sorted(canvases)], committed,
                           settings["eos_token_id"])


def assemble_stream(prompt_ids: list[int], recorders: list[TraceRecorder], committed: list[list[int]],
                    eos: list[int]) -> CommitStream:
    """One block per committed canvas, cut at the first EOS (EOS excluded);
    finish_reason "stop" when an EOS was committed, else "length"."""
    if len(recorders) != len(committed):
        raise DlmError(f"{len(committed)} committed canvases but {len(recorders)} traced canvases")
    stream = CommitStream(prompt_ids=list(prompt_ids), blocks=[], finish_reason="length")
    for rec, canvas in zip(recorders, committed):
        tokens, hit = _truncate_at_eos(list(canvas), eos)
        rec.commit(tokens)
        stream.blocks.append(rec.stream.blocks[-1])
        if hit:
            stream.finish_reason = "stop"
            break
    return stream


# ---------------------------------------------------------------------------
# MLX side (runtime model methods: make_cache / prefill / encode / decode)
# ---------------------------------------------------------------------------


def compute_dtype(loaded) -> str:
    return str(loaded.model.dtype).replace("mlx.core.", "")


_prefilled: dict = {}  # the last prompt's MLX prefill: {"model": weakref, "key": ..., "cache": [PrefixCache]}


def _shared_prefill(loaded, case: LogitCase, collect: list | None) -> list:
    """The prompt's encoder cache after its prefill, computed once for the
    logits cases of one prompt (the released 26B model: ~190 s a prefill on
    this CPU) and handed to each case as a copy. The cache's arrays are
    immutable (updates rebind them), so a shallow copy of each layer's cache
    gives the case a prefill equal to its own, bit for bit. A case that
    collects per-layer hidden states runs its own prefill (and leaves it)."""
    import weakref

    model = loaded.model
    key = (tuple(case.prompt_ids), tuple(id(i) for i in case.images))
    held = _prefilled.get("model")
    if collect is None and held is not None and held() is model and _prefilled["key"] == key:
        return [copy.copy(c) for c in _prefilled["cache"]]
    cache = model.make_cache()
    mlx_prefill(loaded, case.prompt_ids, cache, case.images, collect=collect)
    if hasattr(collect, "feed"):  # fed the reference's hidden states (dlm.verify.local): not MLX's own prefill
        return cache
    if held is None or held() is not model:  # the cache goes with the model (run_parity releases it)
        weakref.finalize(model, _prefilled.clear)
    _prefilled.update(model=weakref.ref(model), key=key, cache=[copy.copy(c) for c in cache])
    return cache


def mlx_logits(loaded, case: LogitCase, collect: dict | None = None, feed: dict | None = None) -> np.ndarray:
    """The same forward pass as ``reference_logits`` on the MLX model.
    ``collect``: filled with ``{stack: [per-layer float32 [positions, hidden]]}``
    (the stacks of ``reference_layers``; the last encoder layer, whose output
    MLX never computes, is left out). ``feed``: ``{stack: dlm.verify.local.Feed}``,
    which hand every layer the reference's input (the layer-local check)."""
    import mlx.core as mx

    from dlm.runtime.models.diffusion_gemma.layers import record_routes

    model = loaded.model
    V = _vocab(loaded.config)
    enc = [] if collect is not None else None
    dec = [] if collect is not None else None
    if feed is not None:
        enc, dec = feed["encoder"], feed["decoder"]
    routing = record_routes() if collect is not None else contextlib.nullcontext([])
    with routing as enc_routes:
        cache = _shared_prefill(loaded, case, enc)
        offset = len(case.prompt_ids)
        if "committed" in case.arrays:
            committed = np.asarray(case.arrays["committed"], np.int32)
            model.encode(mx.array(committed), cache, offset=offset, collect=enc)
            offset += len(committed)
    sc = dense_sc(case.arrays, V)
    sc_mx = None if sc is None else mx.array(sc)[None].astype(model.dtype)
    canvas = mx.array(np.asarray(case.arrays["canvas"], np.int32))
    routing = record_routes() if collect is not None else contextlib.nullcontext([])
    with routing as dec_routes:
        logits = model.decode(canvas, cache, sc_logits=sc_mx, offset=offset, collect=dec)
    if collect is not None:
        from ..layers import ROUTES, per_layer

        n = len(model.layers)
        collect["encoder"] = per_layer(enc, n)[: n - 1]
        collect["decoder"] = per_layer(dec, n)
        collect["encoder" + ROUTES] = per_layer(enc_routes, n)[: n - 1]
        collect["decoder" + ROUTES] = per_layer(dec_routes, n)
    return np.array(logits[0].astype(mx.float32))


def mlx_commit_stream(loaded, prompt, settings: dict) -> CommitStream:
    """The runtime's own generation loop (``dlm.runtime.api.stream_generate``)
    with the debug canvas, full-length canvases and a per-step trace.
    ``prompt``: token ids, or a PromptInputs (with images)."""
    import mlx.core as mx

    from dlm.runtime import api

    L = _canvas_length(loaded.config)
    options = {
        "max_tokens": int(settings["max_new_tokens"]),
        "max_denoising_steps": int(settings["max_denoising_steps"]),
        "debug_canvas": True,
        "diffusion_full_canvas": True,
        "diffusion_max_canvas_length": L,
    }
    recorders: list[TraceRecorder] = []
    prompt_ids, _ = split_prompt(prompt)

    scorer = acceptance(settings)

    def on_step(index, logits, argmax):
        if index == 0:
            recorders.append(TraceRecorder(prompt_ids, acceptance=scorer))
        recorders[-1].step(np.array(logits[0].astype(mx.float32)))

    committed: list[list[int]] = []
    finish = None
    for event in api.stream_generate(loaded, prompt, options, on_step=on_step):
        if event.done:
            finish = event.finish_reason
        else:
            committed.append(list(event.token_ids))
    # The runtime emits canvases cut before the first EOS; assemble_stream
    # applies the same cut to the reference's canvases.
    stream = assemble_stream(prompt_ids, recorders[: len(committed)], committed, settings["eos_token_id"])
    stream.finish_reason = finish
    return stream
