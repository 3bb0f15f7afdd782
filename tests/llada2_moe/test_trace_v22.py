"""``--trace`` on LLaDA2.2's Levenshtein decoding: a step shows the block with
its writes before the DELETE/SPLIT scan ("deleted" / "inserted" statuses),
records the block the scan shifted (``after``), and names why each block
stopped (settled, post-fill budget, iteration cap)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from dlm.runtime import api
from dlm.runtime import trace as T
from dlm.runtime.models.llada2_moe.levenshtein import Rules, scan
from dlm.runtime.models.llada2_moe.trace import (DELETE_LABEL, LLADA22_STATUS_NAMES, LLADA_STATUS_NAMES,
                                                 SPLIT_LABEL, BlockTracer)
from dlm.runtime.trace import (DELETED, EDITED, FIXED, INSERTED, KEPT, MASKED, REVEALED, STOP_REASONS, Trace)
from dlm.runtime.trace import html as trace_html
from tests.builders import (LLADA2_MASK_ID, LLADA22_DELETE_ID, LLADA22_EDIT_PROMPTS, LLADA22_SPLIT_ID, build_llada22,
                            convert_dir)

MASK, DELETE, SPLIT = LLADA2_MASK_ID, LLADA22_DELETE_ID, LLADA22_SPLIT_ID
BL, GEN_FROM = 8, 2
RULES = Rules(mask_id=MASK, delete_id=DELETE, split_id=SPLIT, steps=4, threshold=0.5, editing_threshold=0.0,
              max_post_steps=2, max_steps_per_block=5)


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids)


def fake_session(trace: Trace, rules=RULES):
    """What BlockTracer reads of a generate.BlockSession."""
    s = SimpleNamespace(step_trace=trace, threshold=0.5, min_threshold=None, temperature=0.0,
                        mask_token_id=MASK, step_threshold=lambda step, steps: 0.5)
    return SimpleNamespace(s=s, rules=rules, first_block=0, bl=BL, steps=4, editing=None if rules is None else 0.0)


def iterate(tracer: BlockTracer, step: int, before, orig, new, write, edit):
    """One iteration as levenshtein.decode_block reports it: ``new`` and the masks
    aligned before the scan, the block the real scan shifted after. Returns (block, orig)."""
    new, write, edit = np.array(new), np.array(write, bool), np.array(edit, bool)
    after, orig = scan(new, np.array(before), orig, RULES)
    conf = np.linspace(0.5, 0.9, BL).astype(np.float32)
    tracer.step(step, write, new, conf, after, edit)
    return after, orig


def two_iterations(tracer: BlockTracer):
    """A fill, then an iteration writing DELETE at 2, SPLIT at 4, an edit at 5 and a fill at 6."""
    entry = np.array([5, 6] + [MASK] * 6)
    orig = np.arange(BL) >= GEN_FROM
    block, orig = iterate(tracer, 0, entry, orig, [5, 6, 10, 11, 12, 13, MASK, MASK],
                          [0, 0, 1, 1, 1, 1, 0, 0], [0] * 8)
    return iterate(tracer, 1, block, orig, [5, 6, DELETE, 11, SPLIT, 14, 20, MASK],
                   [0, 0, 1, 0, 1, 1, 1, 0], [0, 0, 1, 0, 1, 1, 0, 0])


def codes(record) -> list[int]:
    return [int(c) for c in record["status"]]


def test_a_delete_and_a_split_step():
    trace = Trace("block", "LLaDA-2")
    tracer = BlockTracer(fake_session(trace), 0, 0, GEN_FROM, BL)
    block, _ = two_iterations(tracer)
    first, second = trace.canvases[0]["records"]
    assert codes(first) == [FIXED, FIXED, REVEALED, REVEALED, REVEALED, REVEALED, MASKED, MASKED]
    # The step shows the writes where they were made, DELETE and SPLIT included.
    assert second["pred"] == [5, 6, DELETE, 11, SPLIT, 14, 20, MASK]
    assert codes(second) == [FIXED, FIXED, DELETED, KEPT, INSERTED, EDITED, REVEALED, MASKED]
    # After the scan: 10 dropped (left shift), a mask before 12 (what SPLIT overwrote), the end cut.
    assert second["after"] == block.tolist() == [5, 6, 11, MASK, 12, 14, 20, MASK]
    assert second["replaced"] == [[2, 10], [4, 12], [5, 13]]  # the tokens the writes replaced (no masks)
    assert "replaced" not in first  # fills replace masks only
    # Nothing is held: the shown tokens are the block itself, aligned before the scan.
    assert "held" not in first and "held" not in second
    canvas = trace.canvases[0]
    assert (canvas["mask_id"], canvas["iteration_cap"], canvas["max_post_steps"]) == (MASK, 5, 2)
    data = trace.to_dict(CharTokenizer())
    assert data["status_names"] == LLADA22_STATUS_NAMES
    assert [data["status_names"][c] for c in (DELETED, INSERTED)] == ["deleted", "inserted"]
    assert data["vocab"][str(DELETE)] == DELETE_LABEL == "\u232bDELETE"
    assert data["vocab"][str(SPLIT)] == SPLIT_LABEL == "\u2380SPLIT"
    assert data["vocab"]["10"] == "k" and data["vocab"][str(MASK)] == "v"  # the rest: the tokenizer's text


def test_the_page_reads_back_and_names_the_new_statuses(tmp_path):
    trace = Trace("block", "LLaDA-2")
    tracer = BlockTracer(fake_session(trace), 0, 0, GEN_FROM, BL)
    two_iterations(tracer)
    tracer.finish(None, 2, False)
    data = trace.to_dict(CharTokenizer())
    path = trace_html.write(tmp_path / "v22.html", data)
    assert trace_html.read(path) == data
    page = path.read_text()
    assert ".tok.st-deleted" in page and ".tok.st-inserted" in page and "after the shift" in page


@pytest.mark.parametrize("case", ["settled", "cap", "post-fill"])
def test_stop_reasons(case):
    """apply()'s end tests: the block came back unchanged with no mask; the cap; else the post-fill budget."""
    trace = Trace("block", "LLaDA-2")
    tracer = BlockTracer(fake_session(trace), 0, 0, GEN_FROM, BL)
    block, orig = two_iterations(tracer)
    filled = np.where(block == MASK, 30, block)
    block, orig = iterate(tracer, 2, block, orig, filled, block == MASK, [0] * 8)
    steps = 3
    if case == "settled":
        iterate(tracer, 3, block, orig, block, [0] * 8, [0] * 8)
        steps = 4
    elif case == "cap":
        steps = RULES.max_steps_per_block
    tracer.finish(None, steps, False)
    reason = trace.canvases[0]["stop_reason"]
    assert reason == {"settled": "block-settled", "cap": "iteration-cap", "post-fill": "post-fill-budget"}[case]
    assert reason in STOP_REASONS


