"""The cross-request prefix cache (dlm.runtime.generation.prefix_cache): a request
served from it gets bit for bit what it gets without it (tokens, steps, stops,
every step's float32 logits), for both families; it is bounded and counted.

The references are runs without the cache. The bitwise comparison can fail: a
prompt prefilled in other chunks gives other logits in the last bits on these
very models (test_chunking_changes_the_bits), so a cache that resumed a prefill
anywhere but at the prompt's own chunk boundaries would be caught."""

from __future__ import annotations

import numpy as np
import pytest

from dlm.runtime import api
from dlm.runtime.generation.prefix_cache import PrefixCache
from dlm.runtime.platform.errors import GenerationError

CHUNK = 8  # --prefill-step-size: the cache's granularity
FAMILIES = {
    "dg": ("tiny_dg_mlx_dir", {"prefill_step_size": CHUNK, "max_tokens": 16, "seed": 3, "max_denoising_steps": 6}),
    "llada": ("tiny_llada2_mlx_dir", {"prefill_step_size": CHUNK, "block_length": 4, "max_tokens": 12,
                                      "seed": 3, "temp": 0.8}),
}
SYSTEM = [int(t) for t in np.random.RandomState(0).randint(5, 200, 37)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request):
    fixture, options = FAMILIES[request.param]
    return request.param, api.load(request.getfixturevalue(fixture)), options


def run(loaded, family, prompt, options, **hooks):
    """(result, every step's float32 logits)."""
    logits = []
    position = -2 if family == "dg" else -1  # DG: on_step(step, logits, argmax); LLaDA: (block, step, logits)
    result = api.generate(loaded, prompt, options,
                          on_step=lambda *a: logits.append(np.array(a[position], dtype=np.float32)), **hooks)
    return result, logits


def assert_same(a, b) -> None:
    (ra, la), (rb, lb) = a, b
    assert ra.token_ids == rb.token_ids
    assert ra.steps_per_block == rb.steps_per_block
    assert ra.finish_reason == rb.finish_reason
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert np.array_equal(x, y)


def boundary(shared: int, length: int, family: str) -> int:
    """Where a prompt of ``length`` tokens sharing ``shared`` with a cached one (that
    has the same chunks there) resumes: its last chunk end within the shared part.
    Its chunks end every CHUNK tokens and at its prefill's end (LLaDA-2: the
    prompt's whole blocks, which are all its prefill covers)."""
    end = length if family == "dg" else length // 4 * 4
    return max([min(end, a + CHUNK) for a in range(0, end, CHUNK) if min(end, a + CHUNK) <= shared], default=0)


def test_chunking_changes_the_bits(model):
    family, loaded, options = model
    prompt = SYSTEM + [7, 8, 9]
    _, a = run(loaded, family, prompt, options)
    _, b = run(loaded, family, prompt, {**options, "prefill_step_size": CHUNK + 4})
    assert any(not np.array_equal(x, y) for x, y in zip(a, b))


def test_shared_system_prompt_hit_is_a_miss(model):
    family, loaded, options = model
    store = PrefixCache(1 << 30)
    for i, question in enumerate([[7, 8, 9, 10], [7, 8, 11], [12, 13, 14, 15, 16]]):
        prompt = SYSTEM + question
        alone = run(loaded, family, prompt, options)
        cached = run(loaded, family, prompt, options, prefix_cache=store)
        assert_same(alone, cached)
        shared = len(SYSTEM) + (1 if i == 1 else 0)  # the second question shares a token more
        assert cached[0].stats.cached_prompt_tokens == (0 if i == 0 else boundary(shared, len(prompt), family))
    stats = store.stats()
    assert stats["lookups"] == 3 and stats["hits"] == 2 and 0 < stats["bytes"] <= stats["limit_bytes"]


def test_conversation_resent_whole(model):
    family, loaded, options = model
    store = PrefixCache(1 << 30)
    first = SYSTEM + [7, 8, 9]
    answer = run(loaded, family, first, options, prefix_cache=store)[0].token_ids
    second = first + answer + [21, 22, 23, 24, 25]
    cached = run(loaded, family, second, options, prefix_cache=store)
    assert_same(run(loaded, family, second, options), cached)
    # the first prompt's whole chunks; its last partial chunk was a forward of another shape
    assert cached[0].stats.cached_prompt_tokens == len(first) // CHUNK * CHUNK
    again = run(loaded, family, second, options, prefix_cache=store)  # the same prompt once more
    assert_same(cached, again)
    whole = len(second) if family == "dg" else len(second) // 4 * 4  # LLaDA-2 prefills whole blocks only
    assert again[0].stats.cached_prompt_tokens == whole


