# Copyright kvferry authors. Apache-2.0.
"""Hugging Face transformers integration: kvferry holds a Llama-family model's KV cache and
computes its attention, choosing per step the positions each query attends.

    import kvferry.hf                      # registers attn_implementation="kvferry"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="kvferry")
    cache = kvferry.hf.KvferryCache(model.config, policy="lfps", budget=256)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64)
    cache.runtime.stats()                  # rows per tier, PCIe bytes, ...

Tested with transformers 5.x (pyproject: ``transformers>=5.0,<6``; CI pins 5.23.0).

How it fits transformers' interfaces: ``KvferryCache`` is a ``transformers.Cache`` whose layers keep no
K/V of their own: a layer's ``update`` hands the new (post-RoPE) k/v to the attention call that
follows it and returns them unchanged; the attention function registered as "kvferry" then calls
``Runtime.prefill`` (prompt chunks, causal) or ``Runtime.decode`` (one token per sequence, sparse),
which store them. The attention function finds the cache through the cache's own ``update`` call
just before it (transformers does not pass the cache to attention functions), so a model runs one
forward at a time per thread. Batch row b is kvferry sequence b.

Not supported, and refused with an error: padded batches (a padding attention mask), beam search
(reordering the cache), cropping, sliding-window layers, attention dropout, and a softmax scale
other than 1/sqrt(head_dim).
"""
from __future__ import annotations

import math
import threading
from typing import Any, Dict, Optional

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

import kvferry

__all__ = ["KvferryCache", "kvferry_attention_forward"]

