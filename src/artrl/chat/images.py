"""Images in chat messages: what an `image_url` part may hold, and loading one under the media policy.

OpenAI's API carries an image as a content part `{"type": "image_url", "image_url": {"url": ...}}` (a
`"detail"` key is accepted and has no effect). artrl takes it in user, system and tool messages, in
trajectories (`messages_and_choices`, `additional_histories`, SFT data) and in requests to its server.
The URL is one of:

* `data:image/png;base64,...` (also `image/jpeg`, `image/jpg`, `image/webp`): the image itself;
* `file:///abs/path.png`: a file under `MediaPolicy.allowed_local_media_path` (ART's
  `engine_args.allowed_local_media_path`, "/tmp" by default as in ART), symbolic links resolved first, so a
  link cannot lead out of it; None refuses every file URL;
* `http://` / `https://`: fetched (`fetch_image_urls`, on by default as in vLLM) within
  `image_fetch_timeout_s` seconds; refused, with the way out, when fetching is off or the host cannot be
  reached (an offline machine).

Every image is checked before it is decoded: at most `max_image_bytes` encoded bytes (20 MiB by
default, OpenAI's per-image limit) and `max_image_pixels` pixels (4096 x 4096 = 16.8M by default,
read from the header, so a small file that would decode into gigabytes is refused), one of PNG, JPEG or
WebP, and decodable. Each failure is an `ImageError` (a `TrajectoryError`: the server answers 400) whose
message names the part (`messages[1].content[0]`) and says what to do.

A `LoadedImage` keeps the decoded RGB image and the SHA-256 of its encoded bytes: the token record names
images by that hash (docs/token-record.md), so the trainer can tell that the image it loads again is the one
the server saw. `ProcessedImage` is what a model's processor made of it (models/vision.py).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import ImageError

IMAGE_PART = "image_url"
"""The content part type of an image (OpenAI's)."""

DEFAULT_ALLOWED_LOCAL_MEDIA_PATH = "/tmp"
"""ART's default `engine_args.allowed_local_media_path`."""
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
"""Encoded bytes one image may have (OpenAI's limit per image)."""
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
"""Pixels (width x height) one image may have, read from its header before it is decoded."""
DEFAULT_FETCH_TIMEOUT_S = 10.0
"""Seconds an http(s) image may take to arrive."""

FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}
"""Pillow's format name -> media type, for the formats taken."""
_DATA_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp"}


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how large they may be (module docstring); `InternalModelConfig` sets it."""

    allowed_local_media_path: str | None = DEFAULT_ALLOWED_LOCAL_MEDIA_PATH
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    fetch_image_urls: bool = True
    image_fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S

    @classmethod
    def of(cls, cfg: Any) -> "MediaPolicy":
        """The policy an `InternalModelConfig` sets."""
        return cls(allowed_local_media_path=cfg.allowed_local_media_path, max_image_bytes=cfg.max_image_bytes,
                   max_image_pixels=cfg.max_image_pixels, fetch_image_urls=cfg.fetch_image_urls,
                   image_fetch_timeout_s=cfg.image_fetch_timeout_s)


@dataclass(frozen=True, eq=False)
class LoadedImage:
    """A decoded image (RGB) and the SHA-256 of its encoded bytes (hex)."""

    digest: str
    image: Any  # PIL.Image.Image


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    """What a vision-language model's processor made of an image (models/vision.py).

    `grid` is the processor's (time, height, width) count of patches, `pixels` its [patches, patch values]
    float32 tensor and `tokens` the image tokens it takes in a prompt (grid product / merge size squared).
    """

    digest: str
    grid: tuple[int, int, int]
    pixels: Any  # torch.Tensor [t * h * w, channels * temporal * patch * patch]
    tokens: int


# --------------------------------------------------------------------------- content parts


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == IMAGE_PART


def part_url(part: dict[str, Any]) -> Any:
    """The URL of an image part (None when it has none: `check_part` refuses it)."""
    spec = part.get(IMAGE_PART)
    return spec.get("url") if isinstance(spec, dict) else None


def check_part(part: dict[str, Any], where: str) -> None:
    """Refuse an image part whose shape or URL scheme is wrong (loading checks the rest)."""
    spec = part.get(IMAGE_PART)
    url = spec.get("url") if isinstance(spec, dict) else None
    if not isinstance(url, str) or not url:
        raise ImageError(f"{where} is an image part without a URL: {part!r:.200}; write it as "
                         '{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}.')
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in ("data", "file", "http", "https"):
        raise ImageError(f"{where}.image_url.url is {url!r:.120}; an image URL is a data: URL (PNG, JPEG or WebP, "
                         "base64), a file:// URL under allowed_local_media_path, or an http(s):// URL.")


def image_parts(content: Any) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, part) of each image part of a message's content, in order."""
    if isinstance(content, list):
        for k, part in enumerate(content):
            if is_image_part(part):
                yield k, part


