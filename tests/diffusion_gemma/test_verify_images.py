"""dlm-verify's image rows on the tiny multimodal DiffusionGemma: the vision
tower's features, logits of prompts with images and the debug-canvas commit
stream with an image, against transformers; a broken vision tensor or a
vision runtime bug fails the image rows (and only those); a text-only
conversion gets none."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dlm.verify import bundle as B  # noqa: E402
from dlm.verify.images import BUILTIN_IMAGES, builtin_image  # noqa: E402
from dlm.verify.suite import run_parity  # noqa: E402
from tests.builders import NO_TORCH_VERIFY, convert_dir, mutate, record_bundle, verify_options  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IMAGES = ("gradient", "checker", "strip")
IMAGE_ROWS = {f"image.features.{n}" for n in IMAGES} | {
    "image.logits.p0", "image.logits.p1", "image.implementation.features", "image.implementation.logits",
    "image.drift", "image.stream",
}
TEXT_ROWS = ("logits", "implementation", "commit_stream")
DOWN_PROJ = "model.encoder.vision_tower.encoder.layers.0.mlp.down_proj.linear.weight"


@pytest.fixture(scope="module")
def live(tiny_dg_vision_mlx_dir, tiny_dg_vision_dir):
    return run_parity(tiny_dg_vision_mlx_dir, verify_options(reference=str(tiny_dg_vision_dir), long_prompt=False))


@pytest.fixture(scope="module")
def vision_bundle(tiny_dg_vision_dir, tmp_path_factory):
    return record_bundle(tiny_dg_vision_dir, tmp_path_factory.mktemp("vision_bundle") / "b", long_prompt=False)


def statuses(report) -> dict:
    return {c.name: c.status for c in report.checks}


def image_rows(report) -> dict:
    return {k: v for k, v in statuses(report).items() if k.startswith("image.")}




def test_vision_model_passes_live_with_image_rows(live):
    assert live.passed, live.table()
    assert image_rows(live) == {**{r: "pass" for r in IMAGE_ROWS}, "image.drift": "skip"}
    for name in IMAGES:
        row = live.check(f"image.features.{name}")
        assert row.kind == "features" and row.precision_class == "float32"
        assert row.metrics["max_abs"] < 1e-5 and row.metrics["cosine_min"] > 0.99999
        assert row.thresholds["max_abs"] == ["<=", 1e-4]
    for i, n_images in ((0, 1), (1, 2)):
        row = live.check(f"image.logits.p{i}")
        assert row.kind == "logits" and row.metrics["max_abs"] < 1e-4 and row.metrics["top1"] == 1.0
        assert f"{n_images} image" in row.title
    assert set(live.check("image.logits.p0").details["cases"]) == {
        "image.p0.debug", "image.p0.debug.sc", "image.p0.next"}
    stream = live.check("image.stream")
    assert stream.metrics["identical_fraction"] == 1.0 and stream.metrics["tokens"] == 2 * 8
    assert "with the MLX weights" in stream.note
    sizes = {i["name"]: (tuple(i["size"]), i["soft_tokens"]) for i in live.images["images"]}
    assert set(sizes) == set(IMAGES) and len({s for s, _ in sizes.values()}) == 3
    assert live.images["prompts"] == 2 and live.images["stream_prompts"] == 1
    assert all(live.check(r).status == "pass" for r in TEXT_ROWS)


def test_recorded_images_are_transformers_own(vision_bundle, tiny_dg_vision_dir, tiny_dg_vision_torch):
    """The bundle holds what transformers' own processor makes of the built-in
    images, and the reference features are its get_image_features."""
    from transformers import AutoImageProcessor

    data = B.load(vision_bundle)
    assert data.images is not None and list(data.images.images) == list(IMAGES)
    processor = AutoImageProcessor.from_pretrained(str(tiny_dg_vision_dir))
    for name, image in data.images.images.items():
        theirs = processor(images=[builtin_image(name)], return_tensors="pt")
        np.testing.assert_array_equal(image.pixel_values, theirs["pixel_values"][0].numpy())
        np.testing.assert_array_equal(image.position_ids, theirs["image_position_ids"][0].numpy())
        with torch.no_grad():
            want = tiny_dg_vision_torch.model.encoder.get_image_features(
                theirs["pixel_values"], theirs["image_position_ids"], return_dict=True).pooler_output
        np.testing.assert_allclose(data.original.features[name], want.reshape(-1, want.shape[-1]).numpy(),
                                   atol=1e-6, rtol=0)
    image_id = tiny_dg_vision_torch.config.image_token_id
    for prompt in data.images.prompts:
        soft = sum(data.images.images[n].soft_tokens for n in prompt.images)
        assert prompt.ids.count(image_id) == soft > 0
    assert [c.name for c in data.images.cases][:2] == ["image.p0.debug", "image.p0.debug.sc"]
    assert all(c.images for c in data.images.cases)
    assert len(data.original.image_streams) == 1 and data.original.image_streams[0].tokens


def test_builtin_images_are_deterministic_and_differ():
    sizes = set()
    for name in BUILTIN_IMAGES:
        a, b = builtin_image(name), builtin_image(name)
        assert a.mode == "RGB" and np.array_equal(np.asarray(a), np.asarray(b))
        sizes.add(a.size)
    assert len(sizes) == len(BUILTIN_IMAGES)


def test_bundle_cli_report_and_card_carry_image_rows(vision_bundle, tiny_dg_vision_mlx_dir, live, tmp_path):
    from click.testing import CliRunner

    from dlm.verify.cli import main

    model = tmp_path / "model"
    shutil.copytree(tiny_dg_vision_mlx_dir, model)
    report_path = tmp_path / "report.json"
    result = CliRunner().invoke(main, [
        "--parity", str(model), "--bundle", str(vision_bundle), "--report", str(report_path), "--update-card",
        "--steps", "8", "--stream-prompts", "1", "--quiet",
    ])
    assert result.exit_code == 0, result.output
    assert "image.features.gradient" in result.output and "images: 3 built-in images" in result.output
    data = json.loads(report_path.read_text())
    assert {k: v["status"] for k, v in data["checks"].items()} == statuses(live)  # bundle == live
    assert data["checks"]["image.logits.p1"]["kind"] == "logits"
    for name in IMAGES:
        row = f"image.features.{name}"
        live_m, rec_m = live.check(row).metrics, data["checks"][row]["metrics"]
        assert rec_m["max_abs"] == pytest.approx(live_m["max_abs"], rel=1e-6, abs=1e-9)
    assert [i["name"] for i in data["images"]["images"]] == list(IMAGES)
    card = (model / "README.md").read_text()
    for row in ("image.features.strip", "image.logits.p0", "image.implementation.features", "image.stream"):
        assert f"(`{row}`) | pass |" in card
    assert "Images: 3 built-in images" in card
    # --no-images: the text rows only, and a note.
    again = CliRunner().invoke(main, [str(model), "--bundle", str(vision_bundle), "--no-images", "--steps", "8",
                                      "--stream-prompts", "1", "--no-implementation", "--quiet"])
    assert again.exit_code == 0, again.output
    assert "image." not in again.output and "no image checks: disabled (--no-images)" in again.output


def test_broken_vision_tensor_fails_the_image_rows_only(vision_bundle, tiny_dg_vision_mlx_dir, tmp_path):
    """A converter bug in the vision tower: the image rows against the original
    weights fail, the same-weights rows pass (the runtime is not to blame), and
    the text rows never see it."""
    def scale(t):
        t[DOWN_PROJ] = t[DOWN_PROJ] * 1.5

    mutant = mutate(tiny_dg_vision_mlx_dir, tmp_path / "mutant", scale)
    report = run_parity(mutant, verify_options(bundle=str(vision_bundle)))
    assert not report.passed
    rows = statuses(report)
    for name in IMAGES:
        row = report.check(f"image.features.{name}")
        assert row.status == "fail" and any("max_abs" in f for f in row.failures), report.table()
        assert row.metrics["max_abs"] > 1e-3
    assert rows["image.logits.p0"] == rows["image.logits.p1"] == "fail", report.table()
    assert rows["image.implementation.features"] == rows["image.implementation.logits"] == "pass", report.table()
    assert all(rows[r] == "pass" for r in TEXT_ROWS), report.table()


def test_vision_runtime_bug_fails_implementation_rows(vision_bundle, tiny_dg_vision_mlx_dir, monkeypatch):
    """A runtime bug (the vision RoPE's x and y angles swapped) fails the
    same-weights image rows; text rows pass."""
    import mlx.core as mx

    from dlm.runtime.models.diffusion_gemma import vision

    real = vision.axial_rope

    def swapped(x, cos, sin):
        half = cos.shape[-1] // 2
        swap = lambda t: mx.concatenate([t[..., half:], t[..., :half]], axis=-1)  # noqa: E731
        return real(x, swap(cos), swap(sin))

    monkeypatch.setattr(vision, "axial_rope", swapped)
    report = run_parity(tiny_dg_vision_mlx_dir, verify_options(bundle=str(vision_bundle)))
    rows = statuses(report)
    assert rows["image.implementation.features"] == "fail", report.table()
    assert report.check("image.implementation.features").metrics["max_abs"] > 1e-3
    assert rows["image.implementation.logits"] == "fail"
    assert all(rows[r] == "pass" for r in TEXT_ROWS), report.table()


def test_text_only_conversion_has_no_image_rows(vision_bundle, tiny_dg_vision_dir, tmp_path):
    text_only = convert_dir(tiny_dg_vision_dir, tmp_path / "text", text_only=True)
    report = run_parity(text_only, verify_options(bundle=str(vision_bundle)))
    assert report.passed, report.table()
    assert not image_rows(report) and report.images == {}
    assert any("no image checks: the MLX model has no vision tower" in n for n in report.notes)
    assert "image." not in report.card_markdown()


def test_q4_conversion_image_rows(vision_bundle, tiny_dg_vision_dir, tmp_path):
    """q4 keeps the tower in float: its features are held to float32 bounds,
    and the image drift row is measured. With --quantize-vision (8-bit tower)
    the features are judged by cosine."""
    q4 = convert_dir(tiny_dg_vision_dir, tmp_path / "q4", quantize=True, q_bits=4, q_group_size=32)
    report = run_parity(q4, verify_options(bundle=str(vision_bundle)))
    assert report.passed, report.table()
    feats = report.check("image.features.gradient")
    assert feats.precision_class == "float32" and feats.metrics["max_abs"] < 1e-5
    assert report.check("image.logits.p0").metrics["mean_abs"] > 1e-3  # the quantized text weights show
    assert report.check("image.implementation.logits").metrics["max_abs"] < 1e-4
    drift = report.check("image.drift")
    assert drift.status == "pass" and drift.metrics["mlx_steps_per_canvas"] > 0
    assert report.check("image.stream").metrics["identical_fraction"] == 1.0

    q4v = convert_dir(tiny_dg_vision_dir, tmp_path / "q4v", quantize=True, q_bits=4, q_group_size=32,
                      quantize_vision=True)
    # Its image feature rows only (no verdict read): no layer-local row (local=False).
    report = run_parity(q4v, verify_options(bundle=str(vision_bundle), local=False))
    feats = report.check("image.features.gradient")
    assert feats.precision_class == "q8" and feats.status == "pass", report.table()
    assert 1e-5 < feats.metrics["max_abs"] and feats.metrics["cosine_min"] > 0.99
    assert report.check("image.implementation.features").metrics["max_abs"] < 1e-4  # same weights


def test_image_hooks_are_all_or_none():
    import types

    from dlm.verify.diffusion_gemma import adapter
    from dlm.verify.protocol import IMAGE_HOOKS, REQUIRED, check_adapter, has_image_hooks

    assert has_image_hooks(adapter)
    partial = types.ModuleType("partial_adapter")
    for name in REQUIRED + IMAGE_HOOKS[:2]:
        setattr(partial, name, getattr(adapter, name))
    with pytest.raises(TypeError, match="only some image hooks.*image_logit_cases"):
        check_adapter(partial)
    from dlm.verify.llada2_moe import adapter as llada

    assert not has_image_hooks(llada)




def test_recorded_image_rows_compare_without_torch(tiny_dg_vision_dir, tiny_dg_vision_mlx_dir, tmp_path):
    """``record --mlx`` keeps the same-weights image results too: the image
    rows, implementation included, then run where torch cannot be imported."""
    import subprocess
    import sys

    from click.testing import CliRunner

    from dlm.verify.cli import main

    bundle = tmp_path / "bundle"
    r = CliRunner().invoke(main, ["record", "--reference", str(tiny_dg_vision_dir), "-o", str(bundle), "--mlx",
                                  str(tiny_dg_vision_mlx_dir), "--no-builtin-prompts", "--prompts",
                                  str(_one_prompt(tmp_path)), "--steps", "8", "--stream-prompts", "1", "--quiet"])
    assert r.exit_code == 0, r.output
    assert "images: 3 built-in images, 5 image logit cases, 1 image commit streams" in r.output
    script = tmp_path / "no_torch.py"
    script.write_text(NO_TORCH_VERIFY)
    out = subprocess.run(
        [sys.executable, str(script), "--parity", str(tiny_dg_vision_mlx_dir), "--bundle", str(bundle),
         "--report", str(tmp_path / "r.json"), "--quiet"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    checks = json.loads((tmp_path / "r.json").read_text())["checks"]
    assert {k: v["status"] for k, v in checks.items() if k.startswith("image.")} == {
        **{r: "pass" for r in IMAGE_ROWS}, "image.drift": "skip"}
    assert "recorded in the bundle" in checks["image.implementation.features"]["note"]


def _one_prompt(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("Why is the sky blue?\n")
    return path
