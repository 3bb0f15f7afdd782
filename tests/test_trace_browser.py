"""The ``--trace`` pages drawn by a real headless browser (Debian's chromium):
the inline script runs, draws every position of every canvas, and the
screenshot is a coloured page, not a blank one. Pages are opened as files
with the network off, as a user opens them offline."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
from click.testing import CliRunner

from dlm.runtime.trace import html as trace_html
from dlm.runtime.cli.main import main
from dlm.runtime.registry import get_family
from dlm.verify.protocol import BlockTrace, CommitStream
from dlm.verify.trace_view import write_divergences

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Debian's chromium is not installed (scripts/install_chromium.sh installs it; .ci/run runs it)")

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>"]


def chromium(page, tmp_path, size=(1280, 1000)):
    """Open ``page`` once: (the DOM after its script ran, without the script itself; the screenshot)."""
    from PIL import Image

    png = tmp_path / (page.stem + ".png")
    r = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}", "--dump-dom",
                        f"--screenshot={png}", f"--window-size={size[0]},{size[1]}", page.resolve().as_uri()],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split('<script type="application/json"')[0], Image.open(png).convert("RGB")


def classed(dom: str, name: str) -> list[str]:
    """The class attributes in ``dom`` that hold ``name``."""
    return re.findall(rf'class="[^"]*\b{name}\b[^"]*"', dom)


def assert_not_blank(image):
    pixels = np.asarray(image).reshape(-1, 3).astype(int)
    colours = len(np.unique(pixels, axis=0))
    ink = float(np.mean(pixels.min(axis=1) < 235))  # not white / near-white
    # The heat colours (entropy / confidence): strongly saturated pixels.
    heat = int(np.sum(pixels.max(axis=1) - pixels.min(axis=1) > 80))
    assert colours > 64 and ink > 0.03 and heat > 500, (colours, ink, heat)


@needs_browser
def test_run_trace_renders(tiny_dg_mlx_dir, tmp_path):
    page = tmp_path / "run.html"
    r = CliRunner().invoke(main, ["generate", "--model", str(tiny_dg_mlx_dir), "--prompt", "hello",
                                  "--max-tokens", "16", "--seed", "0", "--max-denoising-steps", "5",
                                  "--diffusion-max-canvas-length", "8", "--trace", str(page)])
    assert r.exit_code == 0, r.output
    data = trace_html.read(page)
    dom, image = chromium(page, tmp_path)
    assert 'data-rendered="1"' in dom  # the script ran to its end
    positions = sum(c["length"] for c in data["canvases"])
    assert len(classed(dom, "tok")) >= positions  # one cell per position of every canvas
    assert dom.count('<canvas class="overview"') == len(data["canvases"])
    assert "Committed text (answer)" in dom and "Reasoning (thinking channel)" in dom
    assert "Tokens per forward:" in dom and "stopped after" in dom
    assert_not_blank(image)


def _stream(prompt, steps_argmax, tokens):
    steps = np.asarray(steps_argmax, np.int32)
    n, L = steps.shape
    ids = np.repeat(steps[:, :, None], 4, axis=2)
    ids[:, :, 1:] = np.arange(1, 4)[None, None, :] + 100
    logits = np.tile(np.array([3.0, 1.0, 0.5, 0.0], np.float32), (n, L, 1))
    return CommitStream(prompt, [BlockTrace(tokens, n, steps, ids, logits)], "length")


def diverging_pair(tmp_path):
    """A reference and an MLX stream whose argmax first differs at step 2, position 2."""
    ref = _stream([1, 2], [[5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 7, 9]], [5, 6, 7, 9])
    mlx = _stream([1, 2], [[5, 6, 7, 8], [5, 6, 4, 9]], [5, 6, 4, 9])
    family = get_family("diffusion_gemma")
    notes = write_divergences(tmp_path / "traces", tmp_path / "no-tokenizer", family, [ref], [mlx])
    page = tmp_path / "traces" / "commit-stream-prompt0.html"
    assert notes == [f"commit stream of prompt 0 diverges: side-by-side trace in {page}"]
    return page


def test_verify_pair_data(tmp_path):
    page = diverging_pair(tmp_path)
    data = trace_html.read(page)
    div = data["divergence"]
    assert (div["block"], div["step"], div["position"]) == (0, 1, 2)
    assert (div["reference_token"], div["mlx_token"]) == (7, 4)
    left, right = data["sides"]
    assert [c["steps"] for c in left["canvases"]] == [3] and [c["steps"] for c in right["canvases"]] == [2]
    assert left["canvases"][0]["records"][1]["pred"] == [5, 6, 7, 9]
    assert right["canvases"][0]["records"][1]["pred"] == [5, 6, 4, 9]
    assert right["canvases"][0]["records"][1]["status"] == "0011"  # vs its own previous step
    assert data["settings"]["reference"] == "PyTorch reference" and data["labels"] == ["PyTorch reference", "MLX"]


@needs_browser
def test_verify_pair_renders_with_the_divergence_marked(tmp_path):
    page = diverging_pair(tmp_path)
    dom, image = chromium(page, tmp_path, (1280, 700))
    assert 'data-rendered="1"' in dom and "First divergence: canvas 1, step 2, position 2." in dom
    assert len(classed(dom, "diverge")) == 2  # the same cell outlined on both sides
    assert len(classed(dom, "differs")) == 2  # and underlined where the two sides disagree
    assert_not_blank(image)


def test_no_page_without_a_divergence(tmp_path):
    same = _stream([1], [[5, 6], [5, 6]], [5, 6])
    family = get_family("llada2_moe")
    # Nothing written, and the note says so (it used to say nothing at all).
    assert write_divergences(tmp_path / "t", tmp_path, family, [same], [same]) == [
        f"--trace-dir {tmp_path / 't'}: no page written: the commit stream agrees with the PyTorch reference "
        "step for step"]
    assert not (tmp_path / "t").exists()
    assert write_divergences(tmp_path / "t", tmp_path, family, None, [same]) == [
        f"--trace-dir {tmp_path / 't'}: no page written: no commit stream was compared with a reference"]
