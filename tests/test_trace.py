"""``--trace``: the recorder behind the HTML view, on DiffusionGemma's real
denoising loop with hand-made logits, and the page it writes."""

from __future__ import annotations

import numpy as np
import mlx.core as mx
import pytest

from dlm.runtime.trace import html as trace_html
from dlm.runtime.models.diffusion_gemma import canvas as C
from dlm.runtime.models.diffusion_gemma import sampling as S
from dlm.runtime.models.diffusion_gemma.trace import CanvasTracer
from dlm.runtime.trace import ACCEPTED, KEPT, RENOISED, REVEALED, STATUS_NAMES, Trace

V, L = 32, 8
TARGET = [(3 * i + 1) % V for i in range(L)]


def sure(positions=range(L)):
    """A decoder certain of TARGET at ``positions`` and flat (all logits 0) elsewhere."""
    logits = np.zeros((1, L, V), np.float32)
    for i in positions:
        logits[0, i, :] = -30.0
        logits[0, i, TARGET[i]] = 30.0
    return lambda canvas, sc: mx.array(logits)


def noisy(seed=0):
    """A decoder whose logits change at random every step (never stable)."""
    rng = np.random.default_rng(seed)
    return lambda canvas, sc: mx.array(rng.normal(0, 3, (1, L, V)).astype(np.float32))


def traced(decode, config, seed=0):
    """The canvas denoised twice from the same draws, with and without a trace."""
    trace = Trace()
    tracer = CanvasTracer(trace, 0, L, config)
    result = C.denoise_canvas(decode, C.RandomDraws(V, seed), L, config, on_summary=tracer)
    tracer.finish(result)
    plain = C.denoise_canvas(decode, C.RandomDraws(V, seed), L, config)
    return trace.canvases[0], result, plain


def codes(record) -> list[int]:
    return [int(c) for c in record["status"]]


def test_stable_and_confident_canvas():
    canvas, result, plain = traced(sure(), C.DenoiseConfig(steps=10))
    # Tracing changes nothing: same commit, same number of steps.
    assert np.array_equal(np.array(result.tokens), np.array(plain.tokens)) and result.steps == plain.steps == 2
    assert canvas["steps"] == result.steps and canvas["stop_reason"] == "stable-and-confident"
    assert canvas["records"][-1]["pred"] == TARGET == np.array(result.tokens)[0].tolist()
    first, last = canvas["records"]
    assert codes(last) == [ACCEPTED] * L  # entropy ~0 everywhere: every position accepted
    assert last["stable_confident"] is True and first.get("stable_confident") is None  # no history at step 1
    assert max(last["entropy"]) < 1e-3 and last["mean_entropy"] < 0.005
    # The schedule: T(step) runs t_max -> t_min over the budget (float32, rounded to 3 digits).
    assert first["schedule"] == pytest.approx(float(S.linear_temperature(10, 10, 0.4, 0.8)), rel=1e-3)
    assert last["schedule"] == pytest.approx(float(S.linear_temperature(9, 10, 0.4, 0.8)), rel=1e-3)


def test_step_budget_and_renoised_positions():
    config = C.DenoiseConfig(steps=4, temperature=0.0)
    canvas, result, plain = traced(noisy(), config)
    assert result.steps == 4 and not result.stopped_early
    assert canvas["stop_reason"] == "step-budget" and canvas["steps"] == 4
    for record in canvas["records"]:
        status = codes(record)
        assert set(status) == {ACCEPTED, RENOISED}  # high entropy: most positions re-drawn
        # The sampler's own rule: the lowest-entropy positions whose sum stays under the bound.
        want = np.array(S.entropy_bound_accept(mx.array(np.array(record["entropy"], np.float32)),
                                               config.entropy_bound))
        assert [s == ACCEPTED for s in status] == want.tolist()
        assert record["temperature"] == 0.0  # argmax sampling: temp 0 on top of the schedule


