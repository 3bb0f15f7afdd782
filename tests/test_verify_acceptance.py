"""Commit streams that diverge after an acceptance near-tie: equal argmaxes,
but an earlier step kept positions whose scores tie with ones it did not keep
(random-weight models: every entropy near log V). The check explains such a
divergence in half precision and still fails a real one."""

import numpy as np
import pytest

from dlm.verify import metrics as M
from dlm.verify.checks import check_commit_stream
from dlm.verify.protocol import BlockTrace, CommitStream
from dlm.verify.weights import Precision

HALF = Precision("bfloat16", "bfloat16", None, None)


def _stream(argmax, scores, accept, tokens):
    steps = len(argmax)
    a = np.array(argmax, np.int32)
    ids = np.stack([a, (a + 1) % 50], -1)
    vals = np.tile(np.array([9.0, 1.0], np.float32), (steps, a.shape[1], 1))  # confident: no argmax tie
    block = BlockTrace(tokens, steps, a, ids, vals, np.array(scores, np.float32), np.array(accept, bool))
    return CommitStream([1, 2], [block], "length")


def _pair(scores_ref, scores_mlx):
    # Step 1: the same argmax; the reference keeps position 0, MLX position 1.
    # Step 2: position 2's argmax differs (the canvases did).
    ref = _stream([[3, 4, 5], [3, 4, 6]], [scores_ref, [1, 1, 1]], [[1, 0, 0], [1, 1, 1]], [3, 4, 6])
    mlx = _stream([[3, 4, 5], [3, 4, 7]], [scores_mlx, [1, 1, 1]], [[0, 1, 0], [1, 1, 1]], [3, 4, 7])
    return ref, mlx


def test_an_acceptance_near_tie_explains_the_divergence_in_half_precision():
    ref, mlx = _pair([12.4801, 12.4802, 12.6], [12.4803, 12.4801, 12.6])
    div = M.first_divergence(ref, mlx)
    assert (div.step, div.position) == (1, 2) and not div.near_tie(0.25)
    tie = M.acceptance_tie(ref, mlx, div, 0.25)
    assert tie["step"] == 0 and tie["positions"] == [0, 1] and tie["tied"]
    result = check_commit_stream([ref], [mlx], HALF)
    assert result.status == "pass" and result.metrics["explained_fraction"] == 1.0
    assert "kept different positions" in result.details["first_divergence"]
    # float32 still wants identical streams.
    f32 = check_commit_stream([ref], [mlx], Precision("float32", "float32", None, None))
    assert f32.status == "fail"


def test_a_clear_acceptance_difference_is_not_explained():
    ref, mlx = _pair([11.0, 12.9, 13.0], [12.9, 11.0, 13.0])  # each side kept a clearly lower entropy
    tie = M.acceptance_tie(ref, mlx, M.first_divergence(ref, mlx), 0.25)
    assert tie is not None and not tie["tied"]
    result = check_commit_stream([ref], [mlx], HALF)
    assert result.status == "fail" and result.metrics["explained_fraction"] == 0.0
    assert "not a near-tie" in result.details["first_divergence"]


def test_without_acceptance_records_nothing_is_explained():
    ref, mlx = _pair([12.48, 12.48, 12.6], [12.48, 12.48, 12.6])
    for s in (ref, mlx):
        s.blocks[0].step_scores = s.blocks[0].step_accept = None
    assert M.acceptance_tie(ref, mlx, M.first_divergence(ref, mlx), 0.25) is None
    assert check_commit_stream([ref], [mlx], HALF).status == "fail"


def test_a_divergence_reports_how_the_logit_gap_grew_step_by_step():
    ref, mlx = _pair([12.4801, 12.4802, 12.6], [12.4803, 12.4801, 12.6])
    mlx.blocks[0].topk_logits[0, :, 0] += 1e-4  # step 1: rounding; step 2: the flip
    rows = check_commit_stream([ref], [mlx], HALF).details["prompts"]
    assert rows[0]["step_gaps"][0] == pytest.approx(1e-4, rel=1e-2)
    assert "top-1 logit gap by step 0.0001 → 0" in rows[0]["divergence_text"]