def test_llada20_blocks_keep_their_format():
    """Without rules (2.0/2.1) the statuses, names and records are what they were."""
    import mlx.core as mx

    trace = Trace("block", "LLaDA-2")
    tracer = BlockTracer(fake_session(trace, rules=None), 0, 0, GEN_FROM, BL)
    tok = mx.array([5, 6, 7, 8, 9, 10, 11, 12])
    block = mx.array([5, 6, 7, 8, MASK, MASK, MASK, MASK])
    write = mx.array([False, False, True, True, False, False, False, False])
    tracer.step(0, write, tok, mx.ones(BL), block, None)
    tracer.finish(block, 1, False)
    canvas = trace.canvases[0]
    assert trace.status_names == LLADA_STATUS_NAMES and trace.labels == {}
    assert set(canvas["records"][0]) == {"pred", "status", "confidence", "temperature", "threshold"}
    assert codes(canvas["records"][0]) == [FIXED, FIXED, REVEALED, REVEALED] + [MASKED] * 4
    assert "mask_id" not in canvas and canvas["stop_reason"] == "eos"


# -- end to end: a tiny LLaDA2.2 checkpoint whose decoding writes DELETE and SPLIT ----------

OPTIONS = {"max_tokens": 16, "block_length": 8, "max_denoising_steps": 8}


@pytest.fixture(scope="module")
def v22(tmp_path_factory):
    root = tmp_path_factory.mktemp("v22")
    build_llada22(root / "src")
    return api.load(convert_dir(root / "src", root / "mlx"))


def traced(loaded, prompt, **options):
    trace = T.for_run(loaded)
    events = list(trace.follow(api.stream_generate(loaded, prompt, {**OPTIONS, **options}, step_trace=trace)))
    return T.run_data(trace, loaded, {**OPTIONS, **options}, prompt, []), events[-1]


def test_end_to_end_trace_shows_the_shifts(v22, tmp_path):
    prompt = LLADA22_EDIT_PROMPTS[2]
    data, last = traced(v22, prompt)
    assert data["status_names"] == LLADA22_STATUS_NAMES and last.finish_reason == data["finish_reason"]
    assert data["token_ids"] == [t for c in data["canvases"] for t in c["committed"]]
    rules = Rules(mask_id=MASK, delete_id=DELETE, split_id=SPLIT, steps=8, threshold=0.5, editing_threshold=0.0,
                  max_post_steps=16, max_steps_per_block=1000)
    statuses = set()
    for canvas in data["canvases"]:
        lo = canvas["output_from"]
        assert canvas["mask_id"] == MASK
        before = np.array([MASK] * BL)
        before[:lo] = canvas["records"][0]["pred"][:lo]
        orig = np.arange(BL) >= lo
        for record in canvas["records"]:
            statuses.update(codes(record))
            # ``after`` is the real scan of what the step shows, over the block it found.
            after, orig = scan(np.array(record["pred"]), before, orig, rules)
            assert record["after"] == after.tolist()
            before = after
        assert before[lo: lo + len(canvas["committed"])].tolist() == canvas["committed"]
        # The random model edits at every iteration: never settled, and far from the cap of 1000.
        assert canvas["stop_reason"] == "post-fill-budget"
    assert {DELETED, INSERTED, EDITED, REVEALED} <= statuses
    assert data["vocab"][str(DELETE)] == DELETE_LABEL and data["vocab"][str(SPLIT)] == SPLIT_LABEL
    page = trace_html.write(tmp_path / "v22.html", data)
    assert trace_html.read(page) == data


@pytest.mark.parametrize("options, reason", [({"max_steps_per_block": 3}, "iteration-cap"),
                                             ({"editing_threshold": 1.0}, "block-settled")])
def test_end_to_end_stop_reasons(v22, options, reason):
    data, _ = traced(v22, LLADA22_EDIT_PROMPTS[0], **options)
    assert {c["stop_reason"] for c in data["canvases"]} == {reason}
    if reason == "iteration-cap":
        assert all(c["steps"] == 3 for c in data["canvases"])