def test_confidence_threshold_reveals_and_keeps():
    config = C.DenoiseConfig(steps=12, sampler=S.CONFIDENCE_THRESHOLD, threshold=0.9)
    canvas, result, plain = traced(sure(range(0, L, 2)), config)
    # Step 1 reveals the four sure positions; then one flat position per step (the fallback).
    assert result.steps == plain.steps == 5 and result.stopped_early
    assert canvas["stop_reason"] == "all-revealed"
    first, second = codes(canvas["records"][0]), codes(canvas["records"][1])
    assert first == [REVEALED if i % 2 == 0 else RENOISED for i in range(L)]
    assert [s for i, s in enumerate(second) if i % 2 == 0] == [KEPT] * (L // 2)
    assert second.count(REVEALED) == 1 and second.count(RENOISED) == L // 2 - 1
    assert codes(canvas["records"][-1]).count(RENOISED) == 0
    conf = canvas["records"][0]["confidence"]
    assert min(conf[0::2]) > 0.99 and max(conf[1::2]) == pytest.approx(1 / V, rel=1e-2)


def test_no_summary_is_built_without_a_trace(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a step summary was built without a trace")

    monkeypatch.setattr(C, "summarise_step", forbidden)
    result = C.denoise_canvas(sure(), C.RandomDraws(V, 0), L, C.DenoiseConfig(steps=3))
    assert result.steps == 2
    with pytest.raises(AssertionError, match="without a trace"):
        C.denoise_canvas(sure(), C.RandomDraws(V, 0), L, C.DenoiseConfig(steps=3), on_summary=lambda s, x: None)


def test_cancel_before_the_first_step():
    trace = Trace()
    tracer = CanvasTracer(trace, 0, L, C.DenoiseConfig())
    result = C.denoise_canvas(sure(), C.RandomDraws(V, 0), L, C.DenoiseConfig(), cancel=lambda: True,
                              on_summary=tracer)
    tracer.finish(result)
    assert trace.canvases[0]["stop_reason"] == "cancelled" and trace.canvases[0]["steps"] == 0


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids)


def test_page_is_self_contained_and_its_data_reads_back(tmp_path):
    trace = Trace()
    trace.begin(0, 3)
    hostile = "</script><img src=x onerror=alert(1)>&amp;"
    trace.step([1, 2, 3], [ACCEPTED, RENOISED, ACCEPTED], entropy=[0.01, 5.0, float("nan")], temperature=0.5)
    trace.end("step-budget")
    data = trace.to_dict(CharTokenizer(), title=hostile, settings={"note": hostile})
    path = trace_html.write(tmp_path / "t.html", data)
    page = path.read_text()
    assert trace_html.read(path) == data  # NaN became null; everything else unchanged
    assert data["canvases"][0]["records"][0]["entropy"] == [0.01, 5.0, None]
    assert data["vocab"] == {"1": "b", "2": "c", "3": "d"} and data["status_names"] == STATUS_NAMES
    assert "<img" not in page and "</script><" not in page  # escaped in the title, \u003c in the JSON
    plain = trace_html.render(Trace().to_dict(title="t"))
    for external in ("http://", "https://", "<link", "@import", "url(", " src=", "<iframe"):
        assert external not in plain, external
    assert plain.count("<script") == 2  # the data block and the inline viewer


def test_unknown_stop_reason_is_refused():
    trace = Trace()
    trace.begin(0, 1)
    with pytest.raises(ValueError, match="unknown stop reason"):
        trace.end("tired")


def test_big_canvas_stays_small():
    """256 positions x 48 steps over a 262144-token vocabulary, every prediction
    a different random token (the worst case for the embedded vocabulary)."""
    rng = np.random.default_rng(0)
    trace = Trace()
    trace.begin(0, 256)
    for _ in range(48):
        accept = rng.random(256) < 0.5
        trace.step(rng.integers(0, 262144, 256), np.where(accept, ACCEPTED, RENOISED),
                   entropy=rng.random(256) * 12, schedule=0.6, temperature=0.6, mean_entropy=6.0)
    trace.end("step-budget")
    data = trace.to_dict(CharTokenizer())
    size = len(trace_html.render(data).encode())
    assert len(data["vocab"]) > 10000
    assert size < 600_000, size  # measured: about 0.37 MB


def test_labels_name_only_the_ids_shown_and_after_ids_are_decoded():
    """A per-trace label (LLaDA2.2's DELETE/SPLIT) replaces the tokenizer's text of
    an id the trace shows; ids of a step's ``after`` block and ``replaced`` tokens
    are decoded too; a trace without them keeps its records as they were."""
    trace = Trace()
    trace.labels.update({7: "\u232bDELETE", 8: "\u2380SPLIT"})
    trace.begin(0, 3)
    trace.step([1, 7, 3], [REVEALED, KEPT, KEPT], after=[1, 3, 4], replaced=[(1, 5)])
    trace.step([1, 3, 4], [KEPT, KEPT, KEPT])
    trace.end("step-budget")
    data = trace.to_dict(CharTokenizer())
    assert data["vocab"] == {"1": "b", "3": "d", "4": "e", "5": "f", "7": "\u232bDELETE"}
    first, second = data["canvases"][0]["records"]
    assert first["after"] == [1, 3, 4] and first["replaced"] == [[1, 5]]
    assert set(second) == {"pred", "status"}
