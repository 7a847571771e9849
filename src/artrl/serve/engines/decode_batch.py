"""The running decode batch of the built-in engine: rows join at step boundaries and leave when done.

A `DecodeBatch` holds, for the rows decoding together (of one adapter or several), one
KV cache, one attention mask and the per-row sampling state, all on the model's device:

```
               cache columns ->                      positions  counter
  row 0  [ .  .  p  p  p  p  t  t ]   (prompt 4, 2 sampled)   6        2
  row 1  [ p  p  p  p  p  p  t  t ]   (prompt 6, 2 sampled)   8        2
  row 2  [ .  .  .  .  .  p  p  p ]   (joined: prompt 3)       3        0
```

1. **Left padding that does not change the math.** Each row's real tokens are the
   right-most columns; the attention mask hides the rest (`.`), and explicit
   `position_ids` count from the row's first real token, so a row's logprobs match an
   unbatched forward to float tolerance.
2. **Joining.** Newcomers are prefilled on their own (one forward, prompts
   left-padded among themselves; the `n` samples of one request share one prefilled
   prompt), then their cache is left-padded or the batch's is, to the wider of the
   two, and the two are concatenated along the batch. This needs a cache of plain
   `DynamicLayer`s (no sliding window); with any other layout `can_join` is False and
   the engine starts newcomers in the next batch instead.
3. **Leaving.** A finished row leaves before the next forward (`keep`), and columns no
   remaining row uses are cut from the left, so a long row that ended frees its width.
4. **Images.** A vision-language model's newcomers bring their prompts' images (`admit(images=...)`):
   the prefill forward takes their pixel values and grids, and every prompt's 3-D rotary positions
   (models/vision.py; a text-only prompt's are its 1-D ones on every axis). The last prompt token is
   text, so its three positions are equal, and the rows decode on from the next one like any other.
5. **One host transfer per step.** `sample` draws every row's token on the device
   (serve/engines/sampling.py: each row's uniforms, hashed from its request seed for all of
   its steps when it joins, indexed by its own step counter) and brings back only the
   sampled ids, their raw logprobs and, when some row asked for them, the top
   logprobs, in one `tolist()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .sampling import row_uniforms, sample_next_tokens


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`t` padded with zeros on the left of `dim` to `width`."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def cat_uniforms(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    """Rows of `a` then of `b`, right-padded to the wider of the two (a row never reads past its own steps)."""
    if a is None:
        return b
    width = max(a.shape[1], b.shape[1])
    a, b = (torch.nn.functional.pad(t, (0, width - t.shape[1]), value=0.5) for t in (a, b))
    return torch.cat([a, b])


def row_counters(first: Sequence[int] | None, rows: int, device: torch.device) -> torch.Tensor:
    """[rows] int64: each row's sampling counter to start from (0 for a new row)."""
    if first is None:
        return torch.zeros(rows, dtype=torch.int64, device=device)
    return torch.tensor(list(first), dtype=torch.int64, device=device)


