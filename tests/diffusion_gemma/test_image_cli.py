"""``dlm-run generate --image``: the answer the API gives for the same image,
and one-line errors for images that cannot be read or models that take none."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from PIL import Image, ImageDraw

from dlm.convert.pipeline import ConvertOptions, convert
from dlm.runtime import api
from dlm.runtime.cli.main import main

FAST = ["--max-tokens", "8", "--max-denoising-steps", "4", "--seed", "0"]
OPTIONS = {"max_tokens": 8, "max_denoising_steps": 4, "seed": 0}


def run(args, input=None):
    return CliRunner().invoke(main, ["generate", *args], input=input)


def one_line_error(r, fragment: str, code: int = 1) -> None:
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 or code == 2, r.output  # click usage errors add a usage line
    assert fragment in r.output, r.output


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_images")
    cat = Image.new("RGB", (48, 32), (240, 200, 40))
    ImageDraw.Draw(cat).ellipse((8, 4, 40, 28), fill=(20, 20, 160))
    cat.save(root / "cat.png")
    Image.new("RGB", (20, 36), (10, 120, 10)).save(root / "leaf.jpg", quality=90)
    (root / "notes.txt").write_text("not pixels")
    data = (root / "cat.png").read_bytes()
    (root / "cut.png").write_bytes(data[: len(data) // 2])
    return root


def test_generate_with_an_image_matches_the_api(tiny_dg_vision_mlx_dir, pictures):
    cat = str(pictures / "cat.png")
    r = run(["--model", str(tiny_dg_vision_mlx_dir), "--image", cat, "--prompt", "What is this?", "--json",
             *FAST])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    loaded = api.load(tiny_dg_vision_mlx_dir)
    inputs = api.encode_inputs(loaded, "What is this?", images=[cat])
    assert inputs.image_tokens > 0 and out["prompt_ids"] == inputs.ids
    ref = api.generate(loaded, inputs, OPTIONS)
    assert out["token_ids"] == ref.token_ids and out["text"] == ref.text
    assert out["stats"]["prompt_tokens"] == len(inputs.ids)  # image soft tokens count as prompt


def test_two_images_in_order_with_profile(tiny_dg_vision_mlx_dir, pictures):
    cat, leaf = str(pictures / "cat.png"), str(pictures / "leaf.jpg")
    loaded = api.load(tiny_dg_vision_mlx_dir)
    r = run(["--model", str(tiny_dg_vision_mlx_dir), "--image", cat, "--image", leaf, "--prompt", "Compare.",
             "--system", "Be brief.", "--profile", *FAST])
    assert r.exit_code == 0, r.output
    inputs = api.encode_inputs(loaded, "Compare.", images=[cat, leaf], system="Be brief.")
    assert f"Prompt: {len(inputs.ids)} tokens, {inputs.image_tokens} of them image soft tokens" in r.stderr
    assert "Vision encoder: " in r.stderr and f"for {inputs.image_tokens} image soft tokens" in r.stderr
    assert "Generation: " in r.stderr and "Peak memory:" in r.stderr
    swapped = api.encode_inputs(loaded, "Compare.", images=[leaf, cat], system="Be brief.")
    assert swapped.ids != inputs.ids  # each image's soft-token run sits where it was given


@pytest.mark.parametrize("name, fragment", [
    ("missing.png", "no such file"),
    (".", "a directory, not an image file"),
    ("notes.txt", "not an image (PNG, JPEG, WebP or GIF expected)"),
    ("cut.png", "the PNG image is truncated or corrupt"),
])
def test_an_image_that_cannot_be_read_is_one_line_naming_it(pictures, tmp_path, name, fragment):
    path = pictures / name
    # Checked before the model loads: the (missing) model dir is never reached.
    r = run(["--model", str(tmp_path / "no-model"), "--image", str(path), "--prompt", "x"])
    one_line_error(r, f"error: --image {path}: {fragment}")


def test_images_on_models_that_take_none(tiny_dg_dir, tiny_llada2_mlx_dir, pictures, tmp_path):
    cat = str(pictures / "cat.png")
    text_only = tmp_path / "text-only"
    convert(ConvertOptions(source=str(tiny_dg_dir), output=str(text_only), text_only=True, progress=False),
            echo=lambda s: None)
    r = run(["--model", str(text_only), "--image", cat, "--prompt", "x", *FAST])
    one_line_error(r, "image input is not supported: this DiffusionGemma model has no vision tower "
                      "(a text-only conversion)")
    r = run(["--model", str(tiny_llada2_mlx_dir), "--image", cat, "--prompt", "x"])
    one_line_error(r, "image input is not supported: LLaDA-2 is text-only")


def test_image_flag_combinations(tiny_dg_vision_mlx_dir, pictures):
    model, cat = str(tiny_dg_vision_mlx_dir), str(pictures / "cat.png")
    r = run(["--model", model, "--image", cat, "--prompt-ids", "2,10,11"])
    one_line_error(r, "--image takes a text prompt (--prompt or stdin), not --prompt-ids", code=2)
    r = run(["--model", model, "--image", "https://example.invalid/cat.png", "--prompt", "x"])
    one_line_error(r, "error: --image https://example.invalid/cat.png: no such file")  # paths only
    r = run(["--model", model, "--audio", "a.wav", "--prompt", "x"])
    one_line_error(r, "error: audio input is not supported by dlm-run")
    r = run(["--model", model, "--video", "v.mp4", "--prompt", "x"])
    one_line_error(r, "error: video input is not supported by dlm-run")
    # A raw prompt places its images itself, one image token each.
    r = run(["--model", model, "--image", cat, "--no-chat-template", "--prompt", "no image token", *FAST])
    one_line_error(r, "image token")
    r = run(["--model", model, "--image", cat, "--prompt", "-", "--json", *FAST], input="from stdin")
    assert r.exit_code == 0, r.output
    loaded = api.load(model)
    assert json.loads(r.stdout)["prompt_ids"] == api.encode_inputs(loaded, "from stdin", images=[cat]).ids
