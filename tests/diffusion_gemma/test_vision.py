"""DiffusionGemma images against transformers: the image processor, the vision
tower + embed_vision, logits of prompts with images (bidirectional image
blocks, chunked prefill) and the debug-canvas commit stream with images."""

from __future__ import annotations

import numpy as np
import pytest

from dlm.runtime import api
from dlm.runtime.platform.errors import GenerationError
from dlm.runtime.generation.inputs import PromptInputs
from dlm.runtime.models.diffusion_gemma.model import chunks, image_blocks
from tests.builders import DG_GENERATION

IMAGE_ID, BOI_ID, EOI_ID = 500, 501, 502


def picture(width: int, height: int, seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def loaded(tiny_dg_vision_mlx_dir):
    return api.load(tiny_dg_vision_mlx_dir)


def torch_images(inputs: PromptInputs):
    import torch

    pv = torch.tensor(np.stack([i.pixel_values for i in inputs.images]))
    pi = torch.tensor(np.stack([i.position_ids for i in inputs.images])).long()
    return pv, pi


def reference_logits(ref, inputs: PromptInputs, canvas: np.ndarray) -> np.ndarray:
    """transformers: prefill with pixel_values and the generate() masks, then one decoder pass."""
    import torch
    from transformers import DynamicCache

    ids, L = torch.tensor([inputs.ids]), len(canvas)
    n = ids.shape[1]
    mm = (ids == IMAGE_ID).long()
    pv, pi = torch_images(inputs)
    with torch.no_grad():
        cache = DynamicCache(config=ref.config.get_text_config(decoder=True))
        pos = torch.arange(n, dtype=torch.int32)[None]
        ids, masks = ref._prepare_encoder_inputs(
            input_ids=ids, attention_mask=torch.ones((1, n), dtype=torch.bool), encoder_position_ids=pos,
            cache=cache, is_prefill=True, canvas_length=L, batch_size=1, mm_token_type_ids=mm)
        ref.model.encoder(input_ids=ids, attention_mask=masks, cache=cache, position_ids=pos, pixel_values=pv,
                          image_position_ids=pi, mm_token_type_ids=mm)
        c = torch.from_numpy(canvas)[None]
        dmask = ref.model.decoder.create_diffusion_decoder_attention_mask(
            config=ref.config, inputs_embeds=c.unsqueeze(-1), cache=cache,
            decoder_attention_mask=torch.ones((1, n + L), dtype=torch.bool))
        out = ref(decoder_input_ids=c, decoder_attention_mask=dmask, cache=cache,
                  decoder_position_ids=torch.arange(n, n + L, dtype=torch.int32)[None])
    return out.logits[0].float().numpy()


def mlx_logits(loaded, inputs: PromptInputs, canvas: np.ndarray, chunk: int) -> np.ndarray:
    import mlx.core as mx

    model = loaded.model
    cache = model.make_cache()
    features = mx.concatenate([model.encode_image(i.pixel_values, i.position_ids) for i in inputs.images])
    model.prefill(inputs.ids, cache, chunk, features, image_blocks(inputs.ids, IMAGE_ID))
    return np.array(model.decode(mx.array(canvas.astype(np.int32)), cache, offset=len(inputs.ids))[0])


SIZES = [(1, 1), (3, 5), (40, 30), (64, 64), (7, 300), (300, 7), (1000, 3), (97, 61)]


def test_processor_matches_transformers(loaded, tiny_dg_vision_dir):
    """Pixels, positions and soft-token counts equal transformers' own processor
    (AutoImageProcessor on the checkpoint's processor files), tiny and very wide images included."""
    from transformers import AutoImageProcessor

    theirs = AutoImageProcessor.from_pretrained(str(tiny_dg_vision_dir))
    ours = api.image_processor(loaded)
    for i, (w, h) in enumerate(SIZES):
        image = picture(w, h, seed=i)
        [got] = ours.preprocess([image])
        want = theirs(images=[image], return_tensors="np")
        assert np.array_equal(got.pixel_values, want["pixel_values"][0]), (w, h)
        assert np.array_equal(got.position_ids, want["image_position_ids"][0]), (w, h)
        assert got.soft_tokens == int(want["num_soft_tokens_per_image"][0]), (w, h)
        assert got.size == (w, h)


def test_release_geometry_soft_tokens():
    """The released processor (patch 16, pooling 3, 280 soft tokens): the soft-token counts of
    transformers' ``Gemma4ImageProcessor`` (``image_processing_gemma4.py``)."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from dlm.runtime.models.diffusion_gemma.images import ImageProcessor

    proc = ImageProcessor(Gemma4ImageProcessorPil(), "<|image|>", "<|image>", "<image|>", "release")
    counts = [i.soft_tokens for i in proc.preprocess([picture(896, 896), picture(1920, 1080), picture(224, 224)])]
    assert counts == [256, 264, 256]


def test_vision_features_match_transformers(loaded, tiny_dg_vision_torch):
    import torch

    for i, (w, h) in enumerate(SIZES):
        inputs = PromptInputs([], api.image_processor(loaded).preprocess([picture(w, h, seed=10 + i)]))
        pv, pi = torch_images(inputs)
        with torch.no_grad():
            want = tiny_dg_vision_torch.model.encoder.get_image_features(pv, pi, return_dict=True).pooler_output
        got = np.array(loaded.model.encode_image(inputs.images[0].pixel_values, inputs.images[0].position_ids))
        assert got.shape == (inputs.images[0].soft_tokens, want.shape[-1])
        assert np.abs(got - want.numpy().reshape(got.shape)).max() < 1e-4, (w, h)


def test_prompt_layout(loaded):
    """Each image becomes boi + n x image + eoi where the chat template puts it."""
    inputs = api.encode_inputs(loaded, "what?", images=[picture(40, 30), picture(9, 200)])
    ids = inputs.ids
    n1, n2 = (i.soft_tokens for i in inputs.images)
    first = ids.index(BOI_ID)
    assert ids[first : first + n1 + 2] == [BOI_ID] + [IMAGE_ID] * n1 + [EOI_ID]
    second = ids.index(BOI_ID, first + 1)
    assert second == first + n1 + 2
    assert ids[second : second + n2 + 2] == [BOI_ID] + [IMAGE_ID] * n2 + [EOI_ID]
    assert ids.count(IMAGE_ID) == inputs.image_tokens == n1 + n2
    assert loaded.tokenizer.decode(ids[second + n2 + 2 :]).startswith("what?")


@pytest.mark.parametrize("chunk", [2048, 7, 40])
def test_logits_with_images_match_transformers(loaded, tiny_dg_vision_torch, chunk):
    """Two images (blocks of 63 and 39 tokens, wider than the sliding window of 16):
    every prefill chunking gives transformers' generate() logits (chunk 7 must grow
    to hold whole blocks)."""
    inputs = api.encode_inputs(loaded, "describe both", images=[picture(40, 30, 1), picture(9, 200, 2)])
    canvas = np.arange(8, dtype=np.int64)
    want = reference_logits(tiny_dg_vision_torch, inputs, canvas)
    got = mlx_logits(loaded, inputs, canvas, chunk)
    assert np.abs(got - want).max() < 1e-4


def test_image_blocks_are_bidirectional(loaded, tiny_dg_vision_torch):
    """The check above can fail: a purely causal prefill (no block overlay) is far off."""
    import mlx.core as mx

    inputs = api.encode_inputs(loaded, "x", images=[picture(40, 30, 1)])
    canvas = np.arange(8, dtype=np.int64)
    want = reference_logits(tiny_dg_vision_torch, inputs, canvas)
    model = loaded.model
    cache = model.make_cache()
    features = model.encode_image(inputs.images[0].pixel_values, inputs.images[0].position_ids)
    blocks = image_blocks(inputs.ids, IMAGE_ID)
    model.encode(inputs.ids, cache, features=features, blocks=blocks)  # the overlay on: matches
    on = np.array(model.decode(mx.array(canvas.astype(np.int32)), cache, offset=len(inputs.ids))[0])
    assert np.abs(on - want).max() < 1e-4
    cache = model.make_cache()
    h_blocks = np.where(blocks >= 0, np.arange(len(blocks)), -1)  # one block per token: causal only
    model.encode(inputs.ids, cache, features=features, blocks=h_blocks)
    off = np.array(model.decode(mx.array(canvas.astype(np.int32)), cache, offset=len(inputs.ids))[0])
    assert np.abs(off - want).max() > 1e-2


def reference_stream(ref, inputs: PromptInputs, max_new: int) -> list[int]:
    import torch
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    from dlm.verify.diffusion_gemma.adapter import _CanvasStreamer, debug_canvas_rng

    g = DG_GENERATION
    gen = DiffusionGemmaGenerationConfig(
        max_new_tokens=max_new, max_denoising_steps=g["max_denoising_steps"], sampler_config=dict(g["sampler_config"]),
        t_min=g["t_min"], t_max=g["t_max"], stability_threshold=g["stability_threshold"],
        confidence_threshold=g["confidence_threshold"], eos_token_id=g["eos_token_id"], pad_token_id=0)
    ids = torch.tensor([inputs.ids])
    pv, pi = torch_images(inputs)
    streamer = _CanvasStreamer()
    with torch.no_grad(), debug_canvas_rng(512, 8):
        ref.generate(ids, generation_config=gen, streamer=streamer, pixel_values=pv, image_position_ids=pi,
                     mm_token_type_ids=(ids == IMAGE_ID).long())
    out = [t for canvas in streamer.puts[1:] for t in canvas]
    for j, t in enumerate(out):  # dlm stops before the first EOS
        if t in g["eos_token_id"]:
            return out[:j]
    return out


@pytest.mark.parametrize("sizes", [[(40, 30)], [(40, 30), (9, 200)]])
def test_debug_canvas_stream_matches_transformers(loaded, tiny_dg_vision_torch, sizes):
    inputs = api.encode_inputs(loaded, "tell me", images=[picture(w, h, 5 + i) for i, (w, h) in enumerate(sizes)])
    result = api.generate(loaded, inputs, {"max_tokens": 16, "debug_canvas": True, "diffusion_full_canvas": True,
                                           "prefill_step_size": 16})
    assert result.token_ids == reference_stream(tiny_dg_vision_torch, inputs, 16)
    assert result.stats.image_tokens == inputs.image_tokens
    assert result.stats.prompt_tokens == len(inputs.ids)
    assert result.stats.vision_seconds > 0


def test_images_in_several_turns(loaded, tiny_dg_vision_torch):
    """Images in any user turn: each part takes the next image, in order."""
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "one"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "and"}, {"type": "image"}]},
    ]
    inputs = api.encode_inputs(loaded, messages=messages, images=[picture(40, 30, 7), picture(30, 40, 8)])
    inline = [dict(m, content=[dict(p, image=picture(40, 30, 7)) if p["type"] == "image" else p
                               for p in m["content"]]) if m is messages[0] else m for m in messages]
    again = api.encode_inputs(loaded, messages=inline, images=[picture(30, 40, 8)])
    assert again.ids == inputs.ids
    assert all(np.array_equal(a.pixel_values, b.pixel_values) for a, b in zip(again.images, inputs.images))
    text = loaded.tokenizer.decode(inputs.ids)
    assert text.index("one") < text.index("ok") < text.index("and")
    first = inputs.ids.index(BOI_ID)
    second = inputs.ids.index(BOI_ID, first + 1)
    assert loaded.tokenizer.decode(inputs.ids[first:second]).count("ok") == 1
    canvas = np.arange(8, dtype=np.int64)
    assert np.abs(mlx_logits(loaded, inputs, canvas, 2048) - reference_logits(tiny_dg_vision_torch, inputs, canvas)).max() < 1e-4


def test_chunks_never_split_an_image_block():
    ids = [7] * 5 + [IMAGE_ID] * 9 + [7] * 3 + [IMAGE_ID] * 4 + [7] * 2
    blocks = image_blocks(ids, IMAGE_ID)
    assert list(np.unique(blocks)) == [-1, 0, 1]
    for size in range(1, 30):
        spans = list(chunks(len(ids), size, blocks))
        assert spans[0][0] == 0 and spans[-1][1] == len(ids)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        for start, end in spans:
            for b in (0, 1):
                inside = np.flatnonzero(blocks[start:end] == b)
                assert len(inside) in (0, int((blocks == b).sum())), (size, start, end)


def test_image_errors(loaded, tiny_dg_mlx_dir, tiny_dg_dir, tmp_path, tiny_llada2_mlx_dir):
    from tests.builders import convert_dir

    with pytest.raises(GenerationError, match=r"1 of the 2 image\(s\) given have no image part"):
        api.encode_inputs(loaded, messages=[{"role": "user", "content": [{"type": "image"}]}],
                          images=[picture(8, 8), picture(8, 8)])
    with pytest.raises(GenerationError, match=r"messages\[0\].content\[1\]: an image part without an image"):
        api.encode_inputs(loaded, messages=[{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}],
                          images=[picture(8, 8)])
    with pytest.raises(GenerationError, match=r"messages\[0\].content\[0\]: audio input is not supported"):
        api.encode_inputs(loaded, messages=[{"role": "user", "content": [{"type": "input_audio"}]}])
    # A template that places fewer image tokens than there are images.
    with pytest.raises(GenerationError, match=r"1 image token.*2 image\(s\)"):
        proc = api.image_processor(loaded)
        proc.expand("<|image|>", proc.preprocess([picture(8, 8), picture(8, 8)]))
    with pytest.raises(GenerationError, match="0 image token"):
        api.encode_inputs(loaded, "no placeholder", images=[picture(8, 8)], chat_template=False)
    raw = api.encode_inputs(loaded, "<|image|> what", images=[picture(8, 8)], chat_template=False)
    assert raw.ids.count(IMAGE_ID) == raw.image_tokens
    # Soft tokens that do not match the prompt's image tokens.
    bad = PromptInputs(raw.ids[:-3] + [IMAGE_ID] + raw.ids[-3:], raw.images)
    with pytest.raises(GenerationError, match="image tokens"):
        api.generate(loaded, bad, {"max_tokens": 8})
    text_only = api.load(convert_dir(tiny_dg_dir, tmp_path / "text", text_only=True))
    with pytest.raises(GenerationError, match="no vision tower"):
        api.encode_inputs(text_only, "x", images=[picture(8, 8)])
    with pytest.raises(GenerationError, match="no vision tower"):
        api.generate(text_only, raw, {"max_tokens": 8})
    llada = api.load(tiny_llada2_mlx_dir)
    with pytest.raises(GenerationError, match="LLaDA-2 is text-only"):
        api.encode_inputs(llada, "x", images=[picture(8, 8)])
    with pytest.raises(GenerationError, match="LLaDA-2 is text-only"):
        api.generate(llada, PromptInputs([1, 2, 3], raw.images), {"max_tokens": 8})


def test_vision_tower_float_by_default_8bit_on_request(tiny_dg_vision_dir, tmp_path, tiny_dg_vision_torch):
    """q4 keeps the tower in float (bit-equal features); --quantize-vision stores its
    linears at 8 bits, recorded in config.json, with features close to transformers'."""
    import json

    import mlx.core as mx
    import torch

    from tests.builders import convert_dir

    image = picture(40, 30, 3)
    want = None
    for name, extra in (("q4", {}), ("q4v", {"quantize_vision": True})):
        out = convert_dir(tiny_dg_vision_dir, tmp_path / name, quantize=True, q_bits=4, **extra)
        block = json.loads((out / "config.json").read_text())["quantization"]
        stored = mx.load(str(next(out.glob("*.safetensors"))))
        scaled = [k for k in stored if k.startswith("model.encoder.vision_tower") and k.endswith(".scales")]
        loaded = api.load(out, compute_dtype="native")
        [inp] = api.image_processor(loaded).preprocess([image])
        got = np.array(loaded.model.encode_image(inp.pixel_values, inp.position_ids))
        if want is None:
            pv, pi = torch_images(PromptInputs([], [inp]))
            with torch.no_grad():
                want = tiny_dg_vision_torch.model.encoder.get_image_features(pv, pi, return_dict=True)
            want = want.pooler_output.numpy().reshape(got.shape)
        err = np.abs(got - want).max()
        if name == "q4":
            assert not scaled and not any("vision" in k for k in block)
            assert err < 1e-5
        else:
            path = "model.encoder.vision_tower.encoder.layers.0.mlp.down_proj.linear"
            assert block[path] == {"bits": 8, "group_size": 64} and path + ".scales" in scaled
            assert 0 < err < 2e-2 * np.abs(want).max()
            assert "--quantize-vision" in (out / "README.md").read_text()
