"""The bundled trained demo models (demo/): complete hub checkpoints whose
trained skill (sorting digits, demo/task.py) makes fidelity testable.

Random tiny checkpoints prove implementations exact; these prove that a
conversion still *works*: answers stay right after 4-bit quantization, the
early-stop rule fires, answers span several canvases/blocks, generation ends
at EOS, and a broken recipe is caught by the task itself.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from demo import task as demo_task
from tests import ROOT

DG = ROOT / "demo" / "diffusion_gemma_sort"
LL = ROOT / "demo" / "llada2_sort"
# held-out prompts with 1-, 2- and 3-canvas answers (canvas/block of 8)
DIGITS = ["40719", "9081726354", "5540127736", "3141592653589793"]


def _heldout_sample(n: int) -> list[str]:
    return demo_task.heldout_set(200)[:: 200 // n][:n]


def _convert(src: Path, out: Path, **opts) -> Path:
    from dlm.convert.pipeline import ConvertOptions, convert

    return convert(ConvertOptions(source=str(src), output=str(out), progress=False, **opts),
                   echo=lambda *a, **k: None).output


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Lazily converted variants: (checkpoint, name) -> directory."""
    made: dict = {}
    recipes = {
        "q4": dict(quantize=True, q_bits=4, recipe="mixed"),
        "q2u": dict(quantize=True, q_bits=2, recipe="uniform"),
        "q2m": dict(quantize=True, q_bits=2, recipe="mixed"),
    }

    def get(src: Path, name: str) -> Path:
        key = (src.name, name)
        if key not in made:
            made[key] = _convert(src, tmp_path_factory.mktemp(src.name) / name, **recipes[name])
        return made[key]

    return get


# ---------------------------------------------------------------------------
# The artifacts
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", [DG, LL], ids=["diffusion_gemma", "llada2"])
def test_checkpoint_is_a_complete_hub_checkpoint(path):
    from tokenizers import Tokenizer

    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json", "README.md", "training_summary.json"):
        assert (path / f).is_file(), f"{path.name}: missing {f}"
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    template = tok_cfg.get("chat_template") or (path / "chat_template.jinja").read_text()
    assert "add_generation_prompt" in template
    Tokenizer.from_file(str(path / "tokenizer.json"))
    summary = json.loads((path / "training_summary.json").read_text())
    assert summary["eval"]["accuracy"] >= 0.9 and summary["eval"]["n"] >= 200


def test_demo_checkpoints_stay_small():
    total = sum(f.stat().st_size for d in (DG, LL) for f in d.rglob("*") if f.is_file())
    assert total <= 20 * 2**20, f"demo checkpoints take {total / 2**20:.1f} MB (limit 20 MB)"


def test_generation_configs_carry_the_family_sampler_defaults():
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        DiffusionGemmaGenerationConfig,
    )

    gc = json.loads((DG / "generation_config.json").read_text())
    DiffusionGemmaGenerationConfig(**copy.deepcopy(gc))  # transformers accepts it (unknown keys raise)
    assert gc["sampler_config"] == {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1}
    assert (gc["t_min"], gc["t_max"], gc["stability_threshold"], gc["confidence_threshold"]) == (0.4, 0.8, 1, 0.005)
    assert gc["max_denoising_steps"] <= 48 and 106 in gc["eos_token_id"]
    lc = json.loads((LL / "generation_config.json").read_text())
    cfg = json.loads((LL / "config.json").read_text())
    assert lc["mask_token_id"] == cfg["mask_token_id"] and lc["threshold"] == 0.95
    assert lc["steps"] == lc["block_length"]


# ---------------------------------------------------------------------------
# DiffusionGemma
# ---------------------------------------------------------------------------