def test_prefix_ending_mid_chunk_and_mid_block(model):
    family, loaded, options = model
    store = PrefixCache(1 << 30)
    run(loaded, family, SYSTEM[:30] + [1, 2, 3, 4, 5, 6], options, prefix_cache=store)
    prompt = SYSTEM[:30] + [9, 9, 9, 9, 9, 9]  # shares 30 tokens: mid-chunk and (block 4) mid-block
    cached = run(loaded, family, prompt, options, prefix_cache=store)
    assert_same(run(loaded, family, prompt, options), cached)
    assert cached[0].stats.cached_prompt_tokens == 24


def test_eviction_under_a_tiny_budget(model):
    family, loaded, options = model
    probe = PrefixCache(1 << 30)
    run(loaded, family, SYSTEM[:CHUNK], options, prefix_cache=probe)
    one = probe.stats()["bytes"]  # one chunk's segment
    store = PrefixCache(3 * one)
    prompts = [[t + k for t in SYSTEM[:16]] for k in range(3)]  # no shared prefix: 2 chunks each
    for prompt in prompts:
        assert_same(run(loaded, family, prompt, options), run(loaded, family, prompt, options, prefix_cache=store))
        assert store.stats()["bytes"] <= 3 * one
    stats = store.stats()
    assert stats["evictions"] >= 2 and stats["segments"] <= 3
    # the latest prompt's chunks stayed (least recently used leaves went first), and still serve it
    again = run(loaded, family, prompts[-1], options, prefix_cache=store)
    assert again[0].stats.cached_prompt_tokens == 16
    assert_same(run(loaded, family, prompts[-1], options), again)
    small = PrefixCache(one - 1)  # nothing fits: every request runs in full, unchanged
    assert_same(run(loaded, family, prompts[0], options), run(loaded, family, prompts[0], options, prefix_cache=small))
    assert small.stats()["bytes"] == 0


def test_cancelled_request_leaves_the_entry_whole(model):
    family, loaded, options = model
    store = PrefixCache(1 << 30)
    calls = []
    cancelled = api.generate(loaded, SYSTEM + [7], options, cancel=lambda: calls.append(1) or len(calls) > 2,
                             prefix_cache=store)
    assert cancelled.finish_reason == "cancelled"
    prompt = SYSTEM + [8, 9]
    cached = run(loaded, family, prompt, options, prefix_cache=store)
    assert cached[0].stats.cached_prompt_tokens == boundary(len(SYSTEM), len(prompt), family)
    assert_same(run(loaded, family, prompt, options), cached)


def test_refusals(model, tiny_dg_mlx_dir, tiny_llada2_mlx_dir):
    family, loaded, options = model
    store = PrefixCache(1 << 30)
    run(loaded, family, SYSTEM, options, prefix_cache=store)
    other = api.load(tiny_llada2_mlx_dir if family == "dg" else tiny_dg_mlx_dir)
    with pytest.raises(GenerationError, match="another model"):
        api.generate(other, SYSTEM, {"max_tokens": 4}, prefix_cache=store)
    from dlm.runtime.generation.progress import PrefixState

    with pytest.raises(GenerationError, match="cannot both"):
        api.generate(loaded, SYSTEM, options, prefix=PrefixState(), prefix_cache=store)
    off = PrefixCache(0)  # 0 turns it off
    assert run(loaded, family, SYSTEM, options, prefix_cache=off)[0].stats.cached_prompt_tokens == 0
    assert off.stats()["lookups"] == 0


def test_images_keyed_by_content(tiny_dg_vision_mlx_dir, tmp_path):
    from PIL import Image

    loaded = api.load(tiny_dg_vision_mlx_dir)
    options = {"prefill_step_size": CHUNK, "max_tokens": 8, "seed": 5, "max_denoising_steps": 6}
    pictures = []
    for i, color in enumerate([(200, 30, 30), (30, 200, 30)]):
        path = tmp_path / f"{i}.png"
        Image.new("RGB", (40, 32), color).save(path)
        pictures.append(str(path))

    def prompt(image, text):
        return api.encode_inputs(loaded, messages=[
            {"role": "system", "content": "You describe pictures carefully and briefly, always."},
            {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}])

    store = PrefixCache(1 << 30)
    first = prompt(pictures[0], "What is this?")
    run(loaded, "dg", first, options, prefix_cache=store)
    at = first.ids.index(loaded.args.image_token_id)
    for image, text, cached in [(pictures[0], "Which colour?", None), (pictures[1], "What is this?", at)]:
        p = prompt(image, text)
        got = run(loaded, "dg", p, options, prefix_cache=store)
        assert_same(run(loaded, "dg", p, options), got)
        if cached is None:  # the same image: served past it
            assert got[0].stats.cached_prompt_tokens > at + sum(i.soft_tokens for i in p.images) - CHUNK
        else:  # another image with the same placeholder ids: the prefix ends before it (mid-image)
            assert got[0].stats.cached_prompt_tokens <= cached


