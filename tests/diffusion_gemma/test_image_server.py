"""``dlm-run serve`` with images: OpenAI ``image_url`` parts (data: URLs, and
http(s) URLs with --allow-image-urls) give the answer the Python API gives for
the same image; every bad image, and every limit, is a 400 naming the content
part, and the worker keeps serving."""

from __future__ import annotations

import base64
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
from click.testing import CliRunner
from PIL import Image, ImageDraw

from dlm.convert.pipeline import ConvertOptions, convert
from dlm.runtime import api
from dlm.runtime.generation.images import ImageLimits, RemoteImages
from dlm.runtime.server.app import DEFAULT_IMAGE_BODY_BYTES, DEFAULT_MAX_BODY_BYTES, create_app, image_support
from dlm.runtime.server.requests import ModelCaps, RequestError, parse_chat, parse_completion

DEFAULTS = {"max_tokens": 8, "max_denoising_steps": 4}
CAPS = ModelCaps(family="DiffusionGemma", text_only=False, max_images=3)


def png(size=(40, 28), color=(230, 180, 30)) -> bytes:
    image = Image.new("RGB", size, color)
    ImageDraw.Draw(image).rectangle((4, 4, size[0] // 2, size[1] // 2), fill=(20, 40, 200))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


PNG = png()
URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
TRUNCATED = "data:image/png;base64," + base64.b64encode(PNG[: len(PNG) // 2]).decode()
TEXT = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
BIG = "data:image/png;base64," + base64.b64encode(png(size=(300, 200))).decode()  # 60000 pixels


def image(url=URL, **extra):
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def ask(*parts, role="user"):
    return {"messages": [{"role": role, "content": [*parts, {"type": "text", "text": "What is this?"}]}]}


def chat(body):
    return parse_chat(body, CAPS)


# -- parsing (no model) -------------------------------------------------------------------

def test_image_parts_become_template_parts_in_order():
    req = chat({"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "A:"}, image(detail="low"),
                                     {"type": "text", "text": "B:"}, {"type": "image_url", "image_url": TEXT}]},
        {"role": "assistant", "content": "Two images."},
        {"role": "user", "content": [image(detail="auto")]},
    ]})
    assert req.messages == [
        {"role": "system", "content": "Be brief."},  # no image: the plain string, as before
        {"role": "user", "content": [{"type": "text", "text": "A:"}, {"type": "image"},
                                     {"type": "text", "text": "B:"}, {"type": "image"}]},
        {"role": "assistant", "content": "Two images."},
        {"role": "user", "content": [{"type": "image"}]},
    ]
    assert req.images == [("messages[1].content[1]", URL), ("messages[1].content[3]", TEXT),
                          ("messages[3].content[0]", URL)]


@pytest.mark.parametrize("body, param, fragment", [
    (ask(image(), role="assistant"), "messages[0].content[0]", "images are taken in user messages only"),
    (ask(image(), role="system"), "messages[0].content[0]", "not in a system message"),
    (ask({"type": "input_image", "image_url": URL}), "messages[0].content[0]",
     "content part type 'input_image' is not supported; send {\"type\": \"image_url\""),
    (ask({"type": "image_url"}), "messages[0].content[0]", "has no image URL"),
    (ask({"type": "image_url", "image_url": {"detail": "low"}}), "messages[0].content[0]", "has no image URL"),
    (ask({"type": "image_url", "image_url": 5}), "messages[0].content[0].image_url", "must be a string"),
    (ask(image(url="  ")), "messages[0].content[0].image_url.url", "is empty"),
    (ask(image(detail="ultra")), "messages[0].content[0].image_url.detail", "must be one of auto, low, high"),
    (ask(image(format="png")), "messages[0].content[0].image_url", "unsupported field(s)"),
    (ask(image(), image(), image(), image()), "messages[0].content[3]",
     "the request has 4 images; this server takes at most 3 per request (dlm-run serve --max-images)"),
    (ask({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}), "messages[0].content[0]",
     "audio input is not supported"),
    (ask({"type": "video_url", "video_url": {"url": "x"}}), "messages[0].content[0]",
     "video input is not supported"),
])
def test_bad_image_parts_are_400s_naming_the_part(body, param, fragment):
    with pytest.raises(RequestError) as info:
        chat(body)
    assert info.value.status == 400 and info.value.param == param
    assert fragment in info.value.message, info.value.message


def test_text_only_models_and_completions_take_no_images():
    caps = ModelCaps(family="LLaDA-2", text_only=True, why_text_only="LLaDA-2 models are text-only")
    with pytest.raises(RequestError, match="image input is not supported: LLaDA-2 models are text-only"):
        parse_chat(ask(image()), caps)
    with pytest.raises(RequestError, match="/v1/completions takes a text prompt only"):
        parse_completion({"prompt": [{"type": "image_url", "image_url": {"url": URL}}]}, CAPS)


# -- over HTTP, on the tiny vision model -----------------------------------------------------

@pytest.fixture(scope="module")
def vision(tiny_dg_vision_mlx_dir):
    return api.load(tiny_dg_vision_mlx_dir)


@pytest.fixture(scope="module")
def served(vision, serving):
    limits = ImageLimits(max_images=2, max_pixels=10_000)
    app = create_app(vision, DEFAULTS, queue_size=4, images=limits)
    with serving(app) as base:
        yield base, app.state.worker


def oai(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def reference(worker, loaded, messages, pictures, options):
    assert worker.wait_idle(30)
    inputs = api.encode_inputs(loaded, messages=messages, images=pictures)
    return inputs, api.generate(loaded, inputs, {**DEFAULTS, **options})


def test_openai_client_with_a_data_url_matches_the_api(served, vision):
    base, worker = served
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": URL, "detail": "high"}},
                                             {"type": "text", "text": "What is this?"}]}]
    r = oai(base).chat.completions.create(model="m", messages=messages, seed=5, max_tokens=8)
    picture = Image.open(io.BytesIO(PNG))
    inputs, ref = reference(worker, vision, [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is this?"}]}], [picture], {"seed": 5})
    assert inputs.image_tokens > 0
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(inputs.ids)  # the image's soft tokens included
    assert r.usage.completion_tokens == ref.stats.completion_tokens

    stream = list(oai(base).chat.completions.create(model="m", messages=messages, seed=5, max_tokens=8,
                                                    stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref.text
    assert stream[-1].usage.prompt_tokens == len(inputs.ids)


def test_the_string_form_and_two_images(served, vision):
    base, worker = served
    other = "data:image/png;base64," + base64.b64encode(png(size=(24, 36), color=(0, 90, 0))).decode()
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": URL},
        {"type": "image_url", "image_url": {"url": other}}]}], "seed": 2}
    with httpx.Client(base_url=base, timeout=60) as h:
        r = h.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    pictures = [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))) for u in (URL, other)]
    inputs, ref = reference(worker, vision, [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"}]}], pictures, {"seed": 2})
    assert r.json()["choices"][0]["message"]["content"] == ref.text
    assert r.json()["usage"]["prompt_tokens"] == len(inputs.ids)
    timings = r.json()["timings"]
    assert timings["image_tokens"] == inputs.image_tokens and timings["vision_seconds"] > 0


BAD = [
    (ask(image(TRUNCATED)), "messages[0].content[0]", "the PNG image is truncated or corrupt"),
    (ask(image(TEXT)), "messages[0].content[0]", "not an image (PNG, JPEG, WebP or GIF expected)"),
    (ask(image("data:image/png;base64,@@@@")), "messages[0].content[0]", "bad data URL"),
    (ask(image("data:text/plain;base64,aGk=")), "messages[0].content[0]", "is not image/*"),
    (ask(image("https://example.invalid/cat.png")), "messages[0].content[0]",
     "remote image URLs are off (dlm-run serve --allow-image-urls turns them on)"),
    (ask(image("/etc/passwd")), "messages[0].content[0]", "unsupported image URL (no scheme)"),
    (ask(image("file:///etc/passwd")), "messages[0].content[0]", "unsupported image URL (scheme 'file')"),
    (ask(image(), image(BIG)), "messages[0].content[1]",
     "300x200 = 60000 pixels, over the limit of 10000"),
    (ask(image(), image(), image()), "messages[0].content[2]", "takes at most 2 per request"),
    (ask(image(), role="assistant"), "messages[0].content[0]", "user messages only"),
]


@pytest.mark.parametrize("body, param, fragment", BAD, ids=[b[2][:24] for b in BAD])
def test_a_bad_image_is_a_400_and_the_next_request_is_served(served, body, param, fragment):
    base, worker = served
    with httpx.Client(base_url=base, timeout=60) as h:
        r = h.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and fragment in error["message"], error
        assert error["message"].startswith(f"{param}: ") or error["message"].startswith(f"'{param}'")
        ok = h.post("/v1/chat/completions", json=ask(image()))
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] > 100, ok.text  # image tokens
    assert worker.status()["alive"]


def test_completions_refuse_images(served):
    base, _ = served
    r = httpx.post(base + "/v1/completions", json={"prompt": [image()]}, timeout=60)
    assert r.status_code == 400 and "/v1/chat/completions" in r.json()["error"]["message"]


class _Images(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        body = PNG if self.path == "/cat.png" else PNG * 40
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_allow_image_urls_fetches_within_the_limits(vision, serving):
    images = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=images.serve_forever, daemon=True).start()
    where = f"http://127.0.0.1:{images.server_address[1]}"
    limits = ImageLimits(fetch=RemoteImages(max_bytes=len(PNG) * 2, timeout=5))
    try:
        app = create_app(vision, DEFAULTS, images=limits)
        with serving(app) as base, httpx.Client(base_url=base, timeout=60) as h:
            r = h.post("/v1/chat/completions", json={**ask(image(f"{where}/cat.png")), "seed": 1})
            assert r.status_code == 200, r.text
            by_data_url = h.post("/v1/chat/completions", json={**ask(image()), "seed": 1})
            assert r.json()["choices"][0]["message"] == by_data_url.json()["choices"][0]["message"]
            r = h.post("/v1/chat/completions", json=ask(image(f"{where}/big.png")))
            assert r.status_code == 400 and "over the" in r.json()["error"]["message"], r.text
            assert r.json()["error"]["param"] == "messages[0].content[0]"
    finally:
        images.shutdown()
        images.server_close()


def test_text_only_models_answer_400_text_only(tiny_dg_dir, tiny_llada2_mlx_dir, tmp_path, serving):
    out = tmp_path / "text-only"
    convert(ConvertOptions(source=str(tiny_dg_dir), output=str(out), text_only=True, progress=False),
            echo=lambda s: None)
    app = create_app(api.load(out), DEFAULTS)
    assert app.state.server.max_body_bytes == DEFAULT_MAX_BODY_BYTES
    with serving(app) as base, httpx.Client(base_url=base, timeout=60) as h:
        r = h.post("/v1/chat/completions", json=ask(image()))
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0]"
        assert "this DiffusionGemma model has no vision tower (a text-only conversion)" in r.json()["error"]["message"]
        assert h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
                      ).status_code == 200
    assert image_support(api.load(tiny_llada2_mlx_dir)) == ("LLaDA-2 models are text-only", "")