def _dg_reference_run(model, tok, digits: str, seed: int):
    """transformers' generate with the checkpoint's generation_config: (text, steps per canvas)."""
    import torch

    ids = tok.apply_chat_template(demo_task.messages(digits), add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    calls: list[str] = []
    hooks = [model.model.encoder.register_forward_hook(lambda *a: calls.append("E")),
             model.model.decoder.register_forward_hook(lambda *a: calls.append("D"))]
    try:
        torch.manual_seed(seed)
        out = model.generate(torch.tensor([ids])).sequences[0, len(ids):].tolist()
    finally:
        for h in hooks:
            h.remove()
    end = next(i for i, t in enumerate(out) if t in (1, 106))  # the answer must end with an EOS id
    return tok.decode(out[:end]), [len(c) for c in "".join(calls).split("E")[1:]]


def test_dg_float_reference_solves_held_out_prompts_and_stops_early():
    import torch
    from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion

    torch.set_num_threads(1)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(DG)).eval()
    tok = AutoTokenizer.from_pretrained(str(DG))
    cap = model.generation_config.max_denoising_steps
    steps = []
    with torch.no_grad():
        for i, d in enumerate(DIGITS):
            text, s = _dg_reference_run(model, tok, d, seed=i)
            assert demo_task.is_correct(d, text), (d, text)
            assert len(s) == demo_task.num_blocks(d)
            steps += s
    assert sum(x < cap for x in steps) >= 0.75 * len(steps), steps


def test_dg_4bit_runtime_answers_across_canvases_and_stops_at_eos(converted):
    from dlm.runtime import api

    loaded = api.load(converted(DG, "q4"))
    cap = loaded.generation_config["max_denoising_steps"]
    for i, d in enumerate(DIGITS):
        ids = api.encode_prompt(loaded, demo_task.prompt_text(d))
        res = api.generate(loaded, ids, {"seed": i})
        assert res.text == demo_task.answer_text(d), (d, res.text)
        assert res.finish_reason == "stop"
        # the EOS is not emitted; the answer spans as many canvases as it needs
        assert len(res.token_ids) == len(d)
        assert len(res.steps_per_block) == demo_task.num_blocks(d)
        assert sum(s < cap for s in res.steps_per_block) >= len(res.steps_per_block) - 1
        assert res.stats.early_stops >= len(res.steps_per_block) - 1


def test_dg_token_budget_cuts_a_multi_canvas_answer(converted):
    from dlm.runtime import api

    loaded = api.load(converted(DG, "q4"))
    d = "3141592653589793"
    ids = api.encode_prompt(loaded, demo_task.prompt_text(d))
    res = api.generate(loaded, ids, {"seed": 0, "max_tokens": 10})
    assert res.finish_reason == "length"
    assert res.text == demo_task.answer_text(d)[:10]


