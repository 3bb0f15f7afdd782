"""LLaDA2.2 end to end on a tiny checkpoint (block routing with a pool smaller than
the experts, DELETE/SPLIT-prone head): the MLX runtime against the independent
PyTorch reference — logits, every iteration's writes (DELETE and SPLIT included),
batch ≡ solo — and dlm-verify catching a runtime that routes token by token or
ignores DELETE."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlm.convert.pipeline import ConvertOptions, convert
from dlm.runtime import api  # before MLX: dlm.runtime loads the optimized BLAS ahead of it
from dlm.runtime.models.llada2_moe import levenshtein, model as ll_model
from dlm.runtime.platform.errors import GenerationError
from dlm.verify.llada2_moe import adapter as A
from dlm.verify.llada2_moe.torch_generate import generate as reference_generate
from dlm.verify.suite import Options, run_parity
from tests.builders import (LLADA22_DELETE_ID, LLADA22_EDIT_PROMPTS, LLADA22_EDIT_SETTINGS, LLADA22_SPLIT_ID,
                            build_llada22)

torch.set_num_threads(1)

S = LLADA22_EDIT_SETTINGS
OPTIONS = {"max_tokens": S["gen_length"], "block_length": S["block_length"], "max_denoising_steps": S["steps"],
           "threshold": S["threshold"], "editing_threshold": S["editing_threshold"],
           "max_post_steps": S["max_post_steps"]}
EDITS = {LLADA22_DELETE_ID, LLADA22_SPLIT_ID}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("v22")
    gc = {"eos_token_id": S["eos_id"], "pad_token_id": S["eos_id"][0], "block_length": S["block_length"],
          "steps": S["steps"], "max_post_steps": S["max_post_steps"]}
    build_llada22(root / "hf", generation_config=gc)
    convert(ConvertOptions(source=str(root / "hf"), output=str(root / "mlx"), progress=False), echo=lambda s: None)
    lines = [f'{{"ids": {list(p)}}}' for p in LLADA22_EDIT_PROMPTS]
    (root / "prompts.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def ref(dirs):
    return A.load_reference(dirs / "hf")


@pytest.fixture(scope="module")
def loaded(dirs):
    return api.load(dirs / "mlx")


def test_the_conversion_keeps_the_22_config(loaded):
    a = loaded.args
    assert a.block_routing and a.expert_capacity < a.num_experts and a.block_size == S["block_length"]
    assert (a.delete_token_id, a.split_token_id) == (LLADA22_DELETE_ID, LLADA22_SPLIT_ID)


def test_logits_match_the_reference_over_several_blocks(ref, loaded):
    prompts = [list(p) for p in LLADA22_EDIT_PROMPTS]  # 3, 19 (two whole blocks, then a partial one), 6 tokens
    cases = A.logit_cases(ref.config, prompts, ref.generation_config)
    for case in cases:
        want = A.reference_logits(ref, case, {})
        got = A.mlx_logits(loaded, case)
        assert np.abs(got - want).max() < 1e-4, case.name


def _reference_run(ref, prompt):
    trace: list = []
    out = reference_generate(ref.model, torch.tensor(prompt), levenshtein=True, trace=trace, hub_sampler=False,
                             **S).tolist()
    return out, [(b, s, list(map(int, p)), list(map(int, t))) for b, s, p, t in trace]


def _runtime_run(loaded, prompt, **extra):
    trace: list = []
    result = api.generate(loaded, prompt, {**OPTIONS, **extra}, trace=trace)
    return result, trace


@pytest.mark.parametrize("index", range(len(LLADA22_EDIT_PROMPTS)))
def test_every_iteration_equals_the_reference_including_edits(ref, loaded, index):
    prompt = list(LLADA22_EDIT_PROMPTS[index])
    want, want_trace = _reference_run(ref, prompt)
    result, trace = _runtime_run(loaded, prompt)
    assert trace == want_trace
    assert {t for *_, tokens in trace for t in tokens} & EDITS  # the case exercises the edit tokens
    if want and want[-1] in S["eos_id"]:  # the reference returns its stop token; dlm's answer ends before it
        want, reason = want[:-1], "stop"
    else:
        reason = "length"
    assert (result.token_ids, result.finish_reason) == (want, reason)
    assert not set(result.token_ids) & (EDITS | {S["mask_id"]})


def test_the_cases_write_both_edit_tokens(ref):
    written = {t for p in LLADA22_EDIT_PROMPTS for *_, tokens in _reference_run(ref, list(p))[1] for t in tokens}
    assert EDITS <= written


def test_batch_equals_solo(loaded):
    prompts = [list(p) for p in LLADA22_EDIT_PROMPTS]
    options = [dict(OPTIONS), dict(OPTIONS, max_tokens=24), dict(OPTIONS, editing_threshold=0.5)]

    def summary(r):
        return r.token_ids, r.text, r.finish_reason, r.stats.steps_per_block

    want = [summary(api.generate(loaded, p, o)) for p, o in zip(prompts, options)]
    assert [summary(r) for r in api.generate_batch(loaded, prompts, options)] == want


@pytest.mark.parametrize("options, message", [
    ({"temp": 0.7}, "--temp > 0: not implemented for LLaDA2.2"),
    ({"top_k": 5}, "--top-k: not implemented for LLaDA2.2"),
    ({"threshold_schedule": "linear"}, "--threshold-schedule linear"),
    ({"block_length": 4}, "--block-length 4 is not a multiple of this LLaDA2.2 checkpoint's routing block_size 8"),
])
def test_what_22_decoding_does_not_implement_is_refused(loaded, options, message):
    with pytest.raises(GenerationError, match=message.replace("(", r"\(")):
        api.generate(loaded, [10, 20, 30], {**OPTIONS, **options})


def test_a_prompt_holding_an_edit_token_is_refused(loaded):
    with pytest.raises(GenerationError, match="the prompt holds LLaDA2.2's DELETE token"):
        api.generate(loaded, [10, LLADA22_DELETE_ID, 30], OPTIONS)


def _options(dirs) -> Options:
    return Options(prompts_file=str(dirs / "prompts.txt"), builtin_prompts=False, long_prompt=False, canvases=2,
                   steps=S["steps"], stream_prompts=len(LLADA22_EDIT_PROMPTS), progress=False, implementation=False)


def test_dlm_verify_passes(dirs):
    report = run_parity(dirs / "mlx", _options(dirs))
    assert report.passed, report.table()
    verdicts = {c.name: c.status for c in report.checks}
    assert verdicts["logits"] == verdicts["commit_stream"] == "pass", verdicts


def test_dlm_verify_fails_a_runtime_that_routes_token_by_token(dirs, monkeypatch):
    monkeypatch.setattr(ll_model.Gate, "_pooled", lambda self, b, sequences: b)
    report = run_parity(dirs / "mlx", _options(dirs))
    assert not report.passed
    assert {c.name: c.status for c in report.checks}["logits"] == "fail"


def test_dlm_verify_fails_a_runtime_that_ignores_delete(dirs, monkeypatch):
    real = levenshtein.scan

    def keep_deletes(new, before, orig, r):
        return real(new, before, orig, levenshtein.Rules(**{**r.__dict__, "delete_id": -1}))

    monkeypatch.setattr(levenshtein, "scan", keep_deletes)
    report = run_parity(dirs / "mlx", _options(dirs))
    assert not report.passed
    verdicts = {c.name: c.status for c in report.checks}
    assert verdicts["logits"] == "pass" and verdicts["commit_stream"] == "fail", verdicts


@pytest.fixture(scope="module")
def quantized(dirs):
    out = dirs / "mlx4"
    convert(ConvertOptions(source=str(dirs / "hf"), output=str(out), quantize=True, q_bits=4, q_group_size=32,
                           progress=False), echo=lambda s: None)
    return out


def test_a_4bit_conversion_verifies_and_batches_as_alone(dirs, quantized):
    """Against the reference on the same (dequantized) weights: forward and every iteration
    agree; against the float weights a random tiny model's 4-bit drift is not the question."""
    opts = _options(dirs)
    opts.implementation = True
    report = run_parity(quantized, opts)
    verdicts = {c.name: c.status for c in report.checks}
    assert verdicts["implementation"] == verdicts["commit_stream"] == "pass", report.table()
    loaded = api.load(quantized)
    prompts = [list(p) for p in LLADA22_EDIT_PROMPTS]
    want = [api.generate(loaded, p, OPTIONS).token_ids for p in prompts]
    assert [r.token_ids for r in api.generate_batch(loaded, prompts, [OPTIONS] * len(prompts))] == want


def test_structured_output_never_proposes_an_edit_token(loaded):
    import json

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    result = api.generate(loaded, [10, 20, 30], dict(OPTIONS, max_tokens=48), response_format=fmt)
    assert not set(result.token_ids) & EDITS
    if result.finish_reason == "stop":
        assert isinstance(json.loads(result.text)["n"], int)


def test_the_server_streams_22_blocks_as_the_runtime_and_refuses_sampling(loaded, serving):
    import openai

    from dlm.runtime.server.app import create_app

    app = create_app(loaded, dict(OPTIONS), queue_size=2)
    prompt = "hello"
    ids = api.encode_prompt(loaded, prompt=prompt, chat_template=False)
    want = list(api.stream_generate(loaded, ids, OPTIONS))
    with serving(app) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        chunks = list(client.completions.create(model="m", prompt=prompt, max_tokens=OPTIONS["max_tokens"],
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == "".join(e.text for e in want)
        with pytest.raises(openai.BadRequestError, match="not implemented for LLaDA2.2"):
            client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0.7)
