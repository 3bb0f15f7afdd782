"""dlm's independent PyTorch reference for LLaDA2.2 against hand-computed
expectations: block routing (``Gate`` with ``expert_capacity``) and
Levenshtein decoding (``levenshtein_block`` on scripted logits, then
``generate(levenshtein=True)`` on the tiny "v22" checkpoint). The rules are
docs/llada2.md's "dlm's rules" section."""

import math

import pytest
import torch

from dlm.verify.llada2_moe import torch_generate as RG
from dlm.verify.llada2_moe.torch_levenshtein import EditIds, apply_edits, edit_schedule
from dlm.verify.llada2_moe.torch_model import Gate, RefConfig, SparseMoe, load_reference
from tests.builders import LLADA22_EDIT_PROMPTS, LLADA22_EDIT_SETTINGS, build_llada22

torch.set_num_threads(1)


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# ---------------------------------------------------------------------------
# Block routing
# ---------------------------------------------------------------------------


def _gate(experts, k, capacity, block_size, n_group=1, topk_group=1, bias=None) -> Gate:
    """A gate whose router logits are its input (identity weight), so tests write them directly."""
    cfg = RefConfig(vocab_size=8, hidden_size=experts, intermediate_size=8, num_hidden_layers=1,
                    num_attention_heads=1, num_key_value_heads=1, head_dim=experts, moe_intermediate_size=4,
                    num_experts=experts, num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
                    expert_capacity=capacity, block_size=block_size)
    gate = Gate(cfg)
    with torch.no_grad():
        gate.weight.copy_(torch.eye(experts))
        if bias is not None:
            gate.expert_bias.copy_(torch.tensor(bias))
    return gate


def test_bias_changes_selection_but_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    idx, w = _gate(4, 2, 4, 1)(logits)
    assert idx.tolist() == [[0, 1]]
    total = _sig(2) + _sig(1)
    assert w[0].tolist() == pytest.approx([2.5 * _sig(2) / total, 2.5 * _sig(1) / total], rel=1e-6)
    # +1 on expert 3 lifts its selection score (0.27 + 1) above expert 0's 0.88; weights stay bias-free.
    idx, w = _gate(4, 2, 4, 1, bias=[0.0, 0.0, 0.0, 1.0])(logits)
    assert idx.tolist() == [[3, 0]]
    total = _sig(-1) + _sig(2)
    assert w[0].tolist() == pytest.approx([2.5 * _sig(-1) / total, 2.5 * _sig(2) / total], rel=1e-6)


def test_pool_score_is_the_max_over_the_groups_tokens():
    # One group of 4 tokens, pool of 2, top-1. Max pool scores: e0 = e1 = s(3) > e3 = s(2.5),
    # so the pool is {0, 1}; a sum/mean pool would pick e3 (2.5 on every token), and plain
    # token routing sends tokens 2 and 3 to e3.
    logits = torch.tensor([
        [3.0, -5.0, -5.0, 2.5],
        [-5.0, 3.0, -5.0, 2.5],
        [1.0, -5.0, 2.0, 2.5],
        [-5.0, -5.0, -5.0, 2.5],  # e0 and e1 tie inside the pool: the lower index wins
    ])
    idx, w = _gate(4, 1, 2, 4)(logits)
    assert idx.tolist() == [[0], [1], [0], [0]]
    assert w[:, 0].tolist() == pytest.approx([2.5 * _sig(v) for v in (3, 3, 1, -5)], rel=1e-6)
    token_routed, _ = _gate(4, 1, 4, 4)(logits)
    assert token_routed.tolist() == [[0], [1], [3], [3]]