def has_images(content: Any) -> bool:
    return next(image_parts(content), None) is not None


# --------------------------------------------------------------------------- loading


def load_image(url: str, policy: MediaPolicy, where: str) -> LoadedImage:
    """Read, check and decode the image at `url` (module docstring); ImageError naming `where` otherwise."""
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        data = _data_url_bytes(url, policy, where)
    elif scheme == "file":
        data = _file_bytes(url, policy, where)
    elif scheme in ("http", "https"):
        data = _fetched_bytes(url, policy, where)
    else:
        raise ImageError(f"{where}: {url!r:.120} is not a data:, file:// or http(s):// URL.")
    return decode_image(data, policy, where)


def decode_image(data: bytes, policy: MediaPolicy, where: str) -> LoadedImage:
    """Check the size, format and pixel count of encoded image `data`, then decode it to RGB."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > policy.max_image_bytes:
        raise ImageError(f"{where}: the image has {len(data)} bytes, more than max_image_bytes="
                         f"{policy.max_image_bytes}; send a smaller image (or raise max_image_bytes in the model's "
                         "InternalModelConfig).")
    try:
        image = Image.open(io.BytesIO(data))
        fmt = image.format
        width, height = image.size
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"{where}: the image does not decode ({type(e).__name__}: {e}); send a PNG, JPEG or WebP "
                         "image.") from e
    if fmt not in FORMATS:
        raise ImageError(f"{where}: the image is {fmt}; artrl takes {', '.join(FORMATS)} images. Convert it first.")
    if width * height > policy.max_image_pixels:
        raise ImageError(f"{where}: the image is {width} x {height} = {width * height} pixels, more than "
                         f"max_image_pixels={policy.max_image_pixels}; resize it (or raise max_image_pixels in the "
                         "model's InternalModelConfig).")
    try:
        image.load()
        rgb = image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:  # a truncated or corrupt body past a valid header
        raise ImageError(f"{where}: the {fmt} image does not decode ({type(e).__name__}: {e}).") from e
    return LoadedImage(hashlib.sha256(data).hexdigest(), rgb)


def _data_url_bytes(url: str, policy: MediaPolicy, where: str) -> bytes:
    head, sep, payload = url.partition(",")
    fields = head[len("data:"):].split(";")
    media = fields[0].strip().lower()
    if not sep or media not in _DATA_TYPES or "base64" not in fields[1:]:
        raise ImageError(f"{where}: a data URL starting {head[:60]!r} is not 'data:image/<png|jpeg|webp>;base64,...'"
                         "; encode the image as base64 with its media type.")
    if len(payload) * 3 // 4 > policy.max_image_bytes + 3:  # refused before decoding the base64
        raise ImageError(f"{where}: the image has about {len(payload) * 3 // 4} bytes, more than max_image_bytes="
                         f"{policy.max_image_bytes}; send a smaller image (or raise max_image_bytes).")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{where}: the data URL's base64 does not decode ({e}).") from e


def _file_bytes(url: str, policy: MediaPolicy, where: str) -> bytes:
    parsed = urllib.parse.urlparse(url)
    root = policy.allowed_local_media_path
    if not root:
        raise ImageError(f"{where}: {url!r:.120} is a file URL, and allowed_local_media_path is not set, so no local "
                         "file may be read. Set engine_args.allowed_local_media_path (ART's name) to the directory "
                         "that holds the images, or send the image as a data: URL.")
    if parsed.netloc not in ("", "localhost"):
        raise ImageError(f"{where}: {url!r:.120} names host {parsed.netloc!r}; a file URL reads this machine's files "
                         "only (file:///absolute/path).")
    path = urllib.parse.unquote(parsed.path)
    real, allowed = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, allowed]) != allowed:
        raise ImageError(f"{where}: {path!r} is outside allowed_local_media_path={root!r} (it resolves to {real!r}); "
                         "move the image under that directory, or set engine_args.allowed_local_media_path.")
    try:
        size = os.path.getsize(real)
        if size > policy.max_image_bytes:
            raise ImageError(f"{where}: {path!r} has {size} bytes, more than max_image_bytes={policy.max_image_bytes};"
                             " send a smaller image (or raise max_image_bytes).")
        with open(real, "rb") as f:
            return f.read(policy.max_image_bytes + 1)
    except OSError as e:
        raise ImageError(f"{where}: cannot read {path!r} ({e.strerror or e}).") from e


def _fetched_bytes(url: str, policy: MediaPolicy, where: str) -> bytes:
    if not policy.fetch_image_urls:
        raise ImageError(f"{where}: {url!r:.120} is an http(s) URL, and fetching image URLs is off "
                         "(fetch_image_urls=False); send the image as a data: URL or a file:// URL under "
                         "allowed_local_media_path.")
    request = urllib.request.Request(url, headers={"User-Agent": "artrl"})
    try:
        with urllib.request.urlopen(request, timeout=policy.image_fetch_timeout_s) as response:  # noqa: S310
            data = response.read(policy.max_image_bytes + 1)
    except urllib.error.HTTPError as e:
        raise ImageError(f"{where}: fetching {url!r:.120} answered HTTP {e.code} ({e.reason}).") from e
    except (urllib.error.URLError, socket.timeout, TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ImageError(f"{where}: could not fetch {url!r:.120} within {policy.image_fetch_timeout_s:g} s ({reason}); "
                         "this machine may be offline or the host unreachable. Send the image as a data: URL, or "
                         "as a file:// URL under allowed_local_media_path.") from e
    if len(data) > policy.max_image_bytes:
        raise ImageError(f"{where}: {url!r:.120} has more than max_image_bytes={policy.max_image_bytes} bytes; send a "
                         "smaller image (or raise max_image_bytes).")
    return data


def data_url(image: Any, fmt: str = "PNG") -> str:
    """A PIL image as a data URL (PNG by default): what an agent puts in an `image_url` part."""
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:{FORMATS[fmt.upper()]};base64,{base64.b64encode(buffer.getvalue()).decode()}"


# --------------------------------------------------------------------------- the token record

RECORD_KEY = "prompt_images"
"""The choice's field naming the images of its prompt, in order (docs/token-record.md)."""


def record_entries(images: list[ProcessedImage]) -> list[dict[str, Any]]:
    """The record of a prompt's images: each one's SHA-256 and the processor's grid (never the pixels)."""
    return [{"sha256": image.digest, "grid_thw": list(image.grid)} for image in images]


def read_record(value: Any, where: str) -> list[tuple[str, tuple[int, int, int]]]:
    """(sha256, grid) of each image a choice's `prompt_images` names; ImageError when it is malformed."""
    out = []
    if not isinstance(value, list):
        raise ImageError(f"{where}: {RECORD_KEY} is {value!r:.120}; expected the list the server returned.")
    for k, entry in enumerate(value):
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        grid = entry.get("grid_thw") if isinstance(entry, dict) else None
        if not (isinstance(digest, str) and isinstance(grid, list) and len(grid) == 3
                and all(isinstance(g, int) and g > 0 for g in grid)):
            raise ImageError(f"{where}: {RECORD_KEY}[{k}] is {entry!r:.120}; expected {{'sha256': hex, 'grid_thw': "
                             "[t, h, w]}} as the server returned it. Record the choice unchanged.")
        out.append((digest, (grid[0], grid[1], grid[2])))
    return out
