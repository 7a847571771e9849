"""A decode batch with a static KV cache of fixed slots, whose decode step a CUDA graph can replay.

`DecodeBatch` (serve/engines/decode_batch.py) grows its cache by concatenation and changes shape
whenever a row joins or leaves: fine for eager decoding, impossible to capture. Here every
shape is fixed for the life of the engine:

```
             columns ->  0  1  2  3  4  5  6  7          column (= next position)
  slot 0  [ p  p  p  t  t  .  .  . ]   live                 5
  slot 1  [ x  x  x  x  x  x  .  . ]   free (stale; never read by a live row)
  slot 2  [ p  p  p  p  p  p  p  . ]   live (just joined)   7
```

1. **Slots, not padding.** `slots` rows of `length` columns per layer, allocated once.
   A row takes a free slot; its prompt's KV (prefilled with the dynamic cache, one
   forward for all newcomers) is copied to columns 0..len-1, so a row's column is its
   position id and no row is ever padded. A row's token at step s is written at its
   own column (`SlotLayer.update`, a scatter), and its attention mask is
   `column_index <= column`: everything it wrote, nothing of the slot's previous owner.
2. **One fixed-shape step.** The decode step runs all `slots` rows (free ones too:
   their output is ignored, their writes land in their own free slot) with an
   explicit 4-D boolean mask, so transformers builds no mask and the step's inputs are
   three fixed buffers (tokens, columns, and the cache). It needs `sdpa` attention.
3. **CUDA graph.** With `graph=True` (CUDA only), the step is captured once with
   `torch.cuda.CUDAGraph` after a warm-up on a side stream, and replayed every step:
   one launch instead of one per kernel. A captured graph reads the weights at the
   addresses they had at capture time, so it is keyed by the adapter the model runs
   (the engine's single-adapter mode) and captured again when that changes; a step
   whose rows run different adapters (peft's `adapter_names`, one per slot, free slots
   on the base weights) runs eagerly.
4. **What fits.** A row fits when its prompt plus `max_tokens` fit in `length`
   columns; the engine runs rows that do not fit in a dynamic batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from .adapter_versions import PEFT_BASE
from .decode_batch import DecodeBatch, cat_uniforms, row_counters
from .sampling import row_uniforms


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values, [slots, heads, length, head_dim], written at each slot's own column."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.columns = keys, values, columns  # columns: [slots] long, shared by layers
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocated up front; nothing to do."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [slots, heads, 1, head_dim]
        index = self.columns.view(-1, 1, 1, 1).expand(-1, key_states.shape[1], 1, key_states.shape[3])
        self.keys.scatter_(2, index, key_states)
        self.values.scatter_(2, index.expand(-1, value_states.shape[1], 1, value_states.shape[3]), value_states)
        return self.keys, self.values

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return self.keys.shape[-2], 0

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        return self.keys.shape[-2]

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


class SlotCache(Cache):
    """The KV cache of every layer in `slots` x `length` static tensors (allocated once per engine)."""

    def __init__(self, prefilled: DynamicCache, slots: int, length: int) -> None:
        device = prefilled.layers[0].keys.device
        self.columns = torch.zeros(slots, dtype=torch.long, device=device)  # [slots]
        layers = []
        for layer in prefilled.layers:
            _, heads, _, key_dim = layer.keys.shape
            value_dim = layer.values.shape[-1]
            keys = torch.zeros((slots, heads, length, key_dim), dtype=layer.keys.dtype, device=device)
            values = torch.zeros((slots, heads, length, value_dim), dtype=layer.values.dtype, device=device)
            layers.append(SlotLayer(keys, values, self.columns))
        super().__init__(layers=layers)
        self.slots, self.length = slots, length


class StaticStep:
    """The fixed-shape decode step of one `SlotCache`: eager, or replayed from a captured CUDA graph."""

    def __init__(self, model: Any, cache_kwarg: str, cache: SlotCache, pad_id: int) -> None:
        self._model, self._cache_kwarg, self.cache = model, cache_kwarg, cache
        device = cache.columns.device
        self.tokens = torch.full((cache.slots, 1), pad_id, dtype=torch.long, device=device)  # [slots, 1]
        self._column_index = torch.arange(cache.length, device=device)  # [length]
        self.logits: torch.Tensor | None = None  # [slots, vocab] float32, after `run`
        self._graph: Any = None
        self._graph_key: Any = None  # what the captured graph computes with (the engine's adapter mode)
        #: Graphs captured so far (for tests and logs).
        self.captures = 0

    def _forward(self, adapter_names: list[str] | None = None) -> torch.Tensor:
        columns = self.cache.columns  # [slots]
        mask = (self._column_index[None, :] <= columns[:, None])[:, None, None, :]  # [slots, 1, 1, length]
        extra = {"adapter_names": adapter_names} if adapter_names is not None else {}
        out = self._model(input_ids=self.tokens, attention_mask=mask, position_ids=columns[:, None],
                          use_cache=True, **{self._cache_kwarg: self.cache}, **extra)
        return out.logits[:, -1, :].float()  # [slots, vocab]

    def run(self, graph_key: Any = None, adapter_names: list[str] | None = None) -> torch.Tensor:
        """One step for every slot: writes each slot's token at its column; returns [slots, vocab] logits.

        `graph_key` None: eager (with `adapter_names`, one per slot, when given). Otherwise replay the graph
        captured for `graph_key` (the adapter the model runs), captured again when the key changed: a graph
        reads the weights at the addresses it was captured with."""
        if graph_key is None:
            self.logits = self._forward(adapter_names)
            return self.logits
        if self._graph is None or self._graph_key != graph_key:
            self._capture()
            self._graph_key = graph_key
        self._graph.replay()
        assert self.logits is not None
        return self.logits

    def _capture(self) -> None:
        # Warm up on a side stream (lazy initialisations, allocator), then capture (PyTorch's CUDA graph recipe).
        # The warm-up and the capture write each slot's current token at its current column, what the replay
        # that follows writes there again, and advance no column: safe with rows in the slots.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a trainer launching kernels from its own thread meanwhile is not an error of the capture
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.logits = self._forward()
        self._graph = graph
        self.captures += 1


class StaticDecodeBatch(DecodeBatch):
    """`DecodeBatch`'s interface over a `StaticStep`: rows live in slots; see the module docstring."""

    def __init__(self, model: Any, cache_kwarg: str, pad_id: int, device: torch.device, step: StaticStep,
                 graph: bool) -> None:
        super().__init__(model, cache_kwarg, pad_id, device)
        self.step_fn, self.graph = step, graph
        self.slot_of: list[int] = []  # [batch] the slot of each row
        self._slot_index: torch.Tensor | None = None  # [batch] long, on the device

    @property
    def can_join(self) -> bool:
        return len(self.rows) < self.step_fn.cache.slots

    def fits(self, prompt_len: int, max_tokens: int) -> bool:
        return prompt_len + max_tokens <= self.step_fn.cache.length

    def admit(self, rows: Sequence[Any], prompts: Sequence[list[int]], prompt_of_row: Sequence[int],
              keys: Sequence[int], temperature: Sequence[float], top_p: Sequence[float],
              adapters: dict[str, Any] | None = None, images: Sequence[Sequence[Any]] | None = None,
              first_counters: Sequence[int] | None = None) -> None:
        if images:
            raise RuntimeError("rows with images never take a static cache slot (DecodeLoop._fits)")
        device, cache = self.device, self.step_fn.cache
        free = sorted(set(range(cache.slots)) - set(self.slot_of))
        if len(rows) > len(free):
            raise RuntimeError(f"{len(rows)} rows cannot join: {len(free)} free slots")
        prefilled, mask, _, logits = self._prefill(prompts, adapters)
        width = mask.shape[1]
        slots = free[:len(rows)]
        for slot, p in zip(slots, prompt_of_row):  # the prompt's right-aligned columns -> the slot's first ones
            n = len(prompts[p])
            for mine, theirs in zip(cache.layers, prefilled.layers):
                mine.keys[slot, :, :n] = theirs.keys[p, :, width - n:]
                mine.values[slot, :, :n] = theirs.values[p, :, width - n:]
        slot_tensor = torch.tensor(slots, dtype=torch.long, device=device)  # [new]
        cache.columns[slot_tensor] = torch.tensor([len(prompts[p]) for p in prompt_of_row], dtype=torch.long,
                                                  device=device)
        index = torch.tensor(list(prompt_of_row), dtype=torch.long, device=device)  # [new]
        new_logits = logits[index]  # [new, vocab]
        new_uniforms = row_uniforms(list(keys), max(r.request.max_tokens for r in rows)).to(device)
        new_temperature = torch.tensor(list(temperature), dtype=torch.float32, device=device)
        new_top_p = torch.tensor(list(top_p), dtype=torch.float32, device=device)
        counters = row_counters(first_counters, len(rows), device)
        if not self.rows:
            self.logits, self.uniforms, self.counters = new_logits, new_uniforms, counters
            self.temperature, self.top_p = new_temperature, new_top_p
        else:
            assert self.logits is not None and self.counters is not None
            assert self.temperature is not None and self.top_p is not None
            self.logits = torch.cat([self.logits, new_logits])
            self.uniforms = cat_uniforms(self.uniforms, new_uniforms)
            self.counters = torch.cat([self.counters, counters])
            self.temperature = torch.cat([self.temperature, new_temperature])
            self.top_p = torch.cat([self.top_p, new_top_p])
        self.rows += list(rows)
        self.slot_of += slots
        self._slot_index = torch.tensor(self.slot_of, dtype=torch.long, device=device)

    def keep(self, kept: list[int]) -> None:
        if len(kept) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in kept]
        self.slot_of = [self.slot_of[i] for i in kept]
        if not kept:
            return
        index = torch.tensor(kept, dtype=torch.long, device=self.device)  # [kept]
        for name in ("logits", "uniforms", "counters", "temperature", "top_p", "_tokens"):
            setattr(self, name, getattr(self, name)[index])
        self._slot_index = torch.tensor(self.slot_of, dtype=torch.long, device=self.device)

    def advance(self, adapter_names: list[str] | None = None, graph_key: Any = None) -> None:
        """One step (see `DecodeBatch.advance`); replayed from a CUDA graph when this batch may use one, every
        row runs the model's active adapter (`adapter_names` None) and `graph_key` names that adapter."""
        assert self._slot_index is not None and self.counters is not None
        step = self.step_fn
        step.tokens[self._slot_index, 0] = self._tokens
        slot_names = None
        if adapter_names is not None:  # free slots run the base weights (their output is never read)
            slot_names = [PEFT_BASE] * step.cache.slots
            for slot, name in zip(self.slot_of, adapter_names):
                slot_names[slot] = name
        key = graph_key if self.graph and adapter_names is None else None
        logits = step.run(key, slot_names)  # [slots, vocab]
        step.cache.columns[self._slot_index] += 1
        self.logits = logits[self._slot_index]  # [batch, vocab]; a copy: the next replay overwrites the buffer
        self.counters = self.counters + 1