def _dg_task_logits(adapter, ref, loaded, digits_list):
    """(reference, MLX) logits on task states: a uniform-noise canvas (step 1)
    and the next canvas after the true first one."""
    from dlm.verify.protocol import LogitCase
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DG))
    rng = np.random.default_rng(0)
    V, L = 128, 8
    refs, mlxs = [], []
    done: dict = {}
    for i, d in enumerate(digits_list):
        prompt = tok.apply_chat_template(demo_task.messages(d), add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
        answer = tok.encode(demo_task.answer_text(d), add_special_tokens=False)
        cases = [LogitCase(f"q{i}", prompt, {"canvas": rng.integers(0, V, L)})]
        if len(answer) >= L:
            cases.append(LogitCase(f"q{i}.next", prompt,
                                   {"committed": np.array(answer[:L]), "canvas": rng.integers(0, V, L)}))
        for c in cases:
            done[c.name] = r = adapter.reference_logits(ref, c, done)
            refs.append(r)
            mlxs.append(adapter.mlx_logits(loaded, c))
    return np.concatenate(refs), np.concatenate(mlxs)


def _dg_solve(loaded, digits_list: list[str]) -> tuple[float, float]:
    """(accuracy, mean denoising steps per canvas) of dlm's runtime, seeded."""
    from dlm.runtime import api

    ok, steps = 0, []
    for i, d in enumerate(digits_list):
        res = api.generate(loaded, api.encode_prompt(loaded, demo_task.prompt_text(d)), {"seed": i})
        ok += res.text == demo_task.answer_text(d) and res.finish_reason == "stop"
        steps += res.steps_per_block
    return ok / len(digits_list), sum(steps) / len(steps)


def test_dg_4bit_logits_stay_faithful_on_task_states(converted):
    from dlm.runtime import api
    from dlm.runtime.registry import family_for_config
    from dlm.verify.metrics import logits_metrics
    from dlm.verify.protocol import adapter_for

    adapter = adapter_for(family_for_config(json.loads((DG / "config.json").read_text())))
    ref = adapter.load_reference(DG, dtype="float32")
    digits = _heldout_sample(6)
    good = logits_metrics(*_dg_task_logits(adapter, ref, api.load(converted(DG, "q4")), digits))
    bad = logits_metrics(*_dg_task_logits(adapter, ref, api.load(converted(DG, "q2u")), digits))
    assert good["top1"] == 1.0 and good["kl_mean"] < 1e-3, good
    assert bad["kl_mean"] > 30 * good["kl_mean"], (good, bad)


def test_dg_2bit_uniform_breaks_the_skill_and_slows_the_sampler_mixed_does_not(converted):
    """The trained model tells recipes apart where a random one cannot: at 2
    bits, quantizing everything loses most long answers and makes the
    entropy-bound sampler run more steps; the mixed recipe keeps both."""
    from dlm.runtime import api

    long_lists = [d for d in demo_task.heldout_set(200) if len(d) >= 10][:10]
    acc_m, steps_m = _dg_solve(api.load(converted(DG, "q2m")), long_lists)
    acc_u, steps_u = _dg_solve(api.load(converted(DG, "q2u")), long_lists)
    assert acc_m == 1.0 and steps_m <= 2.5, (acc_m, steps_m)
    assert acc_u <= 0.8 and steps_u >= steps_m + 0.5, (acc_u, steps_u)


# ---------------------------------------------------------------------------
# LLaDA-2
# ---------------------------------------------------------------------------


def test_llada2_reference_solves_held_out_prompts_with_several_tokens_per_forward():
    import torch
    from transformers import PreTrainedTokenizerFast

    from dlm.verify.llada2_moe.torch_generate import generate
    from dlm.verify.llada2_moe.torch_model import load_reference

    torch.set_num_threads(1)
    model = load_reference(LL)
    tok = PreTrainedTokenizerFast.from_pretrained(str(LL))
    gc = json.loads((LL / "generation_config.json").read_text())
    tokens = forwards = 0
    for d in DIGITS:
        ids = tok.apply_chat_template(demo_task.messages(d), add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        steps: list = []
        out = generate(model, torch.tensor(ids), temperature=0.0, block_length=gc["block_length"],
                       steps=gc["steps"], gen_length=32, threshold=gc["threshold"],
                       eos_id=gc["eos_token_id"], mask_id=gc["mask_token_id"], hub_sampler=False,
                       early_stop=True, on_step=lambda b, s, logits: steps.append(b)).tolist()
        assert out[-1] == gc["eos_token_id"], out
        assert tok.decode(out[:-1]) == demo_task.answer_text(d)
        tokens += len(out)
        forwards += len(steps)
    assert tokens / forwards > 1.5, (tokens, forwards)


def test_llada2_4bit_runtime_answers_across_blocks(converted):
    from dlm.runtime import api

    loaded = api.load(converted(LL, "q4"))
    bl = loaded.generation_config["block_length"]
    for d in DIGITS:
        ids = api.encode_prompt(loaded, demo_task.prompt_text(d))
        res = api.generate(loaded, ids, {})
        assert res.text == demo_task.answer_text(d), (d, res.text)
        assert res.finish_reason == "stop"
        first, last = len(ids) // bl, (len(ids) + len(d)) // bl  # blocks holding the answer and its EOS
        assert len(res.steps_per_block) == last - first + 1
        assert res.stats.tokens_per_forward > 1.0


def test_llada2_mixed_recipe_keeps_the_skill_where_uniform_loses_it(converted):
    """At 2 bits, quantizing everything destroys the answers; the mixed
    recipe (8-bit attention, embeddings, dense MLP, router) keeps them."""
    from dlm.runtime import api

    solved = {}
    for name in ("q2u", "q2m"):
        loaded = api.load(converted(LL, name))
        solved[name] = sum(
            api.generate(loaded, api.encode_prompt(loaded, demo_task.prompt_text(d)), {}).text
            == demo_task.answer_text(d)
            for d in DIGITS
        )
    assert solved["q2m"] == len(DIGITS) and solved["q2u"] <= len(DIGITS) // 2, solved
