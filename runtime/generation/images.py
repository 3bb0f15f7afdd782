"""Image sources for prompts: file paths, bytes, data: URLs, http(s) URLs, PIL images.

``open_image`` turns one source into an RGB PIL image, as transformers'
``load_image`` does (EXIF orientation applied, then ``convert("RGB")``; an
animated image gives its first frame). Only PNG, JPEG, WebP and GIF are
decoded. The size is read from the header and checked against ``max_pixels``
before any pixel is decoded, so a small file that claims a huge canvas costs
nothing. Every failure is an ``ImageError`` whose message starts with
``where`` (``image 1``, ``--image cat.png``, ``messages[0].content[1]``).

Remote URLs are fetched only with a ``RemoteImages`` policy (``dlm-run serve
--allow-image-urls``): a size limit enforced while the body streams in, and a
timeout on the whole fetch.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..platform.errors import GenerationError
from ..platform.files import NotRegularFile, open_regular

# 50 megapixels (150 MB as RGB): any camera photo of today fits, and it is
# below Pillow's own decompression-bomb warning (89 MP). The vision tower sees
# far fewer pixels (the processor downscales), so the limit only bounds the
# memory and time spent decoding.
DEFAULT_MAX_PIXELS = 50_000_000
DEFAULT_MAX_IMAGES = 8
DEFAULT_URL_MAX_BYTES = 20_000_000
DEFAULT_URL_TIMEOUT = 10.0
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_KINDS = "PNG, JPEG, WebP or GIF"
_CHUNK = 64 * 1024


class ImageError(GenerationError):
    """An image that cannot be read (names the file or request part)."""


@dataclass(frozen=True)
class RemoteImages:
    """The policy for fetching http(s) image URLs: the largest body accepted
    (checked against Content-Length, then while the body streams in) and the
    seconds a fetch may take (a deadline checked between reads; the connect
    and each read also time out after it)."""

    max_bytes: int = DEFAULT_URL_MAX_BYTES
    timeout: float = DEFAULT_URL_TIMEOUT

    def fetch(self, url: str, where: str) -> bytes:
        shown = url if len(url) <= 200 else url[:200] + "..."
        deadline = time.monotonic() + self.timeout
        request = urllib.request.Request(url, headers={"User-Agent": "dlm-run"})
        try:
            with _OPENER.open(request, timeout=self.timeout) as response:
                declared = response.headers.get("Content-Length")
                if declared and declared.isdigit() and int(declared) > self.max_bytes:
                    raise ImageError(f"{where}: the image at {shown} is {int(declared)} bytes, over the "
                                     f"{self.max_bytes}-byte limit")
                chunks, size = [], 0
                while True:
                    if time.monotonic() > deadline:
                        raise TimeoutError
                    chunk = response.read1(_CHUNK)  # what has arrived: a slow sender meets the deadline
                    if not chunk:
                        break
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise ImageError(f"{where}: the image at {shown} is over the {self.max_bytes}-byte limit")
                    chunks.append(chunk)
        except ImageError:
            raise
        except urllib.error.HTTPError as exc:
            raise ImageError(f"{where}: fetching {shown} failed: HTTP {exc.code} {exc.reason}") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise ImageError(f"{where}: fetching {shown} timed out after {self.timeout:g} s") from None
            raise ImageError(f"{where}: fetching {shown} failed: {exc.reason}") from None
        except TimeoutError:
            raise ImageError(f"{where}: fetching {shown} timed out after {self.timeout:g} s") from None
        except (OSError, ValueError, http.client.HTTPException) as exc:  # reset, cut short, malformed
            raise ImageError(f"{where}: fetching {shown} failed: {exc}") from None
        return b"".join(chunks)


@dataclass(frozen=True)
class ImageLimits:
    """What a server takes of images, per request: how many, how many pixels
    each, and whether (and how) it fetches http(s) URLs (``fetch`` None: never)."""

    max_images: int = DEFAULT_MAX_IMAGES
    max_pixels: int = DEFAULT_MAX_PIXELS
    fetch: Optional[RemoteImages] = None


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects stay on http(s) (urllib's own handler also follows ftp)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if not newurl.lower().startswith(("http://", "https://")):
            raise urllib.error.URLError(f"redirected to a non-http(s) URL: {newurl}")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_HttpOnlyRedirects)


def open_image(source, where: str, *, max_pixels: Optional[int] = DEFAULT_MAX_PIXELS,
               fetch: Optional[RemoteImages] = None):
    """An RGB PIL image from ``source``: a PIL image (taken as it is: already
    decoded, no pixel limit), a file path (str or Path), bytes, a ``data:``
    URL or, with ``fetch``, an http(s) URL. ImageError naming ``where`` otherwise."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return _to_rgb(source, where)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode(bytes(source), where, max_pixels)
    if isinstance(source, str) and _is_url(source):
        return open_url(source, where, max_pixels=max_pixels, fetch=fetch)
    if isinstance(source, (str, Path)):
        return open_file(source, where, max_pixels=max_pixels)
    raise ImageError(f"{where}: an image must be a file path, bytes, a data: URL or a PIL image, "
                     f"not {type(source).__name__}")


