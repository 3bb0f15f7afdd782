"""Image sources (dlm.runtime.generation.images): what decodes, and a clear ImageError
naming the source for everything that does not. Images are made with Pillow
here; remote fetches go to a local http.server thread."""

from __future__ import annotations

import base64
import io
import os
import re
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from dlm.runtime.platform.errors import GenerationError
from dlm.runtime.generation.images import ImageError, RemoteImages, decode_data_url, open_image, open_url


def encoded(fmt: str = "PNG", size=(12, 8), color=(200, 30, 60), mode="RGB", **save) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, fmt, **save)
    return buf.getvalue()


def noise(fmt: str, size=(96, 96)) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt)
    return buf.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` and holds no pixel data."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def refused(source, fragment: str, where: str = "image 1", **kw) -> str:
    with pytest.raises(ImageError) as info:
        open_image(source, where, **kw)
    message = str(info.value)
    assert message.startswith(f"{where}: ") and fragment in message, message
    assert "\n" not in message
    return message


# -- what decodes ------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_format_decodes_to_rgb(fmt, tmp_path):
    data = encoded(fmt, size=(12, 8), color=(200, 30, 60))
    path = tmp_path / f"x.{fmt.lower()}"
    path.write_bytes(data)
    for source in (data, path, str(path), data_url(data, f"image/{fmt.lower()}")):
        image = open_image(source, "image 1")
        assert image.mode == "RGB" and image.size == (12, 8)
        r, g, b = image.getpixel((5, 4))
        assert abs(r - 200) < 12 and abs(g - 30) < 12 and abs(b - 60) < 12, (fmt, image.getpixel((5, 4)))


def test_an_animated_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (10, 10), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    assert Image.open(io.BytesIO(buf.getvalue())).n_frames == 2
    assert open_image(buf.getvalue(), "image 1").getpixel((3, 3)) == (255, 0, 0)


def test_alpha_is_dropped_and_exif_orientation_applied_as_transformers_does():
    rgba = open_image(encoded("PNG", mode="RGBA", color=(10, 20, 30, 0)), "image 1")
    assert rgba.mode == "RGB" and rgba.getpixel((0, 0)) == (10, 20, 30)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: the upright image is taller than wide
    rotated = open_image(encoded("JPEG", size=(40, 20), exif=exif.tobytes()), "image 1")
    assert rotated.size == (20, 40)


def test_a_pil_image_is_taken_as_it_is():
    image = Image.new("L", (5000, 5000), 7)  # decoded already: no pixel limit to apply
    out = open_image(image, "image 1", max_pixels=100)
    assert out.mode == "RGB" and out.size == (5000, 5000)


def test_line_wrapped_base64_is_accepted():
    data = encoded("PNG")
    text = base64.b64encode(data).decode()
    wrapped = "\n".join(text[i:i + 20] for i in range(0, len(text), 20))
    assert decode_data_url("data:image/png;base64," + wrapped, "x") == data


# -- files that are not images ----------------------------------------------------------

def test_missing_file_directory_text_file_and_empty_file(tmp_path):
    missing = tmp_path / "nope.png"
    refused(missing, f"{missing}: no such file")  # "image 1: PATH: ..."
    assert refused(missing, "no such file", where=f"--image {missing}") == f"--image {missing}: no such file"
    refused(tmp_path, f"{tmp_path}: a directory, not an image file")
    text = tmp_path / "notes.txt"
    text.write_text("these are not pixels\n")
    refused(text, "notes.txt: not an image (PNG, JPEG, WebP or GIF expected)")
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    refused(str(empty), "empty.png: an empty file, not an image")
    empty.chmod(0)
    if not os.access(empty, os.R_OK):  # (root reads anything)
        refused(empty, "cannot read the file: permission denied")
    refused(b"", "empty image data")
    refused(encoded("BMP"), "not an image (PNG, JPEG, WebP or GIF expected)")
    refused(42, "an image must be a file path, bytes, a data: URL or a PIL image, not int")


@pytest.mark.parametrize("fmt, name", [("PNG", "PNG"), ("JPEG", "JPEG"), ("WEBP", "WebP"), ("GIF", "GIF")])
def test_truncated_images_are_errors_not_crashes(fmt, name, tmp_path):
    data = noise(fmt)
    for cut in (len(data) // 2, 40, 16):
        message = refused(data[:cut], "image is truncated or corrupt")
        assert name in message or fmt in message, message
    path = tmp_path / "cut.bin"
    path.write_bytes(data[: len(data) // 2])
    refused(path, "truncated or corrupt", where="--image cut.bin")


def test_pixels_are_limited_before_decoding():
    # 60 megapixels declared in a 60-byte file: refused from the header alone.
    start = time.perf_counter()
    message = refused(png_header(10_000, 6_000), "the image is too large: 10000x6000 = 60000000 pixels, "
                                                 "over the limit of 50000000")
    assert time.perf_counter() - start < 1.0, message
    refused(encoded("PNG", size=(30, 20)), "30x20 = 600 pixels, over the limit of 500", max_pixels=500)
    assert open_image(encoded("PNG", size=(30, 20)), "image 1", max_pixels=600).size == (30, 20)
    # Past Pillow's own decompression-bomb limit: still one clear error.
    refused(png_header(20_000, 20_000), "the image is too large", max_pixels=None)


def test_image_error_is_a_generation_error():
    assert issubclass(ImageError, GenerationError)


# -- data: URLs and URL schemes ---------------------------------------------------------

@pytest.mark.parametrize("url, fragment", [
    ("data:image/png;base64", "bad data URL: no ',' after the header"),
    ("data:image/png;base64,", "bad data URL: no image data"),
    ("data:image/png;base64,iVBORw0KGgo!!", "bad data URL: the payload is not valid base64"),
    ("data:image/png;base64,iVBORw0KGgo", "bad data URL: the payload is not valid base64"),  # bad padding
    ("data:text/plain;base64,aGVsbG8=", "bad data URL: media type 'text/plain' is not image/*"),
    ("data:;base64,aGVsbG8=", "bad data URL: media type 'missing' is not image/*"),
    ("data:image/png,%89PNG", "bad data URL: only base64 data is accepted"),
    ("data:image/png;base64,aGVsbG8gd29ybGQ=", "not an image"),
    ("data:image/png;base64,iVBORw0KGgo=", "PNG image is truncated or corrupt"),
])
def test_bad_data_urls(url, fragment):
    refused(url, fragment, where="messages[0].content[1]")


def test_remote_urls_need_a_fetch_policy_and_servers_take_no_paths(tmp_path):
    refused("https://example.invalid/cat.png", "remote image URLs are off (dlm-run serve --allow-image-urls")
    path = tmp_path / "x.png"
    path.write_bytes(encoded("PNG"))
    for url, fragment in ((str(path), "unsupported image URL (no scheme)"),
                          (path.as_uri(), "unsupported image URL (scheme 'file')"),
                          ("ftp://host/x.png", "unsupported image URL (scheme 'ftp')")):
        with pytest.raises(ImageError, match="^" + re.escape(f"m[0]: {fragment}; send a data:image/")):
            open_url(url, "m[0]")


# -- fetching -----------------------------------------------------------------------------

PNG = encoded("PNG", size=(16, 16), color=(1, 2, 3))


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, body: bytes, length=True, status=200):
        self.send_response(status)
        self.send_header("Content-Type", "image/png")
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/ok.png":
            self._send(PNG)
        elif self.path == "/declared-big":
            self._send(PNG + b"\0" * 5000)
        elif self.path == "/streamed-big":  # no Content-Length: the limit must hold while streaming
            self.send_response(200)
            self.end_headers()
            for _ in range(50):
                self.wfile.write(b"\0" * 1000)
            self.close_connection = True
        elif self.path == "/cut-short":  # promises more than it sends
            self.send_response(200)
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG[:30])
            self.close_connection = True
        elif self.path == "/slow-headers":
            time.sleep(3)
            self._send(PNG)
        elif self.path == "/drip":  # headers at once, then a byte every 0.1 s
            self.send_response(200)
            self.end_headers()
            for byte in PNG:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.1)
            self.close_connection = True
        elif self.path in ("/to-file", "/to-ftp"):  # redirects stay on http(s)
            self.send_response(302)
            self.send_header("Location", "file:///etc/passwd" if self.path == "/to-file" else "ftp://host/x.png")
            self.end_headers()
        else:
            self._send(b"missing", status=404)


class _Quiet(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a client that gave up (too big, too slow) leaves the handler a broken pipe


@pytest.fixture(scope="module")
def http_base():
    server = _Quiet(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_fetch_within_the_limits(http_base):
    image = open_image(f"{http_base}/ok.png", "image 1", fetch=RemoteImages(max_bytes=len(PNG), timeout=5))
    assert image.size == (16, 16) and image.getpixel((0, 0)) == (1, 2, 3)


@pytest.mark.parametrize("path, fragment", [
    ("/declared-big", "bytes, over the 1000-byte limit"),
    ("/streamed-big", "is over the 1000-byte limit"),
    ("/slow-headers", "timed out after 0.5 s"),
    ("/drip", "timed out after 0.5 s"),
    ("/missing.png", "failed: HTTP 404"),
    ("/cut-short", "the PNG image is truncated or corrupt"),
    ("/to-file", "failed: HTTP 302"),
    ("/to-ftp", "failed: redirected to a non-http(s) URL: ftp://host/x.png"),
])
def test_fetch_failures(http_base, path, fragment):
    start = time.perf_counter()
    message = refused(f"{http_base}{path}", fragment, where="messages[0].content[0]",
                      fetch=RemoteImages(max_bytes=1000, timeout=0.5))
    assert f"{http_base}{path}" in message or "truncated" in message
    assert time.perf_counter() - start < 2.5  # the timeout bounds the whole fetch


def test_fetch_of_a_closed_port():
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    refused(f"http://127.0.0.1:{port}/x.png", "failed:", fetch=RemoteImages(timeout=2))


def _finishes(fn, fifo, seconds=10.0):
    """fn() within ``seconds``; if it blocks (an open() of a FIFO waiting for a
    writer), a writer unblocks it and the test fails."""
    import threading

    result = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # let the blocked open() return
        thread.join(5)
        pytest.fail(f"reading {fifo} blocked (a FIFO with no writer)")
    if "error" in result:
        raise result["error"]
    return result.get("value")


def test_a_fifo_or_device_is_refused_at_once_not_read(tmp_path):
    fifo = tmp_path / "cat.png"
    os.mkfifo(fifo)
    _finishes(lambda: refused(fifo, f"{fifo}: a named pipe (FIFO), not an image file"), fifo)
    _finishes(lambda: refused(str(fifo), "a named pipe (FIFO), not an image file", where=f"--image {fifo}"), fifo)
    refused("/dev/null", "/dev/null: a device, not an image file")


def test_a_fifo_prompts_file_is_refused_at_once(tmp_path, tiny_dg_mlx_dir):
    from click.testing import CliRunner

    from dlm.runtime.cli.batch import read_prompts
    from dlm.runtime.cli.main import main
    from dlm.runtime.platform.errors import DlmError

    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)

    def read():
        with pytest.raises(DlmError, match=r"--prompts-file .*prompts\.jsonl: cannot read it \(a named pipe"):
            read_prompts(str(fifo))

    _finishes(read, fifo)
    r = _finishes(lambda: CliRunner().invoke(main, ["generate", "--model", str(tiny_dg_mlx_dir),
                                                    "--prompts-file", str(fifo)]), fifo, 60)
    assert r.exit_code == 1 and "a named pipe (FIFO), not a regular file" in r.output, r.output
