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

Tensor parallelism (transformers' ``tp_plan="auto"`` / ``DistributedConfig(tp_size=N)`` under
``torchrun``): each rank's attention sees its own slice of the heads, so each rank's KvferryCache
creates one Runtime over its local heads (query heads / world, KV heads / world), with nothing to
communicate inside attention. ``KvferryCache(model.config)`` (or ``KvferryCache(model)``) reads the
world size from what ``from_pretrained`` recorded; ``tp_size=`` says it for a model sharded by other
means. Sequence ids are the same on every rank; ``runtime.stats()`` counts this rank's heads only.
See docs/tensor-parallel.md.

Sliding-window layers (Gemma 2/3, Mistral, GPT-OSS-style alternation): ``KvferryCache`` reads the
config's ``layer_types`` ("sliding_attention" / "full_attention") and ``sliding_window`` (without
``layer_types``, a ``sliding_window`` applies to every layer, as Mistral's does) into the Runtime's
per-layer windows (``RuntimeConfig.layer_window``): a sliding layer attends its last
``sliding_window`` tokens exactly, kept on the device, never offloaded; the global layers get the
policy. A window wider than ``max_tokens`` is the whole sequence and is clamped to it. The softmax
scale is ``query_pre_attn_scalar ** -0.5`` where the config has one (Gemma), else 1/sqrt(head_dim).

