"""The demo task module (demo/task.py): examples, answers, held-out split."""

from __future__ import annotations

import random

import pytest

from demo import task as demo_task


def test_answer_and_checker():
    assert demo_task.answer_text("31415") == "11345"
    assert demo_task.is_correct("31415", " 11345\n")
    assert not demo_task.is_correct("31415", "1345")
    assert not demo_task.is_correct("31415", "113455")
    assert demo_task.digits_of(demo_task.prompt_text("907")) == "907"
    with pytest.raises(ValueError):
        demo_task.digits_of("reverse 123")


def test_heldout_is_fixed_balanced_and_excluded_from_training():
    a = demo_task.heldout_set(200)
    assert a == demo_task.heldout_set(200)
    assert len(set(a)) == 200
    lengths = {len(d) for d in a}
    assert lengths == set(range(demo_task.MIN_DIGITS, demo_task.MAX_DIGITS + 1))
    assert all(demo_task.in_heldout(d) for d in a)
    rng = random.Random(0)
    drawn = [demo_task.sample_digits(rng) for _ in range(2000)]
    assert any(demo_task.in_heldout(d) for d in drawn)  # short lists collide: training must skip them
    assert demo_task.MIN_DIGITS <= min(map(len, drawn)) and max(map(len, drawn)) <= demo_task.MAX_DIGITS


def test_answers_span_several_canvases():
    # answer + end token in canvases of 8: 1, 2 and 3 canvases all occur
    blocks = {demo_task.num_blocks(d, 8) for d in demo_task.heldout_set(200)}
    assert blocks == {1, 2, 3}
    assert demo_task.num_blocks("1234567", 8) == 1 and demo_task.num_blocks("12345678", 8) == 2
