"""dlm-verify's LLaDA-2 adapter: logit cases, commit streams, the parity suite."""

import json

import mlx.core as mx
import numpy as np
import pytest
import torch

from dlm.convert.pipeline import ConvertOptions, convert
from dlm.runtime import api
from dlm.runtime.models.llada2_moe import to_hf
from dlm.verify import protocol
from dlm.verify.llada2_moe import adapter as A
from dlm.verify.suite import Options, run_parity
from dlm.verify.weights import dequantized_weights
from tests.builders import LLADA2_MASK_ID, build_llada2
from tests.llada2_remote_code import write_llada2_remote_code

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("l2verify")
    build_llada2(root / "hf", "base")
    convert(ConvertOptions(source=str(root / "hf"), output=str(root / "mlx"), progress=False), echo=lambda s: None)
    (root / "prompts.txt").write_text('{"ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]}\nSort 3 1 2\n')
    return root


def test_adapter_protocol():
    protocol.check_adapter(A)


def test_logit_cases_mlx_match_reference(dirs):
    ref = A.load_reference(dirs / "hf")
    loaded = api.load(dirs / "mlx")
    prompts = [[1, 2, 3], list(range(10, 50))]  # shorter and longer than a block
    cases = A.logit_cases(ref.config, prompts, ref.generation_config)
    assert len({c.name for c in cases}) == len(cases) == 6
    done = {}
    for case in cases:
        want = A.reference_logits(ref, case, done)
        done[case.name] = want
        got = A.mlx_logits(loaded, case)
        assert got.shape == want.shape
        assert np.abs(got - want).max() < 1e-4, case.name
    # The "next" case: prompt blocks, one more committed block, then the active one.
    nxt = next(c for c in cases if c.name == "p1.next")
    assert len(nxt.arrays["window"]) == 128 and (nxt.arrays["window"][-32:] == LLADA2_MASK_ID).sum() == 16


def test_commit_streams_identical_greedy_and_seeded(dirs):
    ref = A.load_reference(dirs / "hf")
    loaded = api.load(dirs / "mlx")
    settings = A.stream_settings(ref.config, ref.generation_config, blocks=2, steps=8)
    json.dumps(settings)
    prompt = [5, 17, 29, 41, 53]
    r = A.reference_commit_stream(ref, prompt, settings)
    m = A.mlx_commit_stream(loaded, prompt, settings)
    assert r.tokens == m.tokens and r.steps_per_block == m.steps_per_block
    assert len(r.blocks) >= 3  # greedy blocks followed by seeded blocks
    for rb, mb in zip(r.blocks, m.blocks):
        assert np.array_equal(rb.step_argmax, mb.step_argmax)
        assert np.abs(rb.topk_logits - mb.topk_logits).max() < 1e-4
    assert all(n <= 8 for n in m.steps_per_block)


def test_hf_weights_round_trip(dirs):
    cfg = json.loads((dirs / "mlx" / "config.json").read_text())
    weights = to_hf(dequantized_weights(dirs / "mlx", cfg))
    from safetensors.numpy import load_file

    src = load_file(str(dirs / "hf" / "model.safetensors"))
    assert set(weights) == set(src)
    assert all(np.array_equal(weights[k], src[k]) for k in src)


def test_parity_suite_passes_and_catches_a_broken_router(dirs, tmp_path):
    opts = Options(prompts_file=str(dirs / "prompts.txt"), builtin_prompts=False, long_prompt=False,
                   canvases=1, steps=8, stream_prompts=1, progress=False)
    report = run_parity(dirs / "mlx", opts)
    assert report.passed, report.table()
    verdicts = {c.name: c.status for c in report.checks}
    assert verdicts == {"logits": "pass", "implementation": "pass", "implementation_layers": "pass", "drift": "skip",
                        "commit_stream": "pass"}
    # Same model with expert_bias zeroed: routing changes, the suite must fail.
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in (dirs / "mlx").iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    w = dict(mx.load(str(broken / "model.safetensors")))
    for k in [k for k in w if k.endswith("expert_bias")]:
        w[k] = mx.zeros_like(w[k])
    mx.save_safetensors(str(broken / "model.safetensors"), w, metadata={"format": "mlx"})
    opts.implementation = False
    bad = run_parity(broken, opts)
    assert not bad.passed
    assert {c.name: c.status for c in bad.checks}["logits"] == "fail"


def test_trust_remote_code_uses_the_checkpoints_own_code(tmp_path):
    """Hub-style modeling code (4.x imports, rotary buffer left to _init_weights)
    runs under transformers 5 only through the shims; it is used only with
    trust_remote_code. Its logits carry a +3 offset to tell the two apart."""
    ref_model = build_llada2(tmp_path, "flat")
    write_llada2_remote_code(tmp_path, logit_offset=3.0)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    own = A.load_reference(tmp_path)
    assert own.notes == [] and torch.equal(own.model(ids), ref_model(ids))
    remote = A.load_reference(tmp_path, trust_remote_code=True)
    assert "modeling code" in remote.notes[0]
    from dlm.verify.llada2_moe.torch_model import block_causal_mask

    for mask in (None, block_causal_mask(8, 4)):
        diff = remote.model(ids, mask) - ref_model(ids, mask)
        assert (diff - 3.0).abs().max() < 1e-4
    cases = A.logit_cases(remote.config, [[3, 1, 4]], {})
    assert np.allclose(A.reference_logits(remote, cases[0], {}) - 3.0,
                       A.reference_logits(own, cases[0], {}), atol=1e-4)