def test_requests_in_one_batch_share_the_prefix(model):
    family, loaded, options = model
    prompts = [SYSTEM + [7 + i, 8, 9] for i in range(4)]
    opts = [{**options, "seed": 10 + i} for i in range(4)]
    store = PrefixCache(1 << 30)
    together = api.generate_batch(loaded, prompts, opts, max_batch=4, prefix_cache=store)
    for prompt, o, got in zip(prompts, opts, together):
        alone = api.generate(loaded, prompt, o)
        assert (got.token_ids, got.steps_per_block, got.finish_reason) == \
            (alone.token_ids, alone.steps_per_block, alone.finish_reason)
    # admitted one after the other in the first step: the first stores, the others find its chunks
    assert [r.stats.cached_prompt_tokens for r in together] == \
        [0] + [boundary(len(SYSTEM), len(prompts[0]), family)] * 3


def test_server_reports_cached_tokens(tiny_llada2_mlx_dir, serving):
    import openai

    from dlm.runtime.server.app import create_app

    loaded = api.load(tiny_llada2_mlx_dir)
    defaults = {"max_tokens": 8, "block_length": 4, "prefill_step_size": CHUNK}
    system = "You are a terse assistant. " * 12
    answers = {}
    for gb, batch in ((0, 4), (1, 4), (1, 1)):  # off; the batching worker; the serial one
        app = create_app(loaded, defaults, max_batch=batch, prefix_cache_gb=gb)
        with serving(app) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0, timeout=60)
            got = []
            for question in ("Name a colour.", "Name a fruit."):
                messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
                r = client.chat.completions.create(model="m", messages=messages, seed=1)
                got.append((r.choices[0].message.content, r.usage.prompt_tokens,
                            r.usage.prompt_tokens_details.cached_tokens))
            health = openai.DefaultHttpxClient().get(base + "/health").json()
        answers[gb, batch] = got
        if gb == 0:
            assert health["prefix_cache"] is None and [c for *_, c in got] == [0, 0]
        else:
            assert health["prefix_cache"]["hits"] == 1 and health["prefix_cache"]["bytes"] > 0
    ids = [api.encode_prompt(loaded, messages=[{"role": "system", "content": system},
                                               {"role": "user", "content": q}])
           for q in ("Name a colour.", "Name a fruit.")]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    for batch in (4, 1):
        assert [c for *_, c in answers[1, batch]] == [0, boundary(shared, len(ids[1]), "llada")]
        assert [a[:2] for a in answers[0, 4]] == [a[:2] for a in answers[1, batch]]  # the same answers


def test_prompts_file_shares_prefills(tiny_llada2_mlx_dir, tmp_path):
    import json

    from click.testing import CliRunner

    from dlm.runtime.cli.main import main

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": SYSTEM + [7 + i, 8], "seed": i}) + "\n" for i in range(3)))
    outputs = {}
    for gb in ("0", "1"):
        out = tmp_path / f"out{gb}.jsonl"
        r = CliRunner().invoke(main, ["generate", "--model", str(tiny_llada2_mlx_dir), "--prompts-file", str(path),
                                      "-o", str(out), "--max-tokens", "8", "--block-length", "4",
                                      "--prefill-step-size", str(CHUNK), "--prefix-cache-gb", gb, "--profile"])
        assert r.exit_code == 0, r.output
        outputs[gb] = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
        served = f"Prefix cache: {2 * boundary(len(SYSTEM) + 1, len(SYSTEM) + 2, 'llada')} of 117 prompt tokens"
        assert (served in r.output) == (gb == "1"), r.output
    assert outputs["0"] == outputs["1"]
    r = CliRunner().invoke(main, ["generate", "--model", str(tiny_llada2_mlx_dir), "--prompt", "hi",
                                  "--prefix-cache-gb", "1"])
    assert r.exit_code != 0 and "--prefix-cache-gb takes effect only with --prompts-file" in r.output