def test_full_capacity_is_plain_topk_without_the_group_limit():
    # Groups of 2 experts, 1 group kept: the 2.0 gate keeps group {0, 1}, plain top-2 is {0, 2}.
    row = [3.0, -3.0, 2.9, -3.0, -1.0, -1.0, -1.0, -1.0]
    logits = torch.tensor([row, row])
    idx, w = _gate(8, 2, 8, 2, n_group=4, topk_group=1)(logits)
    assert idx.tolist() == [[0, 2], [0, 2]]
    total = _sig(3) + _sig(2.9)
    assert w[0].tolist() == pytest.approx([2.5 * _sig(3) / total, 2.5 * _sig(2.9) / total], rel=1e-6)
    group_limited, _ = _gate(8, 2, 0, 2, n_group=4, topk_group=1)(logits)
    assert group_limited.tolist() == [[0, 1], [0, 1]]
    rand = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)) * 2
    idx, _ = _gate(8, 2, 8, 4, n_group=4, topk_group=1)(rand)
    assert idx.tolist() == torch.sigmoid(rand).topk(2, dim=-1).indices.tolist()


def test_groups_never_cross_sequences():
    rand = torch.randn(8, 6, generator=torch.Generator().manual_seed(1)) * 2
    gate = _gate(6, 2, 3, 4)
    idx, w = gate(rand, sequences=2)
    first, second = gate(rand[:4]), gate(rand[4:])
    assert idx.tolist() == first[0].tolist() + second[0].tolist()
    assert torch.equal(w, torch.cat([first[1], second[1]]))
    # 2 x 4 tokens make 8, a whole group of 8, but neither sequence is one: refused.
    with pytest.raises(ValueError, match="4 tokens per sequence.*block_size 8"):
        _gate(6, 2, 3, 8)(rand, sequences=2)
    moe = SparseMoe(_gate(6, 2, 3, 8).cfg)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.eye(6))
    with pytest.raises(ValueError, match="4 tokens per sequence.*block_size 8"):
        moe(rand.reshape(2, 4, 6))
    assert moe(rand.reshape(1, 8, 6)).shape == (1, 8, 6)


def test_token_count_not_a_multiple_of_block_size_raises():
    with pytest.raises(ValueError, match="6 tokens per sequence.*block_size 4"):
        _gate(4, 2, 3, 4)(torch.zeros(6, 4))


# ---------------------------------------------------------------------------
# levenshtein_block on scripted logits (vocabulary of 8: MASK 7, DELETE 5, SPLIT 6)
# ---------------------------------------------------------------------------

V, MASK, DELETE, SPLIT = 8, 7, 5, 6
STRONG = 10.0  # p ~ 0.9997 against six zero logits (MASK suppressed)


class Script:
    """A ``logits_fn`` replaying one ``{position: spec}`` per call: spec is a
    token (STRONG logit) or ``{token: logit}``; an unlisted position predicts
    its current token (token 0 at a MASK) strongly. Records each block it saw."""

    def __init__(self, *calls):
        self.calls, self.blocks = calls, []

    def __call__(self, block):
        self.blocks.append(block.tolist())
        spec = self.calls[len(self.blocks) - 1]
        return torch.stack([self._row(spec.get(i), t) for i, t in enumerate(block.tolist())])

    @staticmethod
    def _row(spec, current):
        if spec is None:
            spec = {0 if current == MASK else current: STRONG}
        elif isinstance(spec, int):
            spec = {spec: STRONG}
        row = torch.zeros(V)
        for tok, logit in spec.items():
            row[tok] = logit
        return row


def _decode(script, block, gen_from=0, **kw):
    trace = []
    settings = dict(steps=4, threshold=0.5, editing_threshold=0.0, max_post_steps=10, max_steps_per_block=100,
                    mask_id=MASK, delete_id=DELETE, split_id=SPLIT, trace=trace)
    out, iterations = RG.levenshtein_block(script, torch.tensor(block), gen_from, **{**settings, **kw})
    return out.tolist(), iterations, [(s, pos, toks) for _, s, pos, toks in trace]


def test_schedule_spreads_ten_masks_over_four_steps():
    assert edit_schedule(10, 4) == [3, 3, 2, 2]
    weak = {i: {i % 5: 0.2 + 0.1 * i} for i in range(10)}  # later positions more confident, all p < 0.99
    out, iterations, trace = _decode(Script(*[weak] * 5), [MASK] * 10, threshold=0.99)
    assert [pos for _, pos, _ in trace] == [[7, 8, 9], [4, 5, 6], [2, 3], [0, 1], []]
    assert out == [i % 5 for i in range(10)] and iterations == 5


