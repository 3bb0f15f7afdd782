"""DiffusionGemma's side of ``dlm.verify.routes``: record the MLX model's routed
experts, and make transformers' reference route the same way.

MLX: ``model.encode`` / ``model.decode`` are wrapped on the instance (every
prefill, committed canvas and denoising step of the runtime's own loops goes
through them) and each layer's top-k ids are collected with the runtime's
``record_routes``. Reference: forward pre-hooks on the encoder and the decoder
key the rows of the call, and a forward hook on every ``DiffusionGemmaTextRouter``
returns MLX's experts with the router's own weights for them: its float32
probabilities at those experts, renormalised, times ``per_expert_scale``, as
its forward computes them for its own choice.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from .. import routes as R
from .loading import reference_layers


def _put(log: R.RouteLog, stack: str, record: list, keys: list) -> None:
    for layer, idx in enumerate(record):
        if idx is not None:
            log.put(stack, layer, keys, np.array(idx))


@contextlib.contextmanager
def record_mlx_routes(loaded, log: R.RouteLog):
    """Record every routing of ``loaded``'s model into ``log`` meanwhile."""
    from dlm.runtime.models.diffusion_gemma.layers import record_routes as layer_routes

    model = loaded.model
    real_encode, real_decode = model.encode, model.decode

    def encode(ids, cache, offset=None, features=None, blocks=None, collect=None, compiled=False):
        tokens = np.array(ids).reshape(-1).tolist()
        keyed = features is None and (blocks is None or not (np.asarray(blocks) >= 0).any())
        keys = R.encoder_keys(cache[0], tokens, keyed)
        with layer_routes() as record:
            real_encode(ids, cache, offset, features, blocks, collect, compiled)
        _put(log, "encoder", record, keys)

    def decode(canvas, cache, sc_logits=None, offset=None, collect=None, sc_probs=None):
        keys = R.decoder_keys(cache[0], np.array(canvas).reshape(-1).tolist())
        with layer_routes() as record:
            out = real_decode(canvas, cache, sc_logits, offset, collect, sc_probs)
        _put(log, "decoder", record, keys)
        return out

    object.__setattr__(model, "encode", encode)
    object.__setattr__(model, "decode", decode)
    try:
        yield log
    finally:
        object.__delattr__(model, "encode")
        object.__delattr__(model, "decode")


@contextlib.contextmanager
def force_reference_routes(ref, log: R.RouteLog, forced: R.Forced):
    """Make ``ref`` route as ``log`` recorded meanwhile; ``forced`` counts what changed."""
    import torch

    model = ref.model
    state = threading.local()  # the keys of the call this thread is in
    hooks = []

    def on_encoder(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None:  # embeddings only: nothing to key
            state.current = None
            return None
        keyed = all(kwargs.get(k) is None for k in ("pixel_values", "mm_encoder_outputs", "inputs_embeds"))
        state.current = ("encoder", R.encoder_keys(kwargs.get("cache"), ids[0].tolist(), keyed))
        return None

    def on_decoder(module, args, kwargs):
        ids = kwargs.get("decoder_input_ids", args[0] if args else None)
        state.current = ("decoder", R.decoder_keys(kwargs.get("cache"), ids[0].tolist()))
        return None

    hooks.append(model.model.encoder.register_forward_pre_hook(on_encoder, with_kwargs=True))
    hooks.append(model.model.decoder.register_forward_pre_hook(on_decoder, with_kwargs=True))
    stacks = reference_layers(ref)
    last_encoder = len(stacks["encoder"]) - 1  # its output is never read (the decoder reads its cache)
    for stack, layers in stacks.items():
        for i, layer in enumerate(layers):
            if stack == "encoder" and i == last_encoder:
                continue

            def on_router(module, args, output, stack=stack, i=i):
                current = getattr(state, "current", None)
                probs, weights, idx = output
                if current is None or current[0] != stack or len(current[1]) != probs.shape[0]:
                    forced.add(stack, i, probs.detach().float().numpy(), [None] * probs.shape[0])
                    return None
                ids = forced.add(stack, i, probs.detach().float().numpy(), log.get(stack, i, current[1]))
                if ids is None:
                    return None
                chosen = torch.from_numpy(ids).to(idx.dtype)
                w = probs.gather(-1, chosen)
                w = w / w.sum(dim=-1, keepdim=True)
                return probs, (w * module.per_expert_scale[chosen]).to(weights.dtype), chosen

            hooks.append(layer.router.register_forward_hook(on_router))
    try:
        yield forced
    finally:
        for h in hooks:
            h.remove()
