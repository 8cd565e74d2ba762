"""Images -> ViT patches and LLM token spans (SPEC.md §9), as the official image processor does it.

An image is sized in three steps: a small one is scaled up so its area reaches `min_pixels` (the
new sides truncated to integers), both sides are rounded up to whole patches, and if the token
span would then exceed `max_image_tokens` a closed-form solve shrinks it. The official code's float
expressions are evaluated here in the same order, so the plan matches it exactly, including the
cases where a product that is mathematically an integer lands just below it and a patch row or
column is lost (docs/vision.md).

Pixels: the RGB image is resized once (Pillow BICUBIC, aspect kept) to fit the planned canvas and
centred on a grey (127) canvas, normalised as (x/255 - 0.5)/0.5 in fp32 and rounded once to bf16,
then cut into patches in row-major order, each laid out (channel, y, x).

The LLM sees one span per image: IMAGE_START, then per row of the aligner grid n_llm_w IMAGE
tokens and one IMAGE_NEW_LINE, then IMAGE_END. Every span position carries `image_token_id`; the
token type tells them apart.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from dsv41.config import VisionConfig

TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3
GREY = (127, 127, 127)

# Input limits: what a request may send, checked before any pixel is decoded.
MAX_IMAGE_BYTES = 32 * 2**20  # encoded file size
MAX_IMAGE_PIXELS = 50_000_000  # width x height as the file declares it (about 7000 x 7000)
MAX_IMAGES = 16  # per prompt


class ImageError(ValueError):
    """An image that cannot be used: unreadable, empty, too large, or too many of them."""


@dataclass(frozen=True)
class ImagePlan:
    """How one image of size orig_w x orig_h is resized and how many tokens it costs."""

    orig_w: int
    orig_h: int
    upscaled_w: int  # after the min_pixels rule (= orig when no upscale)
    upscaled_h: int
    best_w_before_budget: int  # upscaled size rounded up to whole patches
    best_h_before_budget: int
    budget_shrink: bool  # the token budget made the closed-form shrink run
    best_w: int  # the canvas the image is letterboxed into
    best_h: int
    n_vit_h: int  # ViT patch grid
    n_vit_w: int
    n_llm_h: int  # aligner token grid
    n_llm_w: int

    @property
    def n_tokens(self) -> int:
        return span_length(self.n_llm_h, self.n_llm_w)


def span_length(n_llm_h: int, n_llm_w: int) -> int:
    return n_llm_h * (n_llm_w + 1) + 2


def llm_grid(best_h: int, best_w: int, patch: int, ratio: int) -> tuple[int, int]:
    """The aligner's token grid for a canvas of best_h x best_w pixels."""
    return math.ceil((best_h // patch) / ratio), math.ceil((best_w // patch) / ratio)


def shrink_to_budget(height, width, patch: int, ratio: int, max_tokens: int) -> tuple[int, int]:
    """The largest aspect-kept canvas (height, width) whose span fits max_tokens: solve
    r·n_w·(n_w + 1) = max_tokens - 2 for the column count, floor to whole cells, then to whole
    patches. The float expressions and their order are the official ones (see the module doc)."""
    r = height / width
    cols = math.sqrt((max_tokens - 2) / r + 0.25) - 0.5
    rows = cols * r
    cell = patch * ratio
    if cols < 1.0:  # very tall: one column
        return (max_tokens - 2) // 2 * cell, cell
    if rows < 1.0:  # very wide: one row
        return cell, (max_tokens - 3) * cell
    beta = min(math.floor(cols) * cell / width, math.floor(rows) * cell / height)
    return math.floor(height * beta / patch) * patch, math.floor(width * beta / patch) * patch


def plan_image(width: int, height: int, v: VisionConfig) -> ImagePlan:
    """The official resize plan of an image of width x height pixels."""
    if width <= 0 or height <= 0:
        raise ImageError(f"an image of {width}x{height} pixels has no area")
    p, orig_w, orig_h = v.patch_size, width, height
    if v.max_wh_ratio is not None and width > height * v.max_wh_ratio:
        width = height * v.max_wh_ratio
    if 0 < width * height < v.min_pixels:
        scale = (v.min_pixels / (width * height)) ** 0.5
        width, height = int(width * scale), int(height * scale)
    best_w, best_h = math.ceil(width / p) * p, math.ceil(height / p) * p
    before = (best_w, best_h)
    n_llm_h, n_llm_w = llm_grid(best_h, best_w, p, v.downsample_ratio)
    shrink = span_length(n_llm_h, n_llm_w) > v.max_image_tokens
    if shrink:
        best_h, best_w = shrink_to_budget(height, width, p, v.downsample_ratio, v.max_image_tokens)
        n_llm_h, n_llm_w = llm_grid(best_h, best_w, p, v.downsample_ratio)
        if span_length(n_llm_h, n_llm_w) > v.max_image_tokens or best_h < p or best_w < p:
            raise ImageError(f"an image of {orig_w}x{orig_h} pixels cannot fit the budget of "
                             f"{v.max_image_tokens} tokens")
    return ImagePlan(orig_w, orig_h, int(width), int(height), *before, shrink, best_w, best_h,
                     best_h // p, best_w // p, n_llm_h, n_llm_w)


def span_types(n_llm_h: int, n_llm_w: int) -> torch.Tensor:
    """Token types of one image span, int64."""
    types = [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]
    return torch.tensor(types, dtype=torch.int64)


def open_image(data: bytes) -> Image.Image:
    """Decode encoded image bytes to RGB, refusing what cannot or should not be decoded."""
    if not data:
        raise ImageError("the image is empty (0 bytes)")
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"the image is {len(data)} bytes; the limit is {MAX_IMAGE_BYTES}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            source = Image.open(io.BytesIO(data))
            with source:
                w, h = source.size
                if w <= 0 or h <= 0:
                    raise ImageError(f"the image has no pixels ({w}x{h})")
                if w * h > MAX_IMAGE_PIXELS:
                    raise ImageError(f"the image is {w}x{h} pixels; the limit is {MAX_IMAGE_PIXELS} pixels")
                return source.convert("RGB")
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"the image is too large to decode: {e}") from None
    except Image.UnidentifiedImageError:  # its message names an in-memory object, not the input
        raise ImageError("the image cannot be decoded: not an image format Pillow reads (PNG, JPEG, WebP, GIF, ...)"
                         ) from None
    except (OSError, ValueError, SyntaxError, EOFError, TypeError, MemoryError) as e:
        raise ImageError(f"the image cannot be decoded: {e}") from None


@dataclass
class ImageInput:
    """One image ready for the ViT: bf16 patches [n_vit_h * n_vit_w, 3, p, p] and its span."""

    patches: torch.Tensor
    plan: ImagePlan

    @property
    def types(self) -> torch.Tensor:
        return span_types(self.plan.n_llm_h, self.plan.n_llm_w)


def letterbox_offset(canvas: int, content: int) -> int:
    """Where the resized image starts on the canvas (Python's round: halves go to even)."""
    return round((canvas - content) * 0.5)


def resize_to_canvas(image: Image.Image, plan: ImagePlan, v: VisionConfig) -> Image.Image:
    """The canvas of plan.best_w x plan.best_h pixels the patches are cut from."""
    size = (plan.best_w, plan.best_h)
    if v.max_wh_ratio is not None and image.width >= v.max_wh_ratio * image.height:
        return image.resize(size)  # the official code stretches here (>=, where the plan uses >)
    return ImageOps.pad(image, size, color=GREY)


def to_patches(canvas: Image.Image, patch: int) -> torch.Tensor:
    """uint8 RGB canvas -> bf16 patches [n, 3, patch, patch], row-major over the patch grid."""
    pixels = torch.from_numpy(np.asarray(canvas, dtype=np.float32)).permute(2, 0, 1) / 255
    x = ((pixels - 0.5) / 0.5).to(torch.bfloat16)
    n_h, n_w = x.size(1) // patch, x.size(2) // patch
    return x.reshape(3, n_h, patch, n_w, patch).permute(1, 3, 0, 2, 4).reshape(n_h * n_w, 3, patch, patch)


def preprocess(data: bytes | Image.Image, v: VisionConfig) -> ImageInput:
    """Encoded image bytes (or an opened image) -> patches and plan."""
    image = data.convert("RGB") if isinstance(data, Image.Image) else open_image(data)
    plan = plan_image(image.width, image.height, v)
    return ImageInput(to_patches(resize_to_canvas(image, plan, v), v.patch_size), plan)


@dataclass
class Expanded:
    """A prompt with its image placeholders expanded into spans."""

    ids: list[int]
    types: torch.Tensor  # int64 [len(ids)]: TEXT or the span token type
    starts: list[int]  # first position of each image's span
    images: list[ImageInput]

    @property
    def image_mask(self) -> torch.Tensor:
        return self.types >= 0


def expand_prompt(ids: list[int], images: list[ImageInput], image_token_id: int) -> Expanded:
    """Replace the k-th `image_token_id` in ids by the k-th image's span. The number of
    placeholders must equal the number of images."""
    n_placeholders = sum(1 for t in ids if t == image_token_id)
    if n_placeholders != len(images):
        raise ImageError(f"the prompt has {n_placeholders} image placeholder(s) but {len(images)} image(s) came "
                         "with it")
    out, types, starts, it = [], [], [], iter(images)
    for token in ids:
        if token != image_token_id:
            out.append(token)
            types.append(TEXT)
            continue
        span = next(it).types
        starts.append(len(out))
        out += [image_token_id] * span.numel()
        types += span.tolist()
    return Expanded(out, torch.tensor(types, dtype=torch.int64), starts, list(images))


# --- where image bytes come from ------------------------------------------------------------------

def image_bytes(source: bytes | str | os.PathLike) -> bytes:
    """Encoded image bytes from raw bytes, a `data:` URL (base64) or a local file path. Network
    URLs are refused: nothing is ever fetched."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if isinstance(source, str) and source.startswith("data:"):
        return data_url_bytes(source)
    if isinstance(source, str) and source.split(":", 1)[0].lower() in ("http", "https", "ftp", "file"):
        raise ImageError("image URLs are not fetched; send the image as a data: URL or as bytes")
    path = Path(source).expanduser()
    if not path.is_file():
        raise ImageError(f"no image file at {path}")
    if path.stat().st_size > MAX_IMAGE_BYTES:
        raise ImageError(f"the image file {path} is {path.stat().st_size} bytes; the limit is {MAX_IMAGE_BYTES}")
    return path.read_bytes()


def data_url_bytes(url: str) -> bytes:
    """The payload of a base64 `data:` URL (data:image/png;base64,....)."""
    header, comma, payload = url.partition(",")
    if not comma or not header.startswith("data:") or ";base64" not in header:
        raise ImageError("an image data URL must look like data:image/<type>;base64,<payload>")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageError(f"the image data URL is {len(payload)} characters; the limit is about "
                         f"{MAX_IMAGE_BYTES * 4 // 3} (an image of {MAX_IMAGE_BYTES} bytes)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"the image data URL's base64 payload is invalid: {e}") from None


def image_from_openai_part(part: dict, v: VisionConfig) -> ImageInput:
    """An OpenAI chat content part {"type": "image_url", "image_url": {"url": "data:..."}} (or with
    the url given as a plain string) -> the preprocessed image. Only data URLs are accepted; an
    http(s) URL is refused with ImageError, never fetched."""
    if not isinstance(part, dict) or part.get("type", "image_url") != "image_url":
        raise ImageError("expected a content part of type 'image_url'")
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise ImageError("an image_url part needs image_url.url (a data: URL)")
    if not url.startswith("data:"):
        raise ImageError("only data: URLs are accepted for images (data:image/png;base64,...); "
                         "remote URLs are never fetched")
    return preprocess(data_url_bytes(url), v)


def load_images(sources: list, v: VisionConfig) -> list[ImageInput]:
    """Several images for one prompt (bytes, data URLs or paths), at most MAX_IMAGES."""
    if len(sources) > MAX_IMAGES:
        raise ImageError(f"{len(sources)} images in one prompt; the limit is {MAX_IMAGES}")
    return [preprocess(image_bytes(s), v) for s in sources]
