"""What a vision-language model needs besides token ids: its image processor, its image tokens, its 3-D positions.

The family served and trained: Qwen2.5-VL (`is_vision_model`; the built-in `artrl/tiny-vl` is one). Qwen2-VL
shares its processor and position rule but is not tested here, so it is not claimed. `VisionInputs` is the one object the server, the engine and the tokenizer of training data ask:

1. **Images.** `load` reads an `image_url` under the run's media policy (artrl/chat/images.py) and `process` runs
   the model's own image processor (`AutoImageProcessor` of the checkpoint: Qwen2-VL's, with its PIL
   backend when torchvision is absent): resized to multiples of patch x merge pixels, cut into patches,
   a (time, height, width) grid of patches and its pixel values. Processed images are kept by content
   hash (the most recent, up to `CACHE_BYTES` of pixel values), so a group of trajectories that show one
   image processes it once.
2. **Image tokens.** The chat template writes one `<|image_pad|>` per image; each becomes grid product /
   merge size squared copies (`image_tokens`: chat_format.ImageTokens), as Qwen's processor does, before
   the text is tokenized. The server and the trainer expand through the same call, so a prompt's ids are
   the same on both sides.
3. **Where each image is** in a list of ids (`spans`): its run of image tokens, in order; a list whose
   runs do not match the images' sizes is refused (the record and the images disagree).
4. **Positions.** Qwen-VL's multimodal rotary embedding (mRoPE) gives every token three position ids
   (time, height, width). Text tokens take the next position on all three; an image at position p takes
   p + its row on the height axis, p + its column on the width axis and p on the time axis, and the text
   after it continues at p + max(grid height, grid width) / merge. `positions` computes them for one
   sequence from its image spans alone, the rule of transformers' `get_rope_index` for still images
   (tests/test_vision.py checks it against the model's own), so the packer can place sequences anywhere
   and each keeps the positions it has alone.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from ..chat.format import ImageTokens
from ..errors import ConfigError, ImageError
from ..chat.images import LoadedImage, MediaPolicy, ProcessedImage, load_image

VISION_MODEL_TYPES = ("qwen2_5_vl",)
VISION_TOWERS = {"qwen2_5_vl": "model.visual"}
"""Where each family keeps its vision tower, the multimodal projector included (Qwen2.5-VL's patch merger is
`model.visual.merger`), by module name in the model transformers loads: what quantisation leaves in the model's
dtype (`models/quantization.py`, `unquantized_modules`) and LoRA leaves frozen."""
CACHE_BYTES = 256 * 1024 * 1024
"""Pixel values of processed images kept by content hash (a 224 x 224 image: 1.2 MB; Qwen2.5-VL's largest, 12.8M
pixels: 77 MB)."""


def _nbytes(image: ProcessedImage) -> int:
    return image.pixels.numel() * image.pixels.element_size()


def is_vision_model(config: Any) -> bool:
    """Whether `config` (a transformers config) is a vision-language model artrl serves and trains."""
    return getattr(config, "model_type", None) in VISION_MODEL_TYPES


class VisionInputs:
    """A vision-language model's image processing, image tokens and positions; see the module docstring."""

    def __init__(self, processor: Any, tokenizer: Any, config: Any, policy: MediaPolicy | None = None) -> None:
        self.processor = processor
        self.policy = policy or MediaPolicy()
        self.image_token_id = int(config.image_token_id)
        self.image_token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.merge_size = int(config.vision_config.spatial_merge_size)
        processor_merge = int(getattr(processor, "merge_size", self.merge_size))
        if processor_merge != self.merge_size:
            raise ConfigError(f"the image processor merges {processor_merge} x {processor_merge} patches and the "
                              f"model {self.merge_size} x {self.merge_size}; they come from different checkpoints.")
        self._cache: OrderedDict[str, ProcessedImage] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()

    @classmethod
    def of_model(cls, path: str, tokenizer: Any, config: Any, policy: MediaPolicy | None = None,
                 trust_remote_code: bool = False) -> "VisionInputs":
        """The model's own image processor, from its directory (or hub id)."""
        from transformers import AutoImageProcessor

        try:
            processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise ConfigError(f"the vision-language model at {path} has no image processor artrl can load "
                              f"(preprocessor_config.json): {e}") from e
        return cls(processor, tokenizer, config, policy)

    # ------------------------------------------------------------------ images
    def load(self, url: str, where: str) -> LoadedImage:
        return load_image(url, self.policy, where)

    def process(self, image: LoadedImage) -> ProcessedImage:
        """The processor's grid and pixel values of `image` (kept by content hash)."""
        with self._lock:
            done = self._cache.get(image.digest)
            if done is not None:
                self._cache.move_to_end(image.digest)
                return done
        try:
            out = self.processor(images=[image.image], return_tensors="pt")
        except ValueError as e:  # e.g. an aspect ratio over 200 (Qwen's smart_resize)
            raise ImageError(f"the image processor refused image {image.digest[:12]}: {e}") from e
        grid = tuple(int(v) for v in out["image_grid_thw"][0].tolist())
        tokens = grid[0] * grid[1] * grid[2] // self.merge_size ** 2
        done = ProcessedImage(image.digest, grid, out["pixel_values"].to(torch.float32), tokens)  # type: ignore[arg-type]
        with self._lock:
            if image.digest not in self._cache:
                self._cache[image.digest] = done
                self._cached_bytes += _nbytes(done)
            while self._cached_bytes > CACHE_BYTES and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= _nbytes(old)
        return done

    def image_tokens(self, images: Sequence[ProcessedImage]) -> ImageTokens:
        """How `images` (in message order) expand in a rendered prompt (module docstring, point 2)."""
        return ImageTokens(self.image_token, tuple(image.tokens for image in images))

    # ------------------------------------------------------------------ token lists
    def spans(self, ids: Sequence[int], images: Sequence[ProcessedImage], where: str) -> list[int]:
        """The index of each image's first token in `ids` (images in order; module docstring, point 3)."""
        starts: list[int] = []
        tid, n, j, k = self.image_token_id, len(ids), 0, 0
        while j < n:
            if ids[j] != tid:
                j += 1
                continue
            end = j
            while end < n and ids[end] == tid:
                end += 1
            while j < end:  # a run may hold adjacent images
                if k >= len(images) or j + images[k].tokens > end:
                    raise ImageError(
                        f"{where}: the prompt's image tokens do not match its images (a run of {end - j} image tokens "
                        f"at {j}; images {[i.tokens for i in images]} tokens each). Record the choice unchanged, and "
                        "keep the images of the messages it was sampled from.")
                starts.append(j)
                j += images[k].tokens
                k += 1
        if k != len(images):
            raise ImageError(f"{where}: the prompt holds image tokens for {k} images, and {len(images)} images belong "
                             "to it; record the choice unchanged.")
        return starts

    def positions(self, length: int, spans: Sequence[tuple[int, ProcessedImage]]) -> torch.Tensor:
        """[3, length] (time, height, width) position ids of one sequence whose images are `spans` (start, image)."""
        out = torch.empty((3, length), dtype=torch.long)
        cur, i = 0, 0
        for start, image in sorted(spans, key=lambda s: s[0]):
            out[:, i:start] = torch.arange(start - i) + cur  # text: the same position on every axis
            cur += start - i
            t, h, w = image.grid
            m = self.merge_size
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h // m), torch.arange(w // m), indexing="ij")
            out[:, start:start + image.tokens] = torch.stack([tt, hh, ww]).reshape(3, -1) + cur  # [3, tokens]
            cur += max(h, w) // m
            i = start + image.tokens
        out[:, i:] = torch.arange(length - i) + cur
        return out