# Two masks over 8 steps: schedule [1, 1, 0, ...], so from step 2 on only new masks make M2T write.


def test_delete_shifts_left_and_pads_with_a_mask():
    script = Script({2: 3, 3: 4}, {2: DELETE}, {3: {2: 0.5}}, {})
    out, iterations, trace = _decode(script, [1, 2, MASK, MASK], gen_from=2, steps=8)
    assert trace[1] == (1, [2], [DELETE])
    assert script.blocks[2] == [1, 2, 4, MASK]
    assert trace[2] == (2, [3], [2])  # the pad is filled again although weak (need = 0 + 1 new mask)
    assert out == [1, 2, 4, 2] and iterations == 4
    ids = EditIds(MASK, DELETE, SPLIT)
    block, orig = apply_edits(torch.tensor([1, DELETE, 3, 4]), torch.tensor([1, 2, 3, 4]),
                              torch.tensor([True] * 4), ids)
    assert block.tolist() == [1, 3, 4, MASK] and orig.tolist() == [True, True, True, False]


def test_split_inserts_a_mask_before_the_old_token_and_truncates():
    script = Script({2: 3, 3: 4}, {2: SPLIT}, {2: {0: 0.5}}, {})
    out, iterations, trace = _decode(script, [1, 2, MASK, MASK], gen_from=2, steps=8)
    assert trace[1] == (1, [2], [SPLIT])
    assert script.blocks[2] == [1, 2, MASK, 3]  # the old token 3 is restored, 4 falls off the end
    assert trace[2] == (2, [2], [0])
    assert out == [1, 2, 0, 3] and iterations == 4
    ids = EditIds(MASK, DELETE, SPLIT)
    block, orig = apply_edits(torch.tensor([1, SPLIT, 3, 4]), torch.tensor([1, 2, 3, 4]),
                              torch.tensor([True, True, False, True]), ids)
    assert block.tolist() == [1, MASK, 2, 3] and orig.tolist() == [True, False, True, False]


def test_post_steps_count_only_once_no_original_mask_remains():
    # max_post_steps 2: post stays 0 while original masks remain (calls 0-1), counts 1 at call 2,
    # and the pad left by call 2's DELETE is not original, so call 3 (post 2) is final: its
    # DELETE becomes the best other token (0) and its mask is taken although weak.
    weak = {0: {1: 1.0}, 1: {2: 0.9}, 2: {3: 0.8}, 3: {4: 0.7}}
    script = Script(weak, weak, {0: DELETE}, {0: {DELETE: STRONG, 0: 9.0}, 3: {1: 0.5}}, {})
    out, iterations, trace = _decode(script, [MASK] * 4, steps=2, threshold=0.99, max_post_steps=2)
    assert [pos for _, pos, _ in trace[:2]] == [[0, 1], [2, 3]]
    assert trace[2] == (2, [0], [DELETE])
    assert trace[3] == (3, [0, 3], [0, 1])
    assert out == [0, 3, 4, 1] and iterations == 5


def test_anti_loop_repicks_the_lowest_confidence_changed_position():
    # Call 2 would return to the state written at call 0; position 1 is the less confident
    # change, so its candidate 2 is banned and its next best (0) is written instead.
    script = Script({0: 1, 1: 2}, {0: 3, 1: 4}, {0: {1: STRONG}, 1: {2: 8.0, 0: 7.0}}, {})
    out, iterations, trace = _decode(script, [MASK] * 2, steps=2)
    assert trace[2] == (2, [0, 1], [1, 0])
    assert out == [1, 0] and iterations == 4


def test_the_cap_ends_the_block_with_no_mask_and_no_edit_token():
    weak = {0: {1: 1.0}, 1: {2: 0.5}, 2: {3: 0.4}, 3: {4: 0.3}}
    last = {1: {SPLIT: STRONG, 2: 9.0}, 2: {DELETE: STRONG, 3: 9.0}, 3: {4: 0.3}}
    out, iterations, trace = _decode(Script(weak, last), [MASK] * 4, threshold=0.99, max_steps_per_block=2)
    assert trace == [(0, [0], [1]), (1, [1, 2, 3], [2, 3, 4])]
    assert out == [1, 2, 3, 4] and iterations == 2