class DecodeBatch:
    """Rows decoding together; see the module docstring. `rows` are the engine's row records (opaque here)."""

    def __init__(self, model: Any, cache_kwarg: str, pad_id: int, device: torch.device, vision: Any = None) -> None:
        self._model = model
        self._vision = vision  # a vision-language model's models/vision.VisionInputs
        self._cache_kwarg = cache_kwarg
        self._pad_id = pad_id
        self.device = device
        self.rows: list[Any] = []
        self.spans: list[int] = []  # [batch] real cache columns of each row
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [batch, width] long
        self.positions: torch.Tensor | None = None  # [batch] long, position id of the next token
        self.uniforms: torch.Tensor | None = None  # [batch, steps] float32, each row's draw for each of its steps
        self.counters: torch.Tensor | None = None  # [batch] int64, tokens sampled so far
        self.temperature: torch.Tensor | None = None  # [batch] float32
        self.top_p: torch.Tensor | None = None  # [batch] float32
        self.logits: torch.Tensor | None = None  # [batch, vocab] float32, next-token logits of every row

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def can_join(self) -> bool:
        """Whether newcomers can be merged into this batch's cache (plain dynamic layers only)."""
        return self.cache is None or all(type(layer) is DynamicLayer for layer in self.cache.layers)

    # ------------------------------------------------------------------ joining

    def _prefill(self, prompts: Sequence[list[int]], adapters: dict[str, Any] | None = None,
                 images: Sequence[Sequence[Any]] | None = None
                 ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward over `prompts`, left-padded to the longest: their cache, attention mask [prompts, width],
        position ids [prompts, width] (the text axis of a vision-language model's) and last-position logits
        [prompts, vocab] (float32). `adapters`: extra forward arguments choosing each prompt's adapter (peft's
        `adapter_names`), or None. `images`: each prompt's processed images (module docstring, point 4)."""
        width = max(len(p) for p in prompts)
        padded = any(len(p) != width for p in prompts)
        if padded:
            input_ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)  # [prompts, width]
            mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [prompts, width]
            for i, prompt in enumerate(prompts):
                input_ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
                mask[i, width - len(prompt):] = 1
        else:  # one prompt, or all of one length: no padding to write
            input_ids = torch.tensor(prompts, dtype=torch.long)  # [prompts, width]
            mask = torch.ones((len(prompts), width), dtype=torch.long)  # [prompts, width]
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # [prompts, width]
        extra: dict[str, Any] = dict(adapters or {})
        if images:
            extra.update(self._image_inputs(prompts, images, width))
            position_ids = extra["position_ids"][0]  # [prompts, width]: the last token's axes are equal
        else:
            extra["position_ids"] = position_ids
        cache = DynamicCache(config=self._model.config)
        # Without padding the model's own causal mask is the whole mask: passing none spares building a padding
        # mask each prefill (the same logits; the batch keeps `mask` for its later steps).
        # the last position's logits only, picked by index: transformers slices hidden_states[:, -1:, :] for an int,
        # and on a CPU torch's linear over that strided view expands the LM head's weight once per prompt (a full
        # [vocab, hidden] copy each: 1.2 GB a prompt at 14B); an index tensor gives a contiguous copy instead
        last = torch.tensor([width - 1], device=self.device)
        out = self._model(input_ids=input_ids, attention_mask=mask if padded else None,
                          use_cache=True, logits_to_keep=last, **{self._cache_kwarg: cache}, **extra)
        return cache, mask, position_ids, out.logits[:, -1, :].float()

    def _image_inputs(self, prompts: Sequence[list[int]], images: Sequence[Sequence[Any]], width: int
                      ) -> dict[str, Any]:
        """The prefill's pixel values, grids and [3, prompts, width] position ids (left-padded prompts)."""
        if self._vision is None:
            raise RuntimeError("a prompt with images reached an engine without a vision-language model")
        rope = torch.zeros((3, len(prompts), width), dtype=torch.long)  # [3, prompts, width]
        for i, (prompt, mine) in enumerate(zip(prompts, images)):
            spans = list(zip(self._vision.spans(prompt, mine, "prompt_ids"), mine))
            rope[:, i, width - len(prompt):] = self._vision.positions(len(prompt), spans)  # [3, len]
        flat = [image for mine in images for image in mine]
        return {"position_ids": rope.to(self.device),
                "pixel_values": torch.cat([image.pixels for image in flat]).to(self.device),  # [patches, values]
                "image_grid_thw": torch.tensor([image.grid for image in flat], dtype=torch.long, device=self.device)}

    def admit(self, rows: Sequence[Any], prompts: Sequence[list[int]], prompt_of_row: Sequence[int],
              keys: Sequence[int], temperature: Sequence[float], top_p: Sequence[float],
              adapters: dict[str, Any] | None = None, images: Sequence[Sequence[Any]] | None = None,
              first_counters: Sequence[int] | None = None) -> None:
        """Prefill `prompts` (one forward; `adapters`, `images`: see `_prefill`) and add `rows` (row j samples from
        prompts[prompt_of_row[j]]). `first_counters`: each row's tokens sampled already (a row whose cache is
        recomputed, serve/engines/decode_loop.py: it keeps drawing its own uniforms from there); None: 0."""
        device = self.device
        cache, mask, position_ids, logits = self._prefill(prompts, adapters, images)
        positions = position_ids[:, -1] + 1  # [prompts]
        if list(prompt_of_row) != list(range(len(prompts))):  # n samples of one prompt: repeat its prefill
            index = torch.tensor(prompt_of_row, dtype=torch.long, device=device)  # [rows]
            cache.batch_select_indices(index)
            mask, positions, logits = mask[index], positions[index], logits[index]
        new_state = {
            "mask": mask, "positions": positions, "logits": logits,
            "uniforms": row_uniforms(list(keys), max(r.request.max_tokens for r in rows)).to(device),
            "counters": row_counters(first_counters, len(rows), device),
            "temperature": torch.tensor(list(temperature), dtype=torch.float32, device=device),
            "top_p": torch.tensor(list(top_p), dtype=torch.float32, device=device),
        }
        spans = [len(prompts[p]) for p in prompt_of_row]
        if self.cache is None or not self.rows:
            self.cache = cache
            for name, value in new_state.items():
                setattr(self, name, value)
            self.rows, self.spans = list(rows), spans
            return
        if not self.can_join:
            raise RuntimeError("this batch's cache cannot take new rows (check can_join first)")
        assert self.mask is not None
        total = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_pad_left(mine.keys, total, 2), _pad_left(theirs.keys, total, 2)])
            mine.values = torch.cat([_pad_left(mine.values, total, 2), _pad_left(theirs.values, total, 2)])
        self.mask = torch.cat([_pad_left(self.mask, total, 1), _pad_left(mask, total, 1)])  # [batch, total]
        for name in ("positions", "logits", "counters", "temperature", "top_p"):
            setattr(self, name, torch.cat([getattr(self, name), new_state[name]]))
        self.uniforms = cat_uniforms(self.uniforms, new_state["uniforms"])
        self.rows += list(rows)
        self.spans += spans

    # ------------------------------------------------------------------ one step

    def sample(self, allowed: torch.Tensor | None, top_logprobs: int) -> list[list[float]]:
        """Draw each row's next token from `allowed` (the logits after any grammar mask; None: `logits`).

        Returns, per row, [token id, its raw logprob, then `top_logprobs` ids and `top_logprobs` logprobs]
        as floats (ids are exact: float32 below 2**24), in one host transfer. Also stores the ids for `advance`.
        """
        assert self.logits is not None and self.temperature is not None and self.top_p is not None
        requests = [row.request for row in self.rows]
        temperatures = [r.temperature for r in requests]
        logits = self.logits  # [batch, vocab]
        all_greedy = all(t <= 0 for t in temperatures)
        uniform = None if all_greedy else self.uniforms.gather(1, self.counters[:, None]).squeeze(1)  # [batch]
        tokens = sample_next_tokens(
            logits if allowed is None else allowed, self.temperature, self.top_p, uniform, all_greedy=all_greedy,
            any_top_p=any(r.top_p < 1.0 and r.temperature > 0 for r in requests),
            any_greedy=any(t <= 0 for t in temperatures), any_scaled=any(t != 1.0 for t in temperatures))  # [batch]
        self._tokens = tokens
        logprobs = logits.log_softmax(dim=-1)  # [batch, vocab]; raw: before temperature, top-p, grammar
        # ids travel as float32 (exact below 2**24; the engine checks its vocabulary is smaller)
        parts = [tokens[:, None].float(), logprobs.gather(-1, tokens[:, None])]  # [batch, 1] each
        if top_logprobs > 0:
            top_values, top_ids = logprobs.topk(top_logprobs, dim=-1)  # [batch, k] each
            parts += [top_ids.float(), top_values]
        return torch.cat(parts, dim=1).tolist()  # the step's one host sync

    def keep(self, kept: list[int]) -> None:
        """Keep only rows `kept` (indices into `rows`), and cut cache columns no kept row uses."""
        if len(kept) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in kept]
        self.spans = [self.spans[i] for i in kept]
        if not kept:
            self.cache = None
            return
        assert self.cache is not None and self.mask is not None
        index = torch.tensor(kept, dtype=torch.long, device=self.device)  # [kept]
        self.cache.batch_select_indices(index)
        for name in ("mask", "positions", "logits", "uniforms", "counters", "temperature", "top_p", "_tokens"):
            setattr(self, name, getattr(self, name)[index])
        cut = self.mask.shape[1] - max(self.spans)
        if cut > 0 and self.can_join:  # trimming, like joining, needs plain dynamic layers
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, cut:], layer.values[:, :, cut:]
            self.mask = self.mask[:, cut:]

    def advance(self, adapter_names: list[str] | None = None, graph_key: Any = None) -> None:
        """Feed every row's sampled token through the model: the next step's logits. `adapter_names`: each
        row's adapter (peft's mixed-adapter forward), or None: the model's active adapter for every row.
        `graph_key`: see `StaticDecodeBatch.advance` (unused here)."""
        assert self.mask is not None and self.positions is not None and self.counters is not None
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=-1)  # [batch, width + 1]
        extra = {"adapter_names": adapter_names} if adapter_names is not None else {}
        out = self._model(input_ids=self._tokens[:, None], attention_mask=self.mask,
                          position_ids=self.positions[:, None], use_cache=True,
                          **{self._cache_kwarg: self.cache}, **extra)
        self.logits = out.logits[:, -1, :].float()  # [batch, vocab]
        self.positions = self.positions + 1
        self.counters = self.counters + 1
        self.spans = [s + 1 for s in self.spans]
