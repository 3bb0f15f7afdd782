"""The demo training scripts still run against transformers / dlm's reference,
and their objectives see exactly what generation sees.

A full run takes 15-60 CPU minutes (demo/train_*.py); here two steps
of each, plus the equivalences the objectives rely on, against the real
forward passes."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def torch1():
    import torch

    torch.set_num_threads(1)
    return torch


def test_dg_prefix_caches_equal_encoding_the_prefix_alone(torch1, tmp_path):
    """One encoder pass serves every canvas: the decoder logits from a cut of
    the full cache equal transformers' forward on the prefix alone."""
    from transformers import PreTrainedTokenizerFast

    from demo import train_diffusion_gemma as T
    from tests.builders import build_diffusion_gemma_tokenizer

    torch = torch1
    build_diffusion_gemma_tokenizer(T.VOCAB, tmp_path)
    data = T.Data(PreTrainedTokenizerFast.from_pretrained(str(tmp_path)), seed=3)
    model = T.build_model(0).eval()
    seqs, P, K = data.batch(2)
    while K < 2:
        seqs, P, K = data.batch(2)
    text_config = model.config.get_text_config(decoder=True)
    with torch.no_grad():
        full = model.model.encoder(input_ids=seqs[:, : P + (K - 1) * T.CANVAS]).cache
        for k in range(K):
            start = P + k * T.CANVAS
            canvas = torch.randint(0, T.VOCAB, (2, T.CANVAS))
            sc = torch.randn(2, T.CANVAS, T.VOCAB)
            ours = T.decoder_logits(model, canvas, T.prefix_cache(full, start, text_config), sc)
            ref = model(input_ids=seqs[:, :start], decoder_input_ids=canvas, self_conditioning_logits=sc).logits
            assert torch.allclose(ours, ref, atol=1e-5), (k, (ours - ref).abs().max())


def test_llada2_training_mask_gives_every_block_its_generation_view(torch1, tmp_path):
    """Over [x_t ; x_0], block b of x_t gets the logits the reference computes on
    the window generate() runs: clean blocks < b, then the noisy block b."""
    from transformers import PreTrainedTokenizerFast

    from demo import train_llada2 as T
    from dlm.verify.llada2_moe.torch_model import block_causal_mask
    from tests.builders import build_llada2_tokenizer

    torch = torch1
    model, cfg = T.build_model(0)
    model.eval()
    build_llada2_tokenizer(cfg["vocab_size"], tmp_path)
    data = T.Data(PreTrainedTokenizerFast.from_pretrained(str(tmp_path)), seed=0)
    noisy, clean, masked = data.batch(2, torch.Generator().manual_seed(0))
    n = noisy.shape[1]
    assert masked.any() and not masked[:, : n - 2 * T.BLOCK].all()
    with torch.no_grad():
        both = T.forward_train(model, torch.cat([noisy, clean], 1), T.training_mask(n),
                               torch.arange(n).repeat(2))[:, :n]
        for b in range(n // T.BLOCK):
            s, e = b * T.BLOCK, (b + 1) * T.BLOCK
            window = torch.cat([clean[:, :s], noisy[:, s:e]], 1)
            ref = model(window, block_causal_mask(e, T.BLOCK))[:, s:e]
            assert torch.allclose(both[:, s:e], ref, atol=1e-5), b


def test_dg_training_script_writes_a_hub_checkpoint(torch1, tmp_path):
    from transformers import DiffusionGemmaForBlockDiffusion

    from demo import train_diffusion_gemma as T

    out = tmp_path / "dg"
    T.main(["--out", str(out), "--steps", "2", "--batch", "4", "--eval-n", "1", "--final-n", "2",
            "--eval-steps", "2"])
    cfg = json.loads((out / "config.json").read_text())
    tc = cfg["text_config"]
    assert "per_layer_config" not in tc and tc["global_head_dim"] == T.TEXT["global_head_dim"]
    assert json.loads((out / "generation_config.json").read_text()) == T.GENERATION
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["steps"] == 2 and summary["eval"]["n"] == 2
    DiffusionGemmaForBlockDiffusion.from_pretrained(str(out))
    assert not list(tmp_path.glob("dg.*")), "temporary directories left behind"


def test_llada2_training_script_writes_a_hub_checkpoint(torch1, tmp_path):
    from demo import train_llada2 as T
    from dlm.verify.llada2_moe.torch_model import load_reference

    out = tmp_path / "ll"
    T.main(["--out", str(out), "--steps", "2", "--batch", "4", "--eval-n", "1", "--final-n", "2"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llada2_moe" and cfg["architectures"] == ["LLaDA2MoeModelLM"]
    assert json.loads((out / "generation_config.json").read_text()) == T.generation_config()
    model = load_reference(out)  # strict: every hub tensor present
    biases = [layer.mlp.gate.expert_bias for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert biases and all(bool((b != 0).any()) for b in biases)  # the balancing rule ran
    assert not list(tmp_path.glob("ll.*")), "temporary directories left behind"
