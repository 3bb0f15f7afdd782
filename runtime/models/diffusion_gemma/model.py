"""The DiffusionGemma MLX model: encoder (causal prefill into a prefix cache)
and decoder (bidirectional canvas denoiser reading that cache, with
self-conditioning). Parameter names equal the converted tensor names, so a
converted directory loads with ``Model.load_weights`` as it is.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cpu import vocab as cpu_vocab
from ...generation.options import PREFILL_STEP_SIZE
from ..base import compile_enabled
from ..cpu.streams import VOCAB_MIN_PIECE_BYTES, split_positions
from ..cpu.dequant import per_call, splits, wants
from ..rows import as_linear, embedding_matmul, matmul
from ..taps import layer_input
from .config import SLIDING, ModelArgs
from .scores import PIECE_BYTES
from .layers import DecoderLayer, PrefixCache, RMSNorm, SelfConditioning
from .vision import MultimodalEmbedder, VisionArgs, VisionModel

def _is_quantized(module: nn.Module) -> bool:
    return "scales" in module


class DecoderModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_conditioning = SelfConditioning(args)
        self.hidden = args.hidden_size
        self.softcap = args.final_logit_softcapping
        self._compiled = None
        self.vocab_shard = None  # a sharded run: the vocabulary rows this rank holds (parallel.VocabShard)

    @property
    def dtype(self) -> mx.Dtype:
        """Activation dtype: the embedding's float dtype (the norm's when the
        embedding scales are not a float type, e.g. mxfp4)."""
        e = self.embed_tokens
        if not _is_quantized(e):
            return e["weight"].dtype
        if mx.issubdtype(e["scales"].dtype, mx.floating):
            return e["scales"].dtype
        return self.norm["weight"].dtype

    def _scale(self, dtype) -> mx.array:
        # sqrt(H) as float32, then cast to the weight dtype (bf16: 53.0, pitfall 15).
        return mx.array(np.float32(math.sqrt(self.hidden))).astype(dtype)

    def scaled(self, x: mx.array) -> mx.array:
        """Embeddings (looked up or soft) cast to the activation dtype, * sqrt(H)."""
        dtype = self.dtype
        return x.astype(dtype) * self._scale(dtype)

    def embed(self, ids: mx.array) -> mx.array:
        if self.vocab_shard is not None:
            return self.vocab_shard.embed(self, ids)
        return self.scaled(self.embed_tokens(ids))

    def soft_embed(self, sc_logits: mx.array) -> mx.array:
        """softmax_f32(sc_logits) cast to the embedding dtype, @ W_E, * sqrt(H)."""
        return self.embed_probs(mx.softmax(sc_logits.astype(mx.float32), axis=-1))

    def embed_probs(self, probs: mx.array) -> mx.array:
        """soft_embed from the softmax already taken (the denoising step's: canvas.py)."""
        if self.vocab_shard is not None:
            return self.vocab_shard.embed_probs(self, probs)
        return self.scaled(self.probs_product(probs))

    def probs_product(self, probs: mx.array) -> mx.array:
        """probs (cast to the activation dtype) @ W_E, unscaled, over the rows this module holds."""
        p = probs.astype(self.dtype)
        e = self.embed_tokens
        if wants(e, p):  # dequantized per vocabulary slice (CPU backend)
            s = embedding_matmul(e, p)
        elif _is_quantized(e):
            def qmm(rows):
                return mx.quantized_matmul(rows, e["weight"], e["scales"], e.get("biases"), transpose=False,
                                           group_size=e.group_size, bits=e.bits, mode=e.mode)

            s = split_positions(qmm, p) if self.split_vocab else qmm(p)
        else:
            s = matmul(p, e["weight"])  # one GEMM per sequence of a batch
        return s

    def inputs(self, canvas: mx.array, sc_logits: Optional[mx.array] = None) -> mx.array:
        """Decoder input: self-conditioning block over the scaled canvas embeddings."""
        if self.vocab_shard is not None and sc_logits is not None:  # one all_sum for both embeddings
            return self.inputs_probs(canvas, mx.softmax(sc_logits.astype(mx.float32), axis=-1))
        soft = None if sc_logits is None else self.soft_embed(sc_logits)
        return self.self_conditioning(self.embed(canvas), soft)

    def inputs_probs(self, canvas: mx.array, sc_probs: mx.array) -> mx.array:
        """``inputs`` from the self-conditioning softmax itself (sc_probs)."""
        if self.vocab_shard is not None:
            return self.vocab_shard.inputs_probs(self, canvas, sc_probs)
        return self.self_conditioning(self.embed(canvas), self.embed_probs(sc_probs))

    def project(self, h: mx.array) -> mx.array:
        """Tied-embedding logits in the model dtype (before the softcap)."""
        if self.vocab_shard is not None:
            return self.vocab_shard.project(self, h)
        return self.local_logits(h)

    def local_logits(self, h: mx.array) -> mx.array:
        """``project`` over the vocabulary rows this module holds."""
        x = self.norm(h)
        if self.split_vocab:
            return split_positions(lambda rows: self.embed_tokens.as_linear(rows), x)
        return as_linear(self.embed_tokens, x)

    def head(self, h: mx.array) -> mx.array:
        """Tied-embedding logits in the model dtype, then float32 softcap."""
        return softcap(self.project(h), self.softcap)

    @property
    def split_vocab(self) -> bool:
        """A quantized embedding on the CPU backend: the two full-vocabulary
        matmuls (head, self-conditioning) run eagerly with their rows split over
        the CPU streams (dlm.runtime.models.cpu.streams)."""
        return splits(self.embed_tokens)

    def compiled(self) -> "Ends":
        if self._compiled is None:  # implicit inputs: only what these read (not the layers)
            ends = Ends(self.inputs, self.inputs_probs, self.head)
            # Else eager: a vocabulary slice at a time, or (sharded) the vocabulary's
            # collectives between the ops, each issued and counted once per call.
            if not (self.split_vocab or per_call(self.embed_tokens) or self.vocab_shard is not None):
                state = [self.embed_tokens.state, self.norm.state, self.self_conditioning.state]
                inputs, inputs_probs, project = (mx.compile(fn, inputs=state)
                                                 for fn in (self.inputs, self.inputs_probs, self.project))
                ends = Ends(inputs, inputs_probs, lambda h: softcap(project(h), self.softcap))
            object.__setattr__(self, "_compiled", ends)
        return self._compiled

    def ends(self, compile: bool) -> "Ends":
        """The decoder's input and output ends, compiled or not."""
        return self.compiled() if compile else Ends(self.inputs, self.inputs_probs, self.head)


class Ends(NamedTuple):
    inputs: Callable  # (canvas, sc_logits=None) -> h
    inputs_probs: Callable  # (canvas, sc_probs) -> h
    head: Callable  # h -> float32 softcapped logits


@mx.compile
def _softcap_rows(x: mx.array, cap: mx.array) -> mx.array:
    return mx.tanh(x.astype(mx.float32) / cap) * cap


def softcap(logits: mx.array, cap: float) -> mx.array:
    """float32 ``tanh(logits / cap) * cap``: a tanh per vocabulary entry, its rows
    split over the CPU streams (MLX's CPU tanh: 10-18 ns an entry on one thread,
    0.7-1.2 s per step at the released geometry; about half that on two)."""
    if cpu_vocab.wanted(logits):  # the CPU backend at scale: numpy's vector tanh (cpu/vocab.py)
        return cpu_vocab.softcap(logits, cap)
    c = mx.array(cap, dtype=mx.float32)
    return split_positions(lambda rows: _softcap_rows(rows, c), logits, piece_bytes=PIECE_BYTES,
                           min_piece_bytes=VOCAB_MIN_PIECE_BYTES)


class EncoderLayerScalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_scalar = mx.ones((1,))


class EncoderTextModel(nn.Module):
    """The encoder shares every text weight with the decoder except layer_scalar."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.layers = [EncoderLayerScalar() for _ in range(args.num_hidden_layers)]


class EncoderModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.language_model = EncoderTextModel(args)
        if not args.text_only:
            vision = VisionArgs.from_config(args.vision_config)
            self.vision_tower = VisionModel(vision)
            self.embed_vision = MultimodalEmbedder(vision.hidden_size, args.hidden_size, vision.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.decoder = DecoderModel(args)
        self.encoder = EncoderModel(args)


def chunks(length: int, size: int, blocks: Optional[np.ndarray] = None):
    """(start, end) prefill chunks of at most ``size`` positions, except that a
    chunk never ends inside an image block: it ends before the block, or after
    it when the block starts the chunk (a block longer than ``size``)."""
    start = 0
    while start < length:
        end = min(start + size, length)
        if blocks is not None and end < length and blocks[end] >= 0 and blocks[end - 1] == blocks[end]:
            block, first = blocks[end], end
            while first > start and blocks[first - 1] == block:
                first -= 1
            if first > start:
                end = first
            else:
                while end < length and blocks[end] == block:
                    end += 1
        yield start, end
        start = end


def image_blocks(ids: list[int], image_token_id: int) -> np.ndarray:
    """Per position: the index of its image block (maximal run of image
    tokens), -1 for text."""
    image = np.asarray(ids) == image_token_id
    starts = image & ~np.concatenate([[False], image[:-1]])
    return np.where(image, np.cumsum(starts) - 1, -1)


class Model(nn.Module):
    """DiffusionGemma text model (batch size 1 in the generation loop; B > 1 works here).

    Methods used by the generation loop and the parity suite:

    * ``make_cache() -> list[PrefixCache]``: one empty prefix cache per layer.
    * ``encode(ids, cache, offset=None) -> None``: causal encoder pass of ``ids``
      ([B, S] or [S] int) at positions ``offset..offset+S-1`` (default: the cache's
      offset), appending post-norm post-RoPE K and normed V to ``cache``. Used for the
      prompt and for re-encoding each committed canvas at its own positions. Lazy.
    * ``prefill(ids, cache, chunk_size) -> None``: ``encode`` in chunks (--prefill-step-size), each evaluated.
    * ``decode(canvas, cache, sc_logits=None, offset=None, sc_probs=None) -> mx.array``:
      one denoiser pass over ``canvas`` ([B, L] or [L]) at positions
      ``offset..offset+L-1`` reading ``cache`` read-only; ``sc_logits`` ([B, L, V],
      the previous step's processed logits, or None on the first step of a canvas)
      drives self-conditioning, or ``sc_probs``, their softmax_f32 already taken
      (the generation loop's, canvas.py). Returns float32 softcapped logits [B, L, V].
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        # Fuse each decoder layer's fixed-shape parts with mx.compile (DLM_COMPILE=0: off).
        self.compile = compile_enabled()

    @property
    def layers(self):
        return self.model.decoder.layers

    @property
    def dtype(self) -> mx.Dtype:
        return self.model.decoder.dtype

    def product_rows(self) -> dict:
        """Rows per product of a denoising forward (the CPU weight layout, layout.py):
        a canvas's positions, and its token copies per routed expert."""
        a = self.args
        return {"linear": a.canvas_length, "experts": a.canvas_length * a.top_k_experts / a.num_experts}

    def make_cache(self) -> list[PrefixCache]:
        keep = self.args.sliding_window - 1
        return [PrefixCache(keep if t == SLIDING else None) for t in self.args.layer_types]

    @staticmethod
    def _ids(ids) -> mx.array:
        ids = ids if isinstance(ids, mx.array) else mx.array(ids)
        ids = ids.astype(mx.int32) if ids.dtype != mx.int32 else ids
        return ids[None] if ids.ndim == 1 else ids

    def eager_experts(self) -> bool:
        """CPU experts that run outside the graph (some read their routing on the host)."""
        return any(layer.experts.eager for layer in self.layers)

    def speculates(self, positions: int, eager: Optional[bool] = None) -> bool:
        """Whether a step over canvases of up to ``positions`` positions (a
        batch's longest) builds as a lazy graph, so the loop may build the next step while this
        one runs: not when CPU experts read their routing on the host, nor when
        the softcap and scores go through numpy (cpu/vocab.py). Otherwise
        building the next step would compute it, wasted if the canvas stops.
        ``eager``: ``eager_experts()`` when the caller keeps it (a batch's steps)."""
        if self.eager_experts() if eager is None else eager:
            return False
        return not cpu_vocab.takes(positions * self.args.vocab_size)

    @property
    def has_vision(self) -> bool:
        return "vision_tower" in self.model.encoder

    def encode_image(self, pixel_values: np.ndarray, position_ids: np.ndarray) -> mx.array:
        """One preprocessed image (processor output, padded) -> its soft tokens
        [n, hidden] in the text embedding space (lazy)."""
        real = (position_ids >= 0).all(axis=-1)
        enc = self.model.encoder
        pixels = mx.array(np.ascontiguousarray(pixel_values[real], dtype=np.float32))
        return enc.embed_vision(enc.vision_tower(pixels, position_ids[real]))

    def encode(self, ids, cache: list[PrefixCache], offset: Optional[int] = None,
               features: Optional[mx.array] = None, blocks: Optional[np.ndarray] = None,
               collect: Optional[list] = None, compiled: bool = False) -> None:
        """``features`` [n, hidden] replace the embeddings where ``blocks`` >= 0
        (in order); ``blocks`` ([S] ints, -1 for text) also makes each image
        block bidirectional in every layer (as transformers' DiffusionGemma ``generate``
        masks them, ``get_block_sequence_ids_for_mask``). ``collect``: a
        list that gets each layer's output (None for the last layer, which
        only writes the cache), for dlm-verify's per-layer diagnostic.
        ``compiled``: the layers' fixed-shape parts run fused, as the decoder's
        (``self.compile`` permitting): for the re-encoding of each committed
        canvas, whose few shapes repeat (uncompiled, a tiny model's 8-position
        re-encode cost more than a decoder step); not for prompt chunks, whose
        every new length would trace anew."""
        ids = self._ids(ids)
        offset = cache[0].offset if offset is None else offset
        compiled = compiled and self.compile and collect is None and blocks is None
        dec = self.model.decoder
        scalars = self.model.encoder.language_model.layers
        h = dec.embed(ids)
        block_ids = None
        if blocks is not None and (blocks >= 0).any():
            image = blocks >= 0
            rows = np.cumsum(image) - 1  # the feature row of each image position
            source = mx.array(np.where(image, rows, 0).astype(np.int32))
            h = mx.where(mx.array(image)[None, :, None], features.astype(h.dtype)[source][None], h)
            block_ids = mx.array(blocks.astype(np.int32))
        last = len(dec.layers) - 1
        at = mx.array(offset, dtype=mx.int32) if compiled else offset
        for i, layer in enumerate(dec.layers):
            h = layer(layer_input(collect, h), cache[i], at, True, scalars[i]["layer_scalar"],
                      attention_only=i == last, blocks=block_ids, compiled=compiled)
            if collect is not None:
                collect.append(h)

    def prefill(self, ids, cache: list[PrefixCache], chunk_size: int = PREFILL_STEP_SIZE.default,
                features: Optional[mx.array] = None, blocks: Optional[np.ndarray] = None,
                collect: Optional[list] = None, on_chunk: Optional[Callable[[int, int], None]] = None) -> None:
        """``encode`` in chunks, each evaluated (then ``on_chunk(start, end)``). With
        images (``features``, ``blocks`` as in encode), no chunk boundary splits an image block."""
        ids = self._ids(ids)
        for start, end in chunks(ids.shape[1], chunk_size, blocks):
            if blocks is None:
                self.encode(ids[:, start:end], cache, collect=collect)
            else:
                done = int((blocks[:start] >= 0).sum())
                n = int((blocks[start:end] >= 0).sum())
                self.encode(ids[:, start:end], cache, None, features[done : done + n] if n else None,
                            blocks[start:end], collect=collect)
            mx.eval([c.state for c in cache])
            if on_chunk is not None:
                on_chunk(start, end)

    def decode(
        self, canvas, cache: list[PrefixCache], sc_logits: Optional[mx.array] = None,
        offset: Optional[int] = None, collect: Optional[list] = None, sc_probs: Optional[mx.array] = None,
    ) -> mx.array:
        canvas = self._ids(canvas)
        offset = cache[0].offset if offset is None else offset
        dec = self.model.decoder
        ends = dec.ends(self.compile)
        if sc_probs is not None:
            h = ends.inputs_probs(canvas, sc_probs if sc_probs.ndim == 3 else sc_probs[None])
        elif sc_logits is not None:
            h = ends.inputs(canvas, sc_logits if sc_logits.ndim == 3 else sc_logits[None])
        else:
            h = ends.inputs(canvas)
        if self.compile:
            offset = mx.array(offset, dtype=mx.int32)
        head = ends.head
        for i, layer in enumerate(dec.layers):
            h = layer(layer_input(collect, h), cache[i], offset, False, compiled=self.compile)
            if collect is not None:
                collect.append(h)
        return head(h)
