"""The bundled DiffusionGemma demo is text-only (issue 42): trained on text, its
checkpoint's vision tower is transformers' untrained one and its tokenizer has
no image token. scripts/demo.sh converts it --text-only, so the conversion is a
text-generation model that ``dlm-run serve`` takes without an image warning,
and its cards say so (and that the demos are single-turn)."""

from __future__ import annotations

import json
import re
import shlex

from click.testing import CliRunner

from tests import ROOT

DG = ROOT / "demo" / "diffusion_gemma_sort"


def demo_convert_flags() -> list[str]:
    """The flags scripts/demo.sh gives dlm-convert (its source, -o and output left out)."""
    line = next(ln for ln in (ROOT / "scripts" / "demo.sh").read_text().splitlines()
                if ln.startswith('"${BIN}dlm-convert"'))
    words = shlex.split(line)[2:]
    out = []
    skip = False
    for w in words:
        if skip:
            skip = False
        elif w in ("-o", "--output"):
            skip = True
        else:
            out.append(w)
    return out


def test_demo_is_converted_text_only_and_serves_without_an_image_warning(tmp_path, monkeypatch):
    from dlm.convert.cli import main as convert_main
    from dlm.runtime.cli import serve as serve_cli
    from dlm.runtime.cli.main import main

    flags = demo_convert_flags()
    assert "--text-only" in flags
    out = tmp_path / "demo-4bit"
    r = CliRunner().invoke(convert_main, [str(DG), *flags, "-o", str(out)])
    assert r.exit_code == 0, r.output
    config = json.loads((out / "config.json").read_text())
    assert not config.get("vision_config") and config["dlm"]["text_only"] is True
    card = (out / "README.md").read_text()
    assert re.search(r"^pipeline_tag: text-generation$", card, re.M), card[:400]
    assert "image-text-to-text" not in card

    calls = []
    monkeypatch.setattr(serve_cli, "run_server", lambda app, sock, level: calls.append((app, sock)))
    r = CliRunner().invoke(main, ["serve", "--model", str(out), "--port", "0"])
    assert r.exit_code == 0, r.output
    app, sock = calls.pop()
    app.state.worker.stop()
    sock.close()
    assert "image" not in r.stderr, r.stderr
    assert app.state.server.image_problem in (None, "")


def test_demo_cards_say_text_only_and_single_turn():
    dg = (DG / "README.md").read_text()
    assert "pipeline_tag: text-generation" in dg and "**Text only.**" in dg and "--text-only" in dg
    for card in (dg, (ROOT / "demo" / "llada2_sort" / "README.md").read_text()):
        assert "**Single-turn.**" in card and "dlm-run chat" in card
    # The training scripts write the same cards.
    for script in ("train_diffusion_gemma.py", "train_llada2.py"):
        assert "**Single-turn.**" in (ROOT / "demo" / script).read_text()
    assert "**Text only.**" in (ROOT / "demo" / "train_diffusion_gemma.py").read_text()
