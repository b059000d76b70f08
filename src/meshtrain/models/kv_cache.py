"""Key/value caches for generation: every layer's keys and values of the tokens already run, so
that a step runs only its new tokens.

    cache = model.kv_cache(capacity=64)
    logits = model(prompt, cache=cache)      # prefill: positions 0 .. s-1
    logits = model(next_ids, cache=cache)    # one token: position cache.length

The cache is an object passed through `CausalLM.forward(..., cache=)` to each block's attention,
not state kept in the modules: training never passes one, so the training path stays the code it
was, and a model holds nothing between calls (two caches decode two sequences with one model).
Each rank caches the keys and values of its own heads as its attention computes them (rotated,
in rotary families; a key/value head shared by several tensor-parallel ranks is cached on each
of them): nothing is gathered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from meshtrain.errors import Code, SettingError


class LayerCache:
    """One layer's keys and values `[b, kv heads/tp, t, d]` (multi-head latent attention: its
    latent `[b, 1, t, r]` and shared rotary key `[b, 1, t, rope]`), in buffers of `capacity` tokens
    that the first `extend` allocates (so they take the layer's dtype, device and heads). With
    a sliding `window` it keeps only the last `window - 1` tokens, all a later query can see."""

    def __init__(self, capacity: int, window: int | None = None):
        self.capacity, self.window, self.length = capacity, window, 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Append the new tokens' keys and values `[b, kv, s, d]`; returns the keys and values
        the new queries attend over and the sequence index of the first of them."""
        end = self.length + k.shape[-2]
        if end > self.capacity:
            raise SettingError(Code.KV_CACHE,
                               f"the key/value cache holds {self.capacity} tokens, {end} were"
                               " asked: make a larger one (at most `max_seq_len`)")
        if self.window is not None:
            return self._extend_window(k, v, end)
        if self.keys is None:
            self.keys = k.new_empty((*k.shape[:2], self.capacity, k.shape[-1]))
            self.values = v.new_empty((*v.shape[:2], self.capacity, v.shape[-1]))
        self.keys[:, :, self.length:end] = k
        self.values[:, :, self.length:end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end], 0

    def _extend_window(self, k: torch.Tensor, v: torch.Tensor, end: int):
        kept = 0 if self.keys is None else self.keys.shape[-2]
        keys = k if self.keys is None else torch.cat([self.keys, k], dim=-2)
        values = v if self.values is None else torch.cat([self.values, v], dim=-2)
        first, self.length = self.length - kept, end
        drop = max(0, keys.shape[-2] - (self.window - 1))
        self.keys, self.values = keys[:, :, drop:], values[:, :, drop:]
        return keys, values, first


class KVCache:
    """The caches of a model's layers (`cache[index]`), keyed by global layer index; `length`
    is how many tokens have run through them, which is the position of the next token (a
    windowed cache holds fewer)."""

    def __init__(self, layers: Iterable[int], capacity: int, *,
                 window_of: Callable[[int], int | None] = lambda index: None):
        self.capacity = capacity
        self.layers = {index: LayerCache(capacity, window_of(index)) for index in layers}

    def __getitem__(self, index: int) -> LayerCache:
        return self.layers[index]

    @property
    def length(self) -> int:
        return next(iter(self.layers.values())).length