def test_an_unusable_image_processor_leaves_text_serving(serving):
    """The demo model has a vision config but no image tokens in its tokenizer."""
    from tests import ROOT

    app = create_app(api.load(ROOT / "demo" / "diffusion_gemma_sort"), DEFAULTS)
    assert "image_token" in app.state.server.image_problem  # for the server log, not for clients
    with serving(app) as base, httpx.Client(base_url=base, timeout=60) as h:
        r = h.post("/v1/chat/completions", json=ask(image()))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == ("'messages[0].content[0]': image input is not supported: this "
                                                "DiffusionGemma model's image processor is unusable (see the "
                                                "server log)")
        assert h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "sort 31"}]}
                      ).status_code == 200


# -- the command line ----------------------------------------------------------------------

def test_serve_image_flags(tiny_dg_vision_mlx_dir, monkeypatch):
    from dlm.runtime.cli import serve as serve_cli
    from dlm.runtime.cli.main import main

    calls = []
    monkeypatch.setattr(serve_cli, "run_server", lambda app, sock, level: calls.append((app, sock)))
    model = str(tiny_dg_vision_mlx_dir)
    r = CliRunner().invoke(main, ["serve", "--model", model, "--port", "0", "--max-images", "3",
                                  "--max-image-pixels", "1000000", "--allow-image-urls",
                                  "--image-url-max-bytes", "5000", "--image-url-timeout", "2.5"])
    assert r.exit_code == 0, r.output
    app, sock = calls.pop()
    app.state.worker.stop()
    sock.close()
    server = app.state.server
    assert server.images == ImageLimits(3, 1_000_000, RemoteImages(5000, 2.5))
    assert server.caps.max_images == 3 and not server.caps.text_only
    assert server.max_body_bytes == DEFAULT_IMAGE_BODY_BYTES  # room for data: URLs by default

    r = CliRunner().invoke(main, ["serve", "--model", model, "--port", "0"])
    app, sock = calls.pop()
    app.state.worker.stop()
    sock.close()
    assert app.state.server.images == ImageLimits()  # 8 images, 50 MP, no URL fetching

    r = CliRunner().invoke(main, ["serve", "--model", model, "--image-url-timeout", "3"])
    assert r.exit_code == 2 and "--image-url-timeout takes effect only with --allow-image-urls" in r.output
    assert not calls
    help_text = CliRunner().invoke(main, ["serve", "--help"]).output
    for flag in ("--max-images", "--max-image-pixels", "--allow-image-urls", "--image-url-max-bytes",
                 "--image-url-timeout"):
        assert flag in help_text


