"""dlm-run generate on a converted tiny LLaDA-2 model."""

import json

import pytest
import torch
from click.testing import CliRunner

from dlm.convert.pipeline import ConvertOptions, convert
from dlm.runtime.cli.main import main
from dlm.verify.llada2_moe import torch_generate as RG
from tests.builders import LLADA2_EOS_ID, LLADA2_MASK_ID, LLADA2_ROLE_END_ID, build_llada2

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("l2cli")
    ref = build_llada2(root / "hf", "base")
    convert(ConvertOptions(source=str(root / "hf"), output=str(root / "mlx"), progress=False),
            echo=lambda s: None)
    return root / "mlx", ref


def invoke(model, *args):
    return CliRunner().invoke(main, ["generate", "--model", str(model), *args])


def test_generate_json_matches_reference(converted):
    model, ref = converted
    ids = [5, 9, 14, 20, 33, 41, 7]
    r = invoke(model, "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", "30", "--block-length", "8",
               "--max-denoising-steps", "4", "--threshold", "0.9", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    want = RG.generate(ref, torch.tensor(ids), block_length=8, steps=4, gen_length=30, threshold=0.9,
                      eos_id=[LLADA2_EOS_ID, LLADA2_ROLE_END_ID], mask_id=LLADA2_MASK_ID, hub_sampler=False,
                      suppress_mask=True).tolist()
    assert out["token_ids"] == [t for t in want if t not in (LLADA2_EOS_ID, LLADA2_ROLE_END_ID)]
    assert all(n <= 4 for n in out["steps_per_canvas"])
    stats = out["stats"]
    assert stats["forwards"] == sum(out["steps_per_canvas"])
    assert stats["tokens_per_forward"] == pytest.approx(len(out["token_ids"]) / stats["forwards"])


def test_generate_llada_flags_and_profile(converted):
    model, _ = converted
    r = invoke(model, "--prompt", "Hello", "--max-tokens", "12", "--threshold-schedule", "linear:0.5",
               "--temp", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3", "--profile")
    assert r.exit_code == 0, r.output
    assert "Tokens per forward:" in r.output
    again = invoke(model, "--prompt", "Hello", "--max-tokens", "12", "--threshold-schedule", "linear:0.5",
                   "--temp", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3")
    assert again.exit_code == 0
    first_line = [ln for ln in r.output.splitlines() if not ln.startswith(("Prompt:", "Generation:", "Blocks:", "Tokens per", "Peak"))]
    assert again.output.strip() in "\n".join(first_line)  # same seed, same text
    # The prompt's partial block is computed with that block's forwards, not prefilled: the rate
    # is over the prefilled tokens only.
    ids = ",".join(str(5 + i % 50) for i in range(75))
    prompt = [ln for ln in invoke(model, "--prompt-ids", ids, "--max-tokens", "4", "--profile").output.splitlines()
              if ln.startswith("Prompt:")]
    assert prompt[0].startswith("Prompt: 75 tokens, 11 in the first block's forwards, ")
    assert prompt[0].endswith(" tokens-per-sec for the 64 prefilled")
    short = invoke(model, "--prompt-ids", "5,6,7", "--max-tokens", "4", "--profile").output
    assert "Prompt: 3 tokens, 3 in the first block's forwards, none prefilled" in short
    edit = invoke(model, "--prompt", "Hi", "--max-tokens", "8", "--editing-threshold", "0.5",
                  "--max-post-steps", "2", "--reference-sampling", "--seed", "0")
    assert edit.exit_code == 0, edit.output


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--draft-model", "some/model"], "--draft-model does not apply to LLaDA-2"),
        (["--diffusion-sampler", "entropy-bound"], "--diffusion-sampler does not apply to LLaDA-2"),
        (["--diffusion-threshold", "0.5"], "--diffusion-threshold"),
        (["--debug-canvas"], "--debug-canvas"),
        (["--image", "x.png"], "--image x.png: no such file"),
        (["--audio", "x.wav"], "audio input is not supported"),
        (["--threshold-schedule", "cosine"], "--threshold-schedule"),
    ],
)
def test_generate_errors(converted, flags, message):
    model, _ = converted
    r = invoke(model, "--prompt", "Hi", "--max-tokens", "4", *flags)
    assert r.exit_code == 1
    assert "error: " in r.output and message in r.output
    assert "Traceback" not in r.output
