"""What a newcomer sees on a terminal (issue 42): ``--verbose`` keeps the answer
one readable string, the first ``--profile`` says it includes warm-up."""

from __future__ import annotations

import io
import sys

import pytest

from dlm.runtime import api
from dlm.runtime.cli import console
from dlm.runtime.cli.main import _stream


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("fixture, extra", [("tiny_dg_mlx_dir", {}),
                                            ("tiny_llada2_mlx_dir", {"block_length": 4})])
def test_verbose_on_a_terminal_prints_the_answer_in_one_piece(request, monkeypatch, fixture, extra):
    """stdout and stderr on one terminal: the step display redraws its line in
    place, the committed text comes after it, whole (it used to land on the
    step lines, a piece per canvas)."""
    loaded = api.load(request.getfixturevalue(fixture))
    terminal = FakeTTY()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    ids = api.encode_prompt(loaded, "Give me JSON.")
    options = {"max_tokens": 12, "max_denoising_steps": 3, "seed": 5, "temp": 1.0,
               "skip_special_tokens": False, **extra}
    view = console.live_view(loaded)
    assert view.tty
    run = _stream(loaded, ids, options, view=view, trace=None, response_format=None, logprobs=None, echo=True)
    answer = "".join(run.text)
    assert len([n for n in run.blocks if n]) >= 2 and answer.strip(), run.blocks  # several commits
    shown = terminal.getvalue()
    assert answer in shown
    # After the last step line's end, nothing but the answer.
    assert shown.endswith("\n" + answer)


def test_live_view_writes_through_when_the_answer_is_not_on_the_terminal(monkeypatch):
    terminal, piped = FakeTTY(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", piped)
    monkeypatch.setattr(sys, "stderr", terminal)

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "x"

    view = console.LiveView(Tok(), "canvas", stream=terminal)
    view(0, 0, [1, 2])
    view.echo("answer")  # stdout is a pipe: streamed now
    assert piped.getvalue() == "answer"
    view.echo("thinking", err=True)  # on the view's terminal: held
    assert "thinking" not in terminal.getvalue()
    view.close()
    assert terminal.getvalue().endswith("\nthinking")


def test_chat_profile_marks_the_first_turn_as_warm_up(tiny_llada2_mlx_dir):
    from click.testing import CliRunner

    from dlm.runtime.cli.main import main

    r = CliRunner().invoke(main, ["chat", "--model", str(tiny_llada2_mlx_dir), "--max-tokens", "4",
                                  "--block-length", "4", "--max-denoising-steps", "2", "--profile"],
                           input="hi\nhello\n")
    assert r.exit_code == 0, r.output
    warm = [ln for ln in r.stderr.splitlines() if ln.startswith("Warm-up:")]
    assert len(warm) == 1 and "first turn" in warm[0]
    assert len([ln for ln in r.stderr.splitlines() if ln.startswith("Prompt:")]) == 2