class _SlowImages(BaseHTTPRequestHandler):
    """Answers /slow.png only once ``release`` is set (or never within a fetch's timeout)."""

    release = threading.Event()

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.release.wait(30)
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)
        except OSError:
            pass


def test_slow_image_urls_are_fetched_concurrently_outside_the_decode_lock(vision, serving):
    """Three clients naming a URL that never answers each wait their own timeout,
    together, and a data: URL request sent meanwhile is not held behind them
    (fetched one at a time under the decode lock, it waited 3 x the timeout)."""
    from concurrent.futures import ThreadPoolExecutor

    _SlowImages.release.clear()
    images = ThreadingHTTPServer(("127.0.0.1", 0), _SlowImages)
    images.daemon_threads = True
    threading.Thread(target=images.serve_forever, daemon=True).start()
    slow = f"http://127.0.0.1:{images.server_address[1]}/slow.png"
    timeout = 3.0
    limits = ImageLimits(fetch=RemoteImages(timeout=timeout))
    try:
        app = create_app(vision, DEFAULTS, images=limits, queue_size=8)
        with serving(app) as base, ThreadPoolExecutor(4) as pool:
            def post(body):
                start = time.monotonic()
                r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
                return r, time.monotonic() - start

            post(ask(image()))  # warm: the first request compiles and loads what it needs
            slows = [pool.submit(post, ask(image(slow))) for _ in range(3)]
            time.sleep(0.5)  # the slow fetches are under way
            r, took = post({**ask(image()), "seed": 1})
            assert r.status_code == 200, r.text
            assert took < timeout - 0.5, f"a data: URL request waited {took:.1f} s behind slow URLs"
            for future in slows:
                r, took = future.result()
                assert r.status_code == 400 and "timed out" in r.json()["error"]["message"], r.text
                assert r.json()["error"]["param"] == "messages[0].content[0]"
                assert took < 2 * timeout, f"a slow URL's request took {took:.1f} s (others' timeouts added)"
    finally:
        _SlowImages.release.set()
        images.shutdown()
        images.server_close()