def test_prompt_positions_are_never_written():
    seen = []
    script = Script({0: DELETE, 1: SPLIT, 2: 3, 3: 4}, {0: 4, 1: DELETE})
    trace = []
    out, iterations = RG.levenshtein_block(
        script, torch.tensor([1, 2, MASK, MASK]), 2, steps=4, threshold=0.5, editing_threshold=0.0,
        max_post_steps=10, max_steps_per_block=100, mask_id=MASK, delete_id=DELETE, split_id=SPLIT,
        trace=trace, b=2, start=16, on_step=lambda b, s, logits: seen.append((b, s, logits[:, MASK].tolist())))
    assert trace == [(2, 0, [18, 19], [3, 4]), (2, 1, [], [])]
    assert out.tolist() == [1, 2, 3, 4] and iterations == 2
    assert seen == [(2, 0, [0.0] * 4), (2, 1, [0.0] * 4)]  # on_step sees the logits before suppression
    with pytest.raises(ValueError, match="prompt holds"):
        _decode(Script({}), [DELETE, 2, MASK, MASK], gen_from=2)


# ---------------------------------------------------------------------------
# generate(levenshtein=True) on the tiny LLaDA2.2 checkpoint
# ---------------------------------------------------------------------------

GREEDY = dict(temperature=0.0, hub_sampler=False, levenshtein=True)


@pytest.fixture(scope="module")
def v22(tmp_path_factory):
    path = tmp_path_factory.mktemp("llada22")
    return path, build_llada22(path)


def _generate(model, prompt, **kw):
    trace = []
    out = RG.generate(model, torch.tensor(prompt), trace=trace, **{**GREEDY, **LLADA22_EDIT_SETTINGS, **kw})
    return out.tolist(), trace


@pytest.mark.parametrize("prompt", LLADA22_EDIT_PROMPTS, ids=lambda p: f"P{len(p)}")
def test_generate_writes_delete_and_split_and_returns_neither(v22, prompt):
    _, model = v22
    out, trace = _generate(model, prompt)
    written = [t for *_, toks in trace for t in toks]
    s = LLADA22_EDIT_SETTINGS
    assert s["delete_id"] in written and s["split_id"] in written
    assert not {s["mask_id"], s["delete_id"], s["split_id"]} & set(out)
    assert min(pos for _, _, positions, _ in trace for pos in positions) >= len(prompt)
    assert trace[0][0] == len(prompt) // s["block_length"]  # the prompt's last (partial) block comes first
    assert max(step for _, step, _, _ in trace) < 20  # ended by the post-fill budget, far from the cap
    ends = [i for i, t in enumerate(out) if t in s["eos_id"]]
    assert ends in ([], [len(out) - 1])


def test_the_written_checkpoint_decodes_the_same(v22):
    path, model = v22
    prompt = LLADA22_EDIT_PROMPTS[1]
    assert _generate(load_reference(path), prompt) == _generate(model, prompt)


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=0.7), "temperature"),
    (dict(hub_sampler=True), "hub_sampler"),
    (dict(min_threshold=0.1), "min_threshold"),
    (dict(editing_threshold=None), "editing_threshold"),
    (dict(block_length=12), "block_size"),
])
def test_generate_refuses_what_levenshtein_decoding_does_not_take(v22, kw, message):
    with pytest.raises(ValueError, match=message):
        _generate(v22[1], [1, 2, 3], **kw)


def test_generate_refuses_an_edit_token_in_the_prompt(v22):
    with pytest.raises(ValueError, match="prompt holds"):
        _generate(v22[1], [1, LLADA22_EDIT_SETTINGS["split_id"], 3])


def test_the_model_refuses_a_partial_routing_group(v22):
    with pytest.raises(ValueError, match="3 tokens per sequence.*block_size 8"):
        v22[1](torch.tensor([[1, 2, 3]]))