Not supported, and refused with an error: padded batches (a padding attention mask), beam search
(reordering the cache), cropping, attention dropout, attention logit soft-capping (Gemma 2),
learned attention sinks (GPT-OSS's ``s_aux``), other layer types (chunked or linear attention),
and a softmax scale other than the cache's.
"""
from __future__ import annotations

import math
import os
import threading
from typing import Any, Dict, List, Optional, Tuple

import kvferry

try:
    import torch
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as e:  # the package's 'hf' extra is not installed
    raise kvferry.missing_extra("hf", "kvferry.hf", e) from e

__all__ = ["KvferryCache", "kvferry_attention_forward", "kv_tensor_bytes"]

_ACTIVE = threading.local()  # the KvferryCache whose update ran last on this thread


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


# Projections whose output holds the keys (fused or not): a "colwise" rule on one of them in the
# tensor-parallel plan shards the attention heads over the ranks (transformers' own test, in
# transformers.distributed.tensor_parallel.get_kv_heads_per_rank).
_KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value")


def _plan_shards_heads(plan: Optional[Dict[str, str]]) -> bool:
    return any(key.rsplit(".", 1)[-1] in _KEY_PROJECTIONS and style == "colwise"
               for key, style in (plan or {}).items())


def _tensor_parallel(model_or_config: Any, tp_size: Optional[int],
                     tp_rank: Optional[int]) -> Tuple[int, int, Any, Optional[torch.nn.Module]]:
    """(ranks the heads are split over, this rank among them, config, model or None).

    Without ``tp_size``: the world size transformers' ``from_pretrained`` recorded (the model's
    ``tp_size``, or ``config.distributed_config.tp_size`` for a config), where its plan shards the
    key projection; 1 otherwise."""
    model = model_or_config if isinstance(model_or_config, torch.nn.Module) else None
    config = model.config if model is not None else model_or_config
    if tp_size is None:
        dist_cfg = getattr(config, "distributed_config", None)
        if model is not None:
            size = getattr(model, "tp_size", None) or 1
            plan = getattr(model, "tp_plan", None) or {}
        else:
            size = getattr(dist_cfg, "tp_size", None) or 1
            plan = dict(getattr(_text_config(config), "base_model_tp_plan", None) or
                        getattr(config, "base_model_tp_plan", None) or {})
            override = getattr(dist_cfg, "tp_plan", None)
            if isinstance(override, dict):
                plan = plan | override if override else {}
        tp_size = size if size > 1 and _plan_shards_heads(plan) else 1
    if tp_size < 1:
        raise ValueError(f"kvferry.hf: tp_size {tp_size} must be >= 1")
    if tp_rank is None:
        tp_rank = 0
        if tp_size > 1:
            mesh = getattr(model, "_device_mesh", None) if model is not None else None
            if mesh is not None and "tp" in (getattr(mesh, "mesh_dim_names", None) or ()):
                tp_rank = mesh["tp"].get_local_rank()
            elif torch.distributed.is_available() and torch.distributed.is_initialized():
                tp_rank = torch.distributed.get_rank() % tp_size  # tp: the mesh's innermost axis
            else:
                tp_rank = int(os.environ.get("RANK", "0")) % tp_size
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"kvferry.hf: tp_rank {tp_rank} is not in [0, {tp_size})")
    return tp_size, tp_rank, config, model


def kv_tensor_bytes(cache: Any) -> int:
    """Bytes of the K/V tensors a transformers cache holds in its layers (a DynamicCache's, on
    whatever device they are); for a :class:`KvferryCache`, see ``kv_bytes_on_gpu``."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def layer_windows(config: Any, max_tokens: int) -> List[int]:
    """Per layer of a transformers config, 0 (global attention) or its sliding window in tokens
    (the new token included: transformers' ``kv_idx > q_idx - sliding_window``): from
    ``layer_types`` ("full_attention" / "sliding_attention"; Gemma 2/3, GPT-OSS, Qwen2) with
    ``sliding_window``; without ``layer_types``, ``sliding_window`` for every layer (Mistral). A
    window wider than ``max_tokens`` attends the whole sequence and is clamped to it. Empty when
    every layer is global."""
    c = _text_config(config)
    n = c.num_hidden_layers
    window = getattr(c, "sliding_window", None) or 0
    if getattr(c, "use_sliding_window", True) is False:  # Qwen2-style switch, when layer_types is absent
        window = 0
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"kvferry.hf: sliding_window {window!r} must be a positive int or None")
    types = getattr(c, "layer_types", None)
    if types:
        if len(types) != n:
            raise ValueError(f"kvferry.hf: layer_types has {len(types)} entries for "
                             f"{n} layers (num_hidden_layers)")
        windows = []
        for i, t in enumerate(types):
            if t == "full_attention":
                windows.append(0)
            elif t == "sliding_attention":
                if not window:
                    raise ValueError(f"kvferry.hf: layer {i} is 'sliding_attention' but "
                                     f"sliding_window is {getattr(c, 'sliding_window', None)!r}")
                windows.append(window)
            else:
                raise ValueError(f"kvferry.hf: layer {i}'s attention type {t!r} is not supported "
                                 "(full_attention or sliding_attention)")
    else:
        windows = [window] * n
    windows = [min(w, max_tokens) for w in windows]
    return windows if any(windows) else []


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class KvferryLayer(CacheLayerMixin):
    """One model layer of a KvferryCache: stores nothing itself (kvferry does)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, cache: "KvferryCache", layer_idx: int, window: int = 0) -> None:
        super().__init__()
        self._cache = cache
        self._layer = layer_idx
        self.window = window  # 0: global; w: a sliding window of w tokens (kvferry keeps it)
        self.is_sliding = window > 0

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
    """A transformers ``Cache`` backed by one :class:`kvferry.Runtime` (per rank under tensor
    parallelism: over this rank's heads).

    ``config``: the model's config (num_hidden_layers, num_attention_heads, num_key_value_heads,
    head_dim), or the model itself. ``policy``/``budget``/``params``: the selection (see
    :func:`kvferry.policy_names`); ``budget`` counts the tokens attended per sequence and KV head,
    sinks and window included. ``sink_tokens``/``window_tokens``: the resident tiers (of the global
    layers; a sliding-window layer, from the config's ``layer_types`` and ``sliding_window``, keeps
    exactly its window on the device: see :func:`layer_windows`).
    ``max_tokens``: longest sequence; ``max_batch``: batch rows. ``plan_steps`` (default True):
    each decode token step is planned once, at its first layer (``Runtime.plan_decode``: the
    step's pages reserved and its positions copied once, the layers' decodes then only enqueue
    work, with the device selection and bank of the planned step); False plans each layer's decode
    by itself. Further keyword arguments are :class:`kvferry.RuntimeConfig` fields.

    Tensor parallelism: ``tp_size`` (default: what transformers' ``from_pretrained(tp_plan=...)``
    recorded in the model / its config, else 1) ranks each hold num_attention_heads / tp_size query
    heads and num_key_value_heads / tp_size KV heads, and this cache's Runtime is made for those
    (``num_q_heads``/``num_kv_heads`` here are the local counts); a ValueError names the counts
    that do not divide. ``tp_rank``: this rank among them (default: from the model's mesh or
    torch.distributed). With ``tp_size`` > 1 and no ``cpu_threads`` given, each rank takes an equal
    share of this host's cores (cores / LOCAL_WORLD_SIZE); without ``device_id``, the Runtime uses
    the GPU the model's parameters are on (a model given) or the local rank's (LOCAL_RANK).
    """

    def __init__(self, config: Any, policy: str = "lfps", budget: int = 256,
                 sink_tokens: int = 4, window_tokens: int = 256, backend: str = "auto",
                 route: str = "auto", params: Optional[Dict[str, float]] = None,
                 max_tokens: int = 32768, max_batch: int = 8, kv_dtype: str = "bf16",
                 max_prefill_chunk: int = 4096, tp_size: Optional[int] = None,
                 tp_rank: Optional[int] = None, plan_steps: bool = True, **runtime_fields: Any) -> None:
        tp_size, tp_rank, config, model = _tensor_parallel(config, tp_size, tp_rank)
        c = _text_config(config)
        windows = layer_windows(c, max_tokens)
        if getattr(c, "attn_logit_softcapping", None):
            raise ValueError("kvferry.hf: attention logit soft-capping (attn_logit_softcapping="
                             f"{c.attn_logit_softcapping}) is not supported")
        num_q = c.num_attention_heads
        num_kv = getattr(c, "num_key_value_heads", None) or num_q
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // num_q
        if num_q % tp_size or num_kv % tp_size:
            raise ValueError(
                f"kvferry.hf: tensor parallelism over {tp_size} ranks splits the attention heads, "
                f"but num_attention_heads={num_q} and num_key_value_heads={num_kv} do not both "
                f"divide by {tp_size} (each rank must hold whole KV heads and their query heads); "
                f"use a world size that divides {math.gcd(num_q, num_kv)}")
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.num_q_heads, self.num_kv_heads = num_q // tp_size, num_kv // tp_size
        if tp_size > 1 and not runtime_fields.get("cpu_threads"):
            ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or tp_size
            runtime_fields["cpu_threads"] = max(1, _cores() // ranks_here)
        if "device_id" not in runtime_fields and backend != "host":
            device = None
            if model is not None:
                device = next(model.parameters()).device
            if device is not None and device.type == "cuda":
                runtime_fields["device_id"] = device.index or 0
            elif "LOCAL_RANK" in os.environ and torch.cuda.is_available():
                runtime_fields["device_id"] = int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()
        self.max_tokens = max_tokens
        self.head_dim = head_dim
        self.layer_window = windows
        # Gemma scales the logits by query_pre_attn_scalar ** -0.5 (0: 1/sqrt(head_dim)).
        if "softmax_scale" not in runtime_fields and getattr(c, "query_pre_attn_scalar", None):
            runtime_fields["softmax_scale"] = float(c.query_pre_attn_scalar) ** -0.5
        self.softmax_scale = runtime_fields.get("softmax_scale") or head_dim ** -0.5
        self.runtime = kvferry.Runtime(
            num_layers=c.num_hidden_layers, num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads, head_dim=head_dim, kv_dtype=kv_dtype,
            layer_window=list(windows),
            max_sequences=max_batch, max_tokens_per_sequence=max_tokens, max_batch=max_batch,
            max_prefill_chunk=max_prefill_chunk, sink_tokens=sink_tokens,
            window_tokens=window_tokens, policy=policy, budget=budget, params=dict(params or {}),
            route=route, backend=backend, **runtime_fields)
        self._pending: Dict[int, Any] = {}
        self._batch: Optional[int] = None
        self.plan_steps = plan_steps
        super().__init__(layers=[KvferryLayer(self, i, windows[i] if windows else 0)
                                 for i in range(c.num_hidden_layers)])

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
        bsz, hq, t, _ = query.shape
        if hq != self.num_q_heads or key.shape[1] != self.num_kv_heads:
            where = (f"this rank's share ({self.tp_size} ranks)" if self.tp_size > 1 else
                     "the whole model (tp_size 1: under tensor parallelism, create the cache from "
                     "the loaded model or its config, or pass tp_size)")
            raise ValueError(
                f"kvferry.hf: layer {layer}'s attention has {hq} query and {key.shape[1]} KV "
                f"heads; this cache was made for {self.num_q_heads} and {self.num_kv_heads}, "
                f"{where}")
        self._ensure_batch(bsz)
        out = torch.empty((bsz, t, query.shape[1], query.shape[3]), dtype=query.dtype,
                          device=query.device)
        q = query.transpose(1, 2)
        k = key.transpose(1, 2)
        v = value.transpose(1, 2)
        if t == 1:
            if self.plan_steps and layer == 0:  # the token step's first layer: plan the whole step
                self.runtime.plan_decode(list(range(bsz)))
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
        """Device bytes of the KV kvferry keeps on the GPU (resident tier, token bank and the
        sliding-window layers' rings; staging and plan buffers not counted: see
        Runtime.device_memory(), whose "layer_bytes" splits it by layer); 0 on the host backend."""
        if self.runtime.backend != "cuda":
            return 0
        parts = self.runtime.device_memory()["parts"]
        return int(parts.get("resident tier", 0) + parts.get("bank rows", 0) +
                   parts.get("sliding-window rings", 0))


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
    if kwargs.get("softcap") is not None:
        raise ValueError("kvferry.hf: attention logit soft-capping is not supported")
    if kwargs.get("s_aux") is not None:
        raise ValueError("kvferry.hf: learned attention sinks (s_aux, GPT-OSS) are not supported")
    if scaling is not None and abs(scaling - cache.softmax_scale) > 1e-6 * scaling:
        raise ValueError(f"kvferry.hf: softmax scale {scaling} is not the cache's "
                         f"{cache.softmax_scale} (query_pre_attn_scalar ** -0.5 or 1/sqrt(head_dim))")
    window = kwargs.get("sliding_window")
    expected = cache.layer_window[layer] if cache.layer_window else 0
    if (window or 0) and min(window, cache.max_tokens) != expected:
        raise ValueError(f"kvferry.hf: layer {layer} attends a sliding window of {window} tokens, but "
                         f"the cache's layer {layer} has {expected or 'none (global)'}: make the cache "
                         "from this model's config")
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
