"""dlm-run serve with a tiny converted LLaDA-2 MoE: same routes, per-block streaming,
LLaDA-2's own controls as extra body fields, DiffusionGemma-only fields and images refused."""

from __future__ import annotations

import httpx
import openai
import pytest

from dlm.convert.pipeline import ConvertOptions, convert
from dlm.runtime import api
from dlm.runtime.server.app import create_app
from tests.builders import build_llada2

DEFAULTS = {"max_tokens": 8, "block_length": 4, "max_denoising_steps": 4}
MSGS = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_llada2")
    build_llada2(root / "hf", "base")
    convert(ConvertOptions(source=str(root / "hf"), output=str(root / "tiny-llada2"), progress=False),
            echo=lambda s: None)
    return api.load(root / "tiny-llada2")


@pytest.fixture(scope="module")
def served(llada, serving):
    app = create_app(llada, DEFAULTS, queue_size=2)
    with serving(app) as base:
        yield base, app.state.worker


def reference(worker, loaded, options, messages=None, prompt=None):
    assert worker.wait_idle(30)
    ids = (api.encode_prompt(loaded, messages=messages) if messages is not None
           else api.encode_prompt(loaded, prompt=prompt, chat_template=False))
    return ids, list(api.stream_generate(loaded, ids, {**DEFAULTS, **options}))


def test_chat_and_block_streaming_match_the_runtime(served, llada):
    base, worker = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    controls = {"block_length": 8, "threshold": 0.5, "max_denoising_steps": 6}
    r = client.chat.completions.create(model="m", messages=MSGS, seed=3, max_tokens=16,
                                       temperature=0.7, extra_body=controls)
    ids, events = reference(worker, llada, {"seed": 3, "max_tokens": 16, "temp": 0.7, **controls},
                            messages=MSGS)
    assert r.choices[0].message.content == "".join(e.text for e in events)
    assert r.choices[0].finish_reason == events[-1].finish_reason
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == events[-1].stats.completion_tokens
    assert r.model_extra["timings"]["steps_per_block"] == events[-1].stats.steps_per_block

    # (seed 2 at temperature 0.7 runs past the first block before EOS on this tiny model)
    chunks = list(client.chat.completions.create(model="m", messages=MSGS, seed=2, max_tokens=16,
                                                 temperature=0.7, stream=True,
                                                 stream_options={"include_usage": True}))
    _, events = reference(worker, llada, {"seed": 2, "max_tokens": 16, "temp": 0.7}, messages=MSGS)
    blocks = [e.text for e in events if e.text]
    assert len(blocks) >= 2
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert content == blocks  # one chunk per committed block, in order
    assert chunks[-1].usage.completion_tokens == events[-1].stats.completion_tokens


def test_completions_match_the_runtime(served, llada):
    base, worker = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    r = client.completions.create(model="m", prompt="Red, green and", seed=1, max_tokens=8)
    _, events = reference(worker, llada, {"seed": 1, "max_tokens": 8}, prompt="Red, green and")
    assert r.choices[0].text == "".join(e.text for e in events)


@pytest.mark.parametrize("body,fragment", [
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]},
     "text-only"),
    ({"messages": MSGS, "diffusion_sampler": "confidence-threshold"}, "diffusion_sampler"),
    ({"messages": MSGS, "diffusion_max_canvas_length": 16}, "canvas"),
    ({"messages": MSGS, "block_length": 0}, "'block_length'"),
    ({"messages": MSGS, "threshold": 2}, "'threshold'"),
])
def test_what_llada2_does_not_take_is_a_400(served, body, fragment):
    base, worker = served
    with httpx.Client(base_url=base, timeout=60) as h:
        r = h.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
        assert h.post("/v1/chat/completions", json={"messages": MSGS}).status_code == 200
