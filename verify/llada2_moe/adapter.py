"""LLaDA-2 (``llada2_moe``) verify adapter: dlm's independent PyTorch
reference (``dlm.verify.llada2_moe.torch_model``, written from
inclusionAI/LLaDA2.0-mini's ``modeling_llada2_moe.py``) and the matching MLX
calls, following ``dlm.verify.protocol``.

With ``trust_remote_code`` and a checkpoint that ships its modeling code
(``auto_map`` + ``modeling_*.py``), that code's forward pass is the reference
instead (``dlm.verify.llada2_moe.remote``); the generation algorithm around it is
the reference ``generate`` of torch_model either way (the hub 2.0
``generate`` cannot run greedily: it samples at temperature 0).

Commit streams: per prompt, a greedy run and a seeded sampled run whose draws
come from the shared uniform stream (``dlm.runtime.models.llada2_moe.sampling.UniformStream``),
so both frameworks draw the same samples; their blocks are concatenated.
torch is imported lazily (bundle comparisons run without it).
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dlm.runtime.platform.errors import ConfigError, DlmError, WeightError
from dlm.runtime.checkpoint import read_json

from ..protocol import CommitStream, LogitCase, TraceRecorder, torch_dtype

BLOCK_LENGTH = 32
SEEDED_RUN = {"name": "seeded", "temperature": 0.8, "top_p": 0.95, "seed": 1234}


def _args(config: dict):
    from dlm.runtime.models.llada2_moe import ModelArgs

    return ModelArgs.from_config(config)


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


@dataclass
class Reference:
    model: Any  # forward(input_ids, attention_mask=None | 4-D additive, position_ids=None) -> f32 logits
    config: dict
    generation_config: dict
    dtype: str
    path: Path
    notes: list[str] = field(default_factory=list)
    streamer: Any = None  # dlm.verify.streaming.LayerStreamer when layer-streamed


LAYERS = "model.layers"  # the layer stack, in dlm's reference and in the hub code alike


def _torch_module(ref: Reference):
    """The nn.Module behind the reference (the hub model inside a RemoteModel)."""
    from .remote import RemoteModel

    return ref.model.model if isinstance(ref.model, RemoteModel) else ref.model


def reference_layers(ref: Reference) -> dict:
    """``{stack: [layer modules]}`` whose outputs the per-layer diagnostic compares."""
    return {"layers": list(_torch_module(ref).get_submodule(LAYERS))}


def ships_modeling_code(path: Path, config: dict) -> bool:
    return bool(config.get("auto_map")) and any(Path(path).glob("modeling_*.py"))


def load_reference(path, *, dtype: str = "float32", weights: dict | None = None,
                   trust_remote_code: bool = False, stream: bool = False) -> Reference:
    """The PyTorch reference on CPU (see dlm.verify.protocol). ``stream``: the
    same model with its layers' weights streamed from disk
    (``dlm.verify.streaming``)."""
    import torch

    from . import torch_model as R

    path = Path(path)
    ref_dtype = torch_dtype(dtype)
    config = read_json(path / "config.json", "config")
    if config.get("model_type") != "llada2_moe":
        raise ConfigError(f"{path / 'config.json'}: model_type {config.get('model_type')!r} is not llada2_moe")
    gen_path = path / "generation_config.json"
    generation_config = read_json(gen_path, "generation config") if gen_path.exists() else {}
    notes: list[str] = []
    if weights is None and trust_remote_code and ships_modeling_code(path, config):
        from .remote import load_remote

        model = load_remote(path, ref_dtype, config, stream=stream)
        notes.append("forward pass: the checkpoint's own modeling code (--trust-remote-code)")
        ref = Reference(model, config, generation_config, dtype, path, notes)
        if stream:
            ref.streamer = _stream(model.model, path, None, ref_dtype, config, notes)
        return ref
    try:
        cfg = R.RefConfig.from_dict({k: v for k, v in config.items() if k not in ("quantization", "quantization_config")})
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"{path / 'config.json'}: cannot build the reference: {exc}") from None
    if stream:
        from .. import streaming as S

        with S.empty_parameters():
            model = R.LLaDA2Reference(cfg)
        model = model.to(ref_dtype).eval()
        if weights is not None:
            notes.append("weights: the MLX model's (dequantized)")
        ref = Reference(model, config, generation_config, dtype, path, notes)
        ref.streamer = _stream(model, path, weights, ref_dtype, config, notes)
        return ref
    if weights is None:
        try:
            model = R.load_reference(path, ref_dtype)
        except FileNotFoundError as exc:
            raise WeightError(str(exc)) from None
        except OSError as exc:
            raise WeightError(f"{path}: cannot read the checkpoint: {exc}") from None
        except R.Mismatch as exc:  # missing / unexpected / mis-shaped tensors
            raise WeightError(f"{path}: the checkpoint does not match its config: {exc}") from None
        except ValueError as exc:  # not valid safetensors
            raise WeightError(f"{path}: cannot read the checkpoint: {exc}") from None
    else:
        # No weight initialisation and no float32 copy first: every tensor is written below.
        model = R.empty_reference(cfg, ref_dtype)
        state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in weights.items()}
        if config.get("tie_word_embeddings") and "lm_head.weight" not in state:
            state["lm_head.weight"] = state["model.word_embeddings.weight"]
        own = model.state_dict()
        for name, value in state.items():
            if name not in own:
                raise WeightError(f"MLX tensor {name} has no counterpart in the PyTorch reference")
            if tuple(value.shape) != tuple(own[name].shape):
                raise WeightError(f"MLX tensor {name} has shape {list(value.shape)}; the reference "
                                  f"expects {list(own[name].shape)}")
        missing = sorted(set(own) - set(state))
        if missing:
            raise WeightError(f"the MLX model lacks tensor {missing[0]} (and {len(missing) - 1} more)")
        R.fill(model, state.items(), "the MLX model")
        del state
        notes.append("weights: the MLX model's (dequantized)")
    return Reference(model, config, generation_config, dtype, path, notes)


def _stream(module, path: Path, weights, ref_dtype, config: dict, notes: list[str]):
    """A LayerStreamer over the layers of ``module`` (dlm's reference or the hub
    model: the same names); a tied head reads the embedding."""
    from .. import streaming as S

    source = S.as_source(weights, path)
    if "lm_head.weight" not in source and config.get("tie_word_embeddings"):
        module.lm_head.weight = module.get_submodule("model.word_embeddings").weight
    notes.append("layer-streamed: each layer's weights read from disk for every forward pass")
    return S.LayerStreamer(module, source, ref_dtype, S.stacks_of(module, LAYERS), strict=weights is not None)


# ---------------------------------------------------------------------------
# Logit cases
# ---------------------------------------------------------------------------


def _block_length(generation_config: dict) -> int:
    return int((generation_config or {}).get("block_length") or BLOCK_LENGTH)


def filler(n: int, length: int, vocab: int, avoid: int) -> np.ndarray:
    """Deterministic stand-in tokens (never the mask id)."""
    i = np.arange(length, dtype=np.int64)
    x = ((i + 1) * 7919 + n * 104729) % vocab
    return np.where(x == avoid, (x + 1) % vocab, x)


def logit_cases(config: dict, prompts: list[list[int]], generation_config: dict) -> list[LogitCase]:
    """Per prompt: the first denoising step (prompt + masks to the end of the
    block holding the prompt's tail, block-causal), a later step (one more
    committed block of filler tokens, then an active block half revealed), and
    a plain bidirectional forward (the hub's ``model(input_ids)``)."""
    args = _args(config)
    bl, V, mask = _block_length(generation_config), args.vocab_size, args.mask_token_id
    cases = []
    for i, prompt in enumerate(prompts):
        P = len(prompt)
        end = (P // bl + 1) * bl
        first = np.concatenate([np.asarray(prompt, np.int64), np.full(end - P, mask, np.int64)])
        meta = {"kind": "block", "block_length": bl}
        cases.append(LogitCase(f"p{i}.first", list(prompt), {"window": first}, dict(meta)))
        committed = first.copy()
        committed[P:] = filler(1, end - P, V, mask)
        active = filler(2, bl, V, mask)
        active[::2] = mask
        nxt = np.concatenate([committed, filler(3, bl, V, mask), active])
        cases.append(LogitCase(f"p{i}.next", list(prompt), {"window": nxt}, dict(meta)))
        tail = min(bl, 16)
        if args.block_routing:  # LLaDA2.2 routes whole blocks of block_size tokens only
            tail += -(P + tail) % args.block_size
        plain = np.concatenate([np.asarray(prompt, np.int64), np.full(tail, mask, np.int64)])
        cases.append(LogitCase(f"p{i}.bidir", list(prompt), {"window": plain}, {"kind": "bidirectional"}))
    return cases


def reference_logits(ref: Reference, case: LogitCase, done: dict) -> np.ndarray:
    import torch

    from .torch_model import block_causal_mask

    ids = torch.from_numpy(np.asarray(case.arrays["window"], np.int64))[None]
    with torch.no_grad():
        if case.meta["kind"] == "bidirectional":
            return ref.model(ids)[0].float().numpy()
        bl = int(case.meta["block_length"])
        mask = block_causal_mask(ids.shape[1], bl, torch.float32)
        return ref.model(ids, mask)[0, -bl:].float().numpy()


def mlx_logits(loaded, case: LogitCase, collect: dict | None = None, feed: dict | None = None) -> np.ndarray:
    """The same forward on the MLX model, through the runtime's KV-cache path:
    earlier blocks prefilled, the last committed block fused with the active
    one (as the generation loop does). ``collect``: filled with ``{"layers":
    [per-layer float32 [positions, hidden]]}`` over the whole window; ``feed``:
    ``{"layers": dlm.verify.local.Feed}`` (the layer-local check)."""
    import mlx.core as mx

    from dlm.runtime.models.llada2_moe import block_causal_mask

    model = loaded.model
    window = np.asarray(case.arrays["window"], np.int32)
    outs = feed["layers"] if feed is not None else [] if collect is not None else None

    def done(logits):
        if collect is not None:
            from ..layers import per_layer

            collect["layers"] = per_layer(outs, len(model.layers))
        return np.array(logits[0])

    if case.meta["kind"] == "bidirectional":
        return done(model(mx.array(window)[None], collect=outs))
    bl = int(case.meta["block_length"])
    start = len(window) - bl
    cache = model.make_cache(len(window))
    prefix = max(start - bl, 0)
    if prefix:
        model(mx.array(window[:prefix])[None], cache, block_causal_mask(0, prefix, 0, bl), last=1, collect=outs)
        for c in cache:
            c.commit(prefix)
    rest = mx.array(window[prefix:])[None]
    return done(model(rest, cache, block_causal_mask(prefix, len(window) - prefix, prefix, bl), last=bl,
                      collect=outs))


def compute_dtype(loaded) -> str:
    return str(loaded.model.model.norm.weight.dtype).replace("mlx.core.", "")


# ---------------------------------------------------------------------------
# Commit streams
# ---------------------------------------------------------------------------


def stream_settings(config: dict, generation_config: dict, *, blocks: int = 2,
                    steps: int | None = None) -> dict:
    args = _args(config)
    gc = generation_config or {}
    bl = _block_length(gc)
    eos = gc.get("eos_token_id")
    eos = list(args.eos_token_ids) if eos is None else (eos if isinstance(eos, list) else [eos])
    steps = int(steps or gc.get("steps") or 32)
    if args.block_routing:
        return _levenshtein_settings(args, gc, bl, steps, blocks, eos)
    return dict(
        block_length=bl,
        steps=steps,
        threshold=float(gc.get("threshold") or 0.95),
        max_tokens=int(blocks) * bl,
        eos_token_id=[int(e) for e in eos],
        mask_token_id=int(gc.get("mask_token_id", args.mask_token_id)),
        runs=[{"name": "greedy", "temperature": 0.0, "top_p": None, "seed": None}, dict(SEEDED_RUN)],
        # The report's names for the budget and the step bound (per run).
        max_new_tokens=int(blocks) * bl,
        max_denoising_steps=steps,
    )


def _levenshtein_settings(args, gc: dict, bl: int, steps: int, blocks: int, eos: list) -> dict:
    """LLaDA2.2: Levenshtein decoding, greedy only (docs/llada2.md, "dlm's rules"), its defaults
    unless generation_config.json says otherwise."""
    from dlm.runtime.models.llada2_moe.options import (EDITING_THRESHOLD_22, MAX_POST_STEPS,
                                                       MAX_STEPS_PER_BLOCK, THRESHOLD_22)

    def get(key, default):
        return gc[key] if gc.get(key) is not None else default

    return dict(
        block_length=bl, steps=steps, threshold=float(get("threshold", THRESHOLD_22)),
        max_tokens=int(blocks) * bl, eos_token_id=[int(e) for e in eos],
        mask_token_id=int(get("mask_token_id", args.mask_token_id)),
        runs=[{"name": "greedy", "temperature": 0.0, "top_p": None, "seed": None}],
        max_new_tokens=int(blocks) * bl, max_denoising_steps=steps,
        levenshtein=True, editing_threshold=float(get("editing_threshold", EDITING_THRESHOLD_22)),
        max_post_steps=int(get("max_post_steps", MAX_POST_STEPS)),
        max_steps_per_block=int(get("max_steps_per_block", MAX_STEPS_PER_BLOCK)),
        delete_token_id=args.delete_token_id, split_token_id=args.split_token_id,
    )


def _levenshtein_kwargs(settings: dict) -> dict:
    """The reference generate()'s LLaDA2.2 arguments (none for 2.0/2.1)."""
    if not settings.get("levenshtein"):
        return {}
    return dict(levenshtein=True, editing_threshold=settings["editing_threshold"],
                max_post_steps=settings["max_post_steps"], max_steps_per_block=settings["max_steps_per_block"],
                delete_id=settings["delete_token_id"], split_id=settings["split_token_id"])


def _blocks_of(prompt_len: int, tokens: list[int], settings: dict, traced: list[int]) -> list[list[int]]:
    """Per traced block, the tokens it contributes to the output (cut at the
    first EOS, EOS excluded), from the reference's returned ids."""
    bl, eos = settings["block_length"], set(settings["eos_token_id"])
    out = []
    for b in traced:
        lo, hi = max(b * bl, prompt_len) - prompt_len, (b + 1) * bl - prompt_len
        part = tokens[lo:hi]
        cut = next((j for j, t in enumerate(part) if t in eos), None)
        out.append(part if cut is None else part[:cut])
        if cut is not None:
            break
    return out


def reference_commit_stream(ref: Reference, prompt_ids: list[int], settings: dict) -> CommitStream:
    import torch

    from dlm.runtime.models.llada2_moe.sampling import UniformStream

    from .torch_generate import generate

    def one(run):
        recorders: dict[int, TraceRecorder] = {}

        def on_step(b, s, logits):
            recorders.setdefault(b, TraceRecorder(prompt_ids)).step(logits.float().numpy())

        seed = run.get("seed")
        with torch.no_grad():
            out = generate(
                ref.model, torch.tensor(prompt_ids, dtype=torch.long),
                temperature=float(run["temperature"]), top_p=run.get("top_p"),
                block_length=settings["block_length"], steps=settings["steps"],
                gen_length=settings["max_tokens"], threshold=settings["threshold"],
                eos_id=settings["eos_token_id"], mask_id=settings["mask_token_id"],
                hub_sampler=False, uniforms=UniformStream(seed) if seed is not None else None,
                suppress_mask=True, early_stop=not settings.get("levenshtein"), on_step=on_step,
                **_levenshtein_kwargs(settings),
            ).tolist()
        return recorders, out

    jobs = [functools.partial(one, run) for run in settings["runs"]]
    # Layer-streamed: the runs (greedy, seeded) are independent passes that share each layer read.
    results = ref.streamer.lockstep(jobs) if ref.streamer is not None else [job() for job in jobs]
    stream = CommitStream(prompt_ids=list(prompt_ids), blocks=[])
    finish = []
    for run, (recorders, out) in zip(settings["runs"], results):
        traced = sorted(recorders)
        blocks = _blocks_of(len(prompt_ids), out, settings, traced)
        for b, tokens in zip(traced, blocks):
            recorders[b].commit(tokens)
            stream.blocks.append(recorders[b].stream.blocks[-1])
        hit = any(t in set(settings["eos_token_id"]) for t in out)
        finish.append(f"{run['name']}:{'stop' if hit else 'length'}")
    stream.finish_reason = ",".join(finish)
    return stream


def mlx_commit_stream(loaded, prompt_ids: list[int], settings: dict) -> CommitStream:
    """The runtime's own loop (``dlm.runtime.api.stream_generate``) per run."""
    import mlx.core as mx

    from dlm.runtime import api

    stream = CommitStream(prompt_ids=list(prompt_ids), blocks=[])
    finish = []
    for run in settings["runs"]:
        recorders: dict[int, TraceRecorder] = {}

        def on_step(b, s, logits):
            recorders.setdefault(b, TraceRecorder(prompt_ids)).step(np.array(logits.astype(mx.float32)))

        options = {
            "max_tokens": settings["max_tokens"], "block_length": settings["block_length"],
            "max_denoising_steps": settings["steps"], "threshold": settings["threshold"],
            "temp": float(run["temperature"]), "top_p": run.get("top_p"), "seed": run.get("seed"),
        }
        if settings.get("levenshtein"):
            options.update(max_post_steps=settings["max_post_steps"],
                           max_steps_per_block=settings["max_steps_per_block"])
        committed, reason = [], None
        for event in api.stream_generate(loaded, prompt_ids, options, on_step=on_step,
                                         stop_ids=settings["eos_token_id"], stop_on_role_end=False,
                                         editing_threshold=settings.get("editing_threshold")):
            if event.done:
                reason = event.finish_reason
            else:
                committed.append(list(event.token_ids))
        traced = sorted(recorders)
        if len(traced) != len(committed):
            raise DlmError(f"{len(committed)} committed blocks but {len(traced)} traced blocks")
        for b, tokens in zip(traced, committed):
            recorders[b].commit(tokens)
            stream.blocks.append(recorders[b].stream.blocks[-1])
        finish.append(f"{run['name']}:{reason}")
    stream.finish_reason = ",".join(finish)
    return stream