def open_url(url: str, where: str, *, max_pixels: Optional[int] = DEFAULT_MAX_PIXELS,
             fetch: Optional[RemoteImages] = None):
    """An RGB PIL image from a ``data:`` URL or (with ``fetch``) an http(s) URL;
    any other scheme, file paths included, is an ImageError (what a server takes)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode(decode_data_url(url, where), where, max_pixels)
    if scheme in ("http", "https"):
        if fetch is None:
            raise ImageError(f"{where}: remote image URLs are off (dlm-run serve --allow-image-urls "
                             "turns them on); send the image as a data: URL")
        return decode(fetch.fetch(url, where), where, max_pixels)
    shown = f"scheme {scheme!r}" if scheme else "no scheme"
    raise ImageError(f"{where}: unsupported image URL ({shown}); send a data:image/...;base64 URL")


def fetch_bodies(urls, fetch: Optional[RemoteImages]) -> list:
    """The bodies of the http(s) URLs among ``urls`` ((where, url) pairs), fetched
    at once, each in a thread of its own; None for the others (data: URLs and
    refusals, left to ``open_url``). A server fetches these before it takes its
    decode lock: a slow URL then costs its own request its timeout and no other
    request anything, while decoded images still come one request at a time.
    The first failure is raised: an ImageError naming its part, which its
    ``where`` attribute also holds."""
    wanted = [i for i, (_, url) in enumerate(urls)
              if fetch is not None and url.split(":", 1)[0].lower() in ("http", "https")]
    bodies: list = [None] * len(urls)

    def one(i: int) -> bytes:
        where, url = urls[i]
        try:
            return fetch.fetch(url, where)
        except ImageError as exc:
            exc.where = where
            raise

    if len(wanted) <= 1:
        for i in wanted:
            bodies[i] = one(i)
        return bodies
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(wanted), thread_name_prefix="dlm-image-fetch") as pool:
        futures = {i: pool.submit(one, i) for i in wanted}
        for i in wanted:
            bodies[i] = futures[i].result()
    return bodies


def decode_data_url(url: str, where: str) -> bytes:
    """The bytes of a ``data:image/...;base64,...`` URL (strict base64)."""
    head, comma, payload = url.partition(",")
    if not comma:
        raise ImageError(f"{where}: bad data URL: no ',' after the header (expected data:image/png;base64,...)")
    params = head[len("data:"):].split(";")
    media = params[0].strip().lower()
    if not media.startswith("image/"):
        raise ImageError(f"{where}: bad data URL: media type {media or 'missing'!r} is not image/*")
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise ImageError(f"{where}: bad data URL: only base64 data is accepted (data:{media};base64,...)")
    payload = "".join(payload.split())  # line-wrapped base64 is still base64
    if not payload:
        raise ImageError(f"{where}: bad data URL: no image data after the header")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"{where}: bad data URL: the payload is not valid base64 ({exc})") from None


def decode(data: bytes, where: str, max_pixels: Optional[int] = DEFAULT_MAX_PIXELS):
    """An RGB PIL image from encoded bytes."""
    if not data:
        raise ImageError(f"{where}: empty image data")
    return _decode(io.BytesIO(data), where, max_pixels)


def open_file(path, where: str, *, max_pixels: Optional[int] = DEFAULT_MAX_PIXELS):
    """An RGB PIL image from the file at ``path`` (str or Path; a URL is a file
    name like any other here). Messages name the file after ``where`` unless
    ``where`` names it already ("--image cat.png")."""
    if str(path) not in where:  # "image 1" -> "image 1: cat.png"
        where = f"{where}: {path}"
    path = Path(path)
    try:
        with open_regular(path, "rb") as fp:  # a FIFO with no writer would block open() for ever
            if fp.seek(0, io.SEEK_END) == 0:
                raise ImageError(f"{where}: an empty file, not an image")
            fp.seek(0)
            return _decode(fp, where, max_pixels)
    except FileNotFoundError:
        raise ImageError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise ImageError(f"{where}: a directory, not an image file") from None
    except NotRegularFile as exc:
        what = "a directory" if "directory" in exc.strerror else exc.strerror.split(",")[0]
        raise ImageError(f"{where}: {what}, not an image file") from None
    except PermissionError:
        raise ImageError(f"{where}: cannot read the file: permission denied") from None
    except OSError as exc:
        raise ImageError(f"{where}: cannot read the file: {exc.strerror or exc}") from None


def _decode(fp, where: str, max_pixels: Optional[int]):
    from PIL import Image, UnidentifiedImageError

    with warnings.catch_warnings():
        # Our own pixel limit (checked next) replaces Pillow's warning.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(fp, formats=FORMATS)
        except Image.DecompressionBombError as exc:
            raise ImageError(f"{where}: the image is too large ({exc})") from None
        except Exception as exc:  # Pillow tried every format: unknown, or a broken header
            kind = _sniff(fp)
            if kind is None:
                raise ImageError(f"{where}: not an image ({_KINDS} expected)") from None
            why = "" if isinstance(exc, UnidentifiedImageError) else f" ({_why(exc)})"
            raise ImageError(f"{where}: the {kind} image is truncated or corrupt{why}") from None
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        raise ImageError(f"{where}: the image is too large: {width}x{height} = {width * height} pixels, "
                         f"over the limit of {max_pixels}")
    try:
        image.load()  # the first frame of an animated image
    except Exception as exc:  # Pillow's decoders raise OSError, SyntaxError, ValueError, ...
        raise ImageError(f"{where}: the {image.format} image is truncated or corrupt ({_why(exc)})") from None
    return _to_rgb(image, where)


_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"),
               (b"GIF89a", "GIF"))


def _sniff(fp) -> Optional[str]:
    """The format a file's first bytes announce (for a file Pillow cannot open)."""
    try:
        fp.seek(0)
        head = fp.read(12)
    except (OSError, ValueError):
        return None
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WebP"
    return next((kind for magic, kind in _SIGNATURES if head.startswith(magic)), None)


def _to_rgb(image, where: str):
    from PIL import ImageOps

    try:
        return ImageOps.exif_transpose(image).convert("RGB")
    except Exception as exc:
        raise ImageError(f"{where}: cannot convert the image to RGB ({_why(exc)})") from None


def _why(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


def _is_url(text: str) -> bool:
    return text[:5].lower() == "data:" or text[:7].lower() == "http://" or text[:8].lower() == "https://"
