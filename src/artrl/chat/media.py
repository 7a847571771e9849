"""A conversation's images, as tokenization needs them: loaded when a turn needs them, found by the record.

A vision-language model's sampled turn records its prompt's images by content hash and grid
(`prompt_images`, docs/token-record.md), never the pixels. `ConversationImages.of_record` loads the images of
the messages before the turn again (artrl/chat/images.py, under the model's media policy), runs the model's processor
(models/vision.py, through the `vision` object the caller passes: nothing here imports a model), finds each
recorded image by its hash, checks its grid, and places each in the prompt's ids. A conversation with images
for a model without a vision tower is refused here, naming the part.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from openai.types.chat.chat_completion import Choice

from .format import image_urls
from ..errors import ImageError
from .images import RECORD_KEY as IMAGES_RECORD_KEY, ProcessedImage, read_record


def same_images(a: Sequence[tuple[int, ProcessedImage]], b: Sequence[tuple[int, ProcessedImage]]) -> bool:
    """Whether two lists of (first token, image) hold the same images at the same places."""
    return [(s, i.digest) for s, i in a] == [(s, i.digest) for s, i in b]


class ConversationImages:
    """The images of one conversation, loaded and processed when a turn needs them (module docstring)."""

    def __init__(self, items: Sequence[Any], vision: Any, where: str) -> None:
        self.vision = vision
        self.urls = image_urls(items, f"{where}: messages_and_choices")  # (message index, place, url)
        self._done: dict[str, ProcessedImage] = {}  # part's place -> its processed image
        if self.urls and vision is None:
            raise ImageError(f"{self.urls[0][1]} is an image, and this model has no vision tower: it reads text only. "
                             "Train a vision-language model (e.g. base_model='artrl/tiny-vl', or a Qwen2.5-VL "
                             "checkpoint), or leave the image out.")

    def _processed(self, place: str, url: str) -> ProcessedImage:
        done = self._done.get(place)
        if done is None:
            done = self._done[place] = self.vision.process(self.vision.load(url, place))
        return done

    def before(self, index: int) -> list[ProcessedImage]:
        """The processed images of the messages before `messages_and_choices[index]`, in order."""
        return [self._processed(place, url) for i, place, url in self.urls if i < index]

    def of_record(self, choice: Choice, index: int, prompt: list[int], at: str) -> list[tuple[int, ProcessedImage]]:
        """(first token, image) of each image in a recorded prompt; see the module docstring."""
        recorded = (choice.model_extra or {}).get(IMAGES_RECORD_KEY)
        if self.vision is None:
            if recorded:
                raise ImageError(f"{at}: the choice was sampled from a prompt with images ({IMAGES_RECORD_KEY}), and "
                                 "this model has no vision tower; train the vision-language model that sampled it.")
            return []
        available = self.before(index)
        if recorded is None:  # a server that records no images: the messages' images, if the prompt shows any
            images = available if self.vision.image_token_id in prompt else []
        else:
            by_digest = {image.digest: image for image in available}
            images = []
            for k, (digest, grid) in enumerate(read_record(recorded, at)):
                image = by_digest.get(digest)
                if image is None:
                    raise ImageError(f"{at}: {IMAGES_RECORD_KEY}[{k}] names image sha256 {digest[:16]}..., which no "
                                     "message before the choice holds (was an image changed or removed after it was "
                                     "sampled?). Keep the messages as they were sent.")
                if image.grid != grid:
                    raise ImageError(f"{at}: image sha256 {digest[:16]}... has grid {list(image.grid)} under this "
                                     f"model's image processor and the server recorded {list(grid)}; the server ran "
                                     "another image processor (or model) than this one.")
                images.append(image)
        return list(zip(self.vision.spans(prompt, images, at), images))