_ACTIVE = threading.local()  # the KvferryCache whose update ran last on this thread


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class KvferryLayer(CacheLayerMixin):
    """One model layer of a KvferryCache: stores nothing itself (kvferry does)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, cache: "KvferryCache", layer_idx: int) -> None:
        super().__init__()
        self._cache = cache
        self._layer = layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._cache._pending[self._layer] = (key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int):
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._cache._length(self._layer)

    def get_max_length(self) -> int:
        return self._cache.max_tokens

    def reset(self) -> None:
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("kvferry.hf: beam search (reordering the cache) is not supported")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("kvferry.hf: cropping the cache is not supported")

    def offload(self) -> None:  # kvferry places the KV itself
        pass

    def prefetch(self) -> None:
        pass


class KvferryCache(Cache):
    """A transformers ``Cache`` backed by one :class:`kvferry.Runtime`.

    ``config``: the model's config (num_hidden_layers, num_attention_heads, num_key_value_heads,
    head_dim). ``policy``/``budget``/``params``: the selection (see :func:`kvferry.policy_names`);
    ``budget`` counts the tokens attended per sequence and KV head, sinks and window included.
    ``sink_tokens``/``window_tokens``: the resident tiers. ``max_tokens``: longest sequence;
    ``max_batch``: batch rows. Further keyword arguments are :class:`kvferry.RuntimeConfig` fields.
    """

    def __init__(self, config: Any, policy: str = "lfps", budget: int = 256,
                 sink_tokens: int = 4, window_tokens: int = 256, backend: str = "auto",
                 route: str = "auto", params: Optional[Dict[str, float]] = None,
                 max_tokens: int = 32768, max_batch: int = 8, kv_dtype: str = "bf16",
                 max_prefill_chunk: int = 4096, **runtime_fields: Any) -> None:
        c = _text_config(config)
        layer_types = getattr(c, "layer_types", None) or []
        if getattr(c, "sliding_window", None) and any("sliding" in t for t in layer_types):
            raise ValueError("kvferry.hf: models with sliding-window layers are not supported")
        num_q = c.num_attention_heads
        num_kv = getattr(c, "num_key_value_heads", None) or num_q
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // num_q
        self.max_tokens = max_tokens
        self.head_dim = head_dim
        self.runtime = kvferry.Runtime(
            num_layers=c.num_hidden_layers, num_q_heads=num_q, num_kv_heads=num_kv,
            head_dim=head_dim, kv_dtype=kv_dtype, max_sequences=max_batch,
            max_tokens_per_sequence=max_tokens, max_batch=max_batch,
            max_prefill_chunk=max_prefill_chunk, sink_tokens=sink_tokens,
            window_tokens=window_tokens, policy=policy, budget=budget, params=dict(params or {}),
            route=route, backend=backend, **runtime_fields)
        self._pending: Dict[int, Any] = {}
        self._batch: Optional[int] = None
        super().__init__(layers=[KvferryLayer(self, i) for i in range(c.num_hidden_layers)])

    # --- transformers' Cache interface -----------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any):
        _ACTIVE.cache = self
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def reset(self) -> None:
        """Drops every sequence (a new generate call may then start another batch)."""
        if self._batch is not None:
            for b in range(self._batch):
                self.runtime.remove_sequence(b)
        self._batch = None
        self._pending.clear()
        for layer in self.layers:
            layer.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("kvferry.hf: beam search (reordering the cache) is not supported")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("kvferry.hf: cropping the cache is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("kvferry.hf: expanding the batch of a cache is not supported")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("kvferry.hf: selecting batch rows of a cache is not supported")

    # --- kvferry's side ----------------------------------------------------------------------------
    def _length(self, layer: int) -> int:
        if self._batch is None:
            return 0
        return self.runtime.sequence_length(0, layer)

    def _ensure_batch(self, batch: int) -> None:
        if self._batch is None:
            for b in range(batch):
                self.runtime.add_sequence(b)
            self._batch = batch
        elif batch != self._batch:
            raise ValueError(f"kvferry.hf: this cache holds a batch of {self._batch} sequences; got "
                             f"{batch} (call cache.reset() to start another)")

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor) -> torch.Tensor:
        """Attention of query [B, Hq, T, D] at ``layer`` through kvferry, storing key/value
        [B, Hkv, T, D]; returns [B, T, Hq, D] (the layout transformers' attention functions return)."""
        bsz, _, t, _ = query.shape
        self._ensure_batch(bsz)
        out = torch.empty((bsz, t, query.shape[1], query.shape[3]), dtype=query.dtype,
                          device=query.device)
        q = query.transpose(1, 2)
        k = key.transpose(1, 2)
        v = value.transpose(1, 2)
        if t == 1:
            self.runtime.decode(list(range(bsz)), layer, q[:, 0].contiguous(),
                                k[:, 0].contiguous(), v[:, 0].contiguous(), out=out[:, 0])
            return out
        chunk = self.runtime.config.max_prefill_chunk
        for b in range(bsz):
            for t0 in range(0, t, chunk):
                t1 = min(t, t0 + chunk)
                self.runtime.prefill(b, layer, q[b, t0:t1].contiguous(), k[b, t0:t1].contiguous(),
                                     v[b, t0:t1].contiguous(), out=out[b, t0:t1])
        return out

    def kv_bytes_on_gpu(self) -> int:
        """Device bytes kvferry holds now (resident tier, bank, plans); 0 on the host backend."""
        return int(self.runtime.stats()["device_bytes_reserved"]) if self.runtime.backend == "cuda" else 0


def kvferry_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                              scaling: Optional[float] = None, dropout: float = 0.0,
                              **kwargs: Any):
    """transformers attention function ("kvferry"): the layer's attention through the
    KvferryCache whose update ran just before. Returns (output [B, T, Hq, D], None)."""
    cache = getattr(_ACTIVE, "cache", None)
    layer = getattr(module, "layer_idx", None)
    if cache is None or layer is None or layer not in cache._pending:
        raise ValueError("kvferry.hf: attn_implementation='kvferry' needs a kvferry.hf.KvferryCache "
                         "passed as past_key_values (and use_cache=True)")
    cache._pending.pop(layer)
    _ACTIVE.cache = None  # the next layer's update names its cache again
    if dropout:
        raise ValueError("kvferry.hf: attention dropout is not supported (call model.eval())")
    d = query.shape[-1]
    if scaling is not None and abs(scaling - 1.0 / math.sqrt(d)) > 1e-6 * scaling:
        raise ValueError(f"kvferry.hf: softmax scale {scaling} is not 1/sqrt(head_dim)")
    return cache.attend(layer, query, key, value), None


def kvferry_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                 kv_offset: int = 0, mask_function: Any = None,
                 attention_mask: Optional[torch.Tensor] = None, **kwargs: Any) -> None:
    """The mask function of "kvferry": kvferry applies causality itself, so no mask is built; a
    padding mask is refused."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("kvferry.hf: padded batches are not supported (give sequences of equal "
                         "length, or one sequence per cache)")
    return None


AttentionInterface.register("kvferry", kvferry_attention_forward)
AttentionMaskInterface.register("kvferry", kvferry_mask)
