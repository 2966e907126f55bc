# Copyright kvferry authors. Apache-2.0.
"""kvferry: a KV cache split between GPU and host memory, with sparse attention over it.

One :class:`Runtime` owns the KV cache of several sequences for every layer and computes attention
for prefill (``prefill``, causal, dense) and decode (``decode``, one token per sequence, over the
positions the policy selects). It mirrors the C++ API (``include/kvferry/``)::

    import torch, kvferry
    rt = kvferry.Runtime(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64,
                         policy="oracle", budget=64, backend="host")
    rt.add_sequence(7)
    out = rt.prefill(7, 0, q, k, v)          # q [T, Hq, D], k/v [T, Hkv, D], post-RoPE
    out1 = rt.decode([7], 0, q1, k1, v1)     # q1 [B, Hq, D], k1/v1 [B, Hkv, D]
    rt.stats()["rows_selected"], rt.last_selection(7, 0, 0)

What to install: ``pip install kvferry`` (from a checkout: ``pip install .``) installs kvferry and
numpy only, which is enough for :class:`Runtime` with numpy arrays. torch tensors (the snippet above)
need the ``torch`` extra, ``pip install "kvferry[torch]"`` (``pip install ".[torch]"``); the
Hugging Face integration :mod:`kvferry.hf` and ``examples/python/hf_generate.py`` need the ``hf``
extra, ``pip install "kvferry[hf]"`` (``pip install ".[hf]"``). Without them, the import that needs
them raises an ImportError naming the extra.

Tensors are ``torch.Tensor`` (or any DLPack / buffer-protocol array, e.g. numpy) of float32,
bfloat16 or float16 on the CPU or a CUDA device, taken without a copy; the innermost dimension must
be contiguous. CUDA work runs on torch's current stream. Errors raise ``ValueError`` (invalid
arguments, unknown sequences), ``MemoryError`` (capacity) or ``RuntimeError`` (device and internal
errors), with kvferry's message.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence

from . import _core

__all__ = ["RuntimeConfig", "Runtime", "cuda_available", "policy_names", "missing_extra", "EXTRAS",
           "__version__"]
__version__ = "0.1.0"


#: The optional dependencies each extra of the package installs (pyproject.toml), by the module
#: that needs them.
EXTRAS: Dict[str, List[str]] = {
    "torch": ["torch"],
    "hf": ["torch", "transformers", "accelerate", "gguf", "safetensors"],
}


def missing_extra(extra: str, what: str, error: Optional[BaseException] = None) -> ImportError:
    """The ImportError to raise when ``what`` (e.g. "kvferry.hf") cannot import a dependency that
    the package's ``extra`` installs: it names the module missing and the command that installs it.
    Use as ``raise kvferry.missing_extra("hf", "kvferry.hf", e) from e``."""
    name = getattr(error, "name", None)
    if name:
        missing = f"no module named '{name}'"
    else:
        missing = str(error) if error is not None else "a dependency is missing"
    return ImportError(
        f"{what} needs kvferry's optional '{extra}' dependencies ({', '.join(EXTRAS[extra])}): "
        f"{missing}. `pip install kvferry` installs only kvferry and numpy; install the extra "
        f"with: pip install \"kvferry[{extra}]\" (from a source checkout: pip install \".[{extra}]\")",
        name=name)


def cuda_available() -> bool:
    """Whether this build of kvferry has the CUDA backend and a usable GPU."""
    return _core.cuda_available()


def policy_names() -> List[str]:
    """Names of the selection policies ``RuntimeConfig.policy`` accepts."""
    return list(_core.policy_names())


@dataclass
class RuntimeConfig:
    """Everything a Runtime is created with (``kvferry::RuntimeConfig``, flattened).

    Model shape: ``num_layers``, ``num_q_heads``, ``num_kv_heads`` (GQA), ``head_dim`` (64, 128 or
    256 on CUDA; 8..256, a multiple of 8, on the host backend), ``kv_dtype`` ("bf16" or "f16"),
    ``softmax_scale`` (0: 1/sqrt(head_dim)), ``layer_window`` (per-layer attention types: one int
    per layer, 0 global, w > 0 a sliding window of the last w tokens kept only on the device;
    empty: every layer global). Capacity: ``max_sequences``,
    ``max_tokens_per_sequence``, ``max_batch`` (sequences per decode), ``max_prefill_chunk``,
    ``max_host_bytes`` (0: unlimited), ``host_bytes_at_create``, ``gpu_bytes`` (cap on the device
    memory reserved at creation; 0: none), ``prefill_prefetch`` (CUDA: a second prefill staging
    that a chunk-major prompt's calls fill for each other; False saves its memory). Tiers: ``sink_tokens``, ``window_tokens`` (resident on
    the GPU), ``bank_slots`` (-1: the largest bank that fits ``gpu_bytes``), ``bank_map``. Policy:
    ``policy`` (see :func:`policy_names`), ``budget`` (tokens attended per sequence and KV head,
    resident ones included; 0: use ``budget_fraction``), ``params`` (policy parameters by name).
    ``route``: "auto", "gpu" or "cpu"; ``backend``: "auto", "cuda" or "host".
    """

    num_layers: int = 32
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    kv_dtype: str = "bf16"
    softmax_scale: float = 0.0
    #: Per layer: 0 = global (tiers, offload, the policy's selection), w > 0 = sliding window of w
    #: tokens (the new one included), its rows only in a ring of w rows on the device, no selection,
    #: no host copy, no PCIe bytes. Empty: every layer global. (docs/runtime.md, "Per-layer
    #: attention types")
    layer_window: List[int] = field(default_factory=list)
    max_sequences: int = 8
    max_tokens_per_sequence: int = 131072
    max_batch: int = 8
    max_prefill_chunk: int = 8192
    max_host_bytes: int = 0
    host_bytes_at_create: int = 0
    gpu_bytes: int = 0
    prefill_prefetch: bool = True
    sink_tokens: int = 4
    window_tokens: int = 256
    bank_slots: int = 0
    bank_map: str = "vector"
    policy: str = "streaming"
    budget: int = 256
    budget_fraction: float = 0.0
    params: Dict[str, float] = field(default_factory=dict)
    #: A file of trained weights for the policies that take one (kvpop's scorer, written by
    #: scripts/kvpop_train.py); "" for none.
    weights_path: str = ""
    route: str = "auto"
    backend: str = "auto"
    device_id: int = 0
    cpu_threads: int = 0
    probe_at_start: bool = True
    #: The CPU part of a CPU-placed policy's step (lfps) on the runtime's own thread: decode
    #: returns once the GPU's work is queued (-1: with CUDA; 0: off; 1: on). A failure there is
    #: raised by the next call.
    async_cpu: int = -1
    #: The cross-layer prefetch of xl+ with the device token bank (-1: while the measured GPU
    #: time between layers' decode calls averages xl_prefetch_gap_us or more; 0: off; 1: on).
    xl_prefetch: int = -1
    #: The GPU time between layers (us) from which xl_prefetch = -1 prefetches.
    xl_prefetch_gap_us: float = 100.0
    #: Route auto's split of a device selection's misses with the CPU: the CPU's share of each
    #: split step's misses (-1: the cost model's; a value in [0, 1]: that share every step).
    split_share: float = -1.0
    #: Least estimated CPU work (us) a split step gives the CPU (with split_share = -1).
    split_min_us: float = 30.0
    #: Microseconds the CPU pool's workers spin after a CPU step for the next layer's (0: none).
    cpu_spin_us: int = 0
    #: The reference paths the fast ones are tested against (docs/runtime.md, "Reference paths");
    #: the defaults take the fast paths. LFPS-style priming: "auto", "host" or "device".
    prime_path: str = "auto"
    #: Prime after every prefill chunk instead of once at the first decode (the same selections).
    prime_eager: bool = False
    #: LFPS's candidate scan: "auto", "host" or "device".
    shadow_scan_path: str = "auto"
    #: CUDA prefill on the CUDA-core paged kernel instead of the tensor cores.
    cuda_prefill_paged: bool = False


def _is_torch(t: Any) -> bool:
    return type(t).__module__.startswith("torch")


# cudaStreamLegacy: the handle of CUDA's legacy default stream, which torch's default stream is
# (its cuda_stream reads 0). kvferry takes a null stream for "the runtime's own stream", a
# non-blocking one that is not ordered after the default stream: handing it 0 would let kvferry
# read q, k and v before torch's kernels have written them.
_CUDA_STREAM_LEGACY = 1


def _torch_stream(device: Any = None) -> int:
    """The handle of torch's current CUDA stream (of ``device``), the legacy stream for its default."""
    import torch

    return int(torch.cuda.current_stream(device).cuda_stream) or _CUDA_STREAM_LEGACY


def _stream_of(t: Any) -> int:
    """torch's current CUDA stream for a CUDA tensor, else 0 (the runtime's own / host)."""
    if _is_torch(t) and t.is_cuda:
        return _torch_stream(t.device)
    return 0


def _new_out(q: Any) -> Any:
    """An output like q: same shape, dtype and device, contiguous."""
    if _is_torch(q):
        import torch

        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    import numpy as np

    return np.empty(q.shape, dtype=q.dtype)


class Runtime:
    """The KV cache of up to ``max_sequences`` sequences and attention over it.

    ``Runtime(config)`` or ``Runtime(**fields)`` (names of :class:`RuntimeConfig`); a config plus
    keyword arguments overrides those fields. Not thread-safe: call it from one thread. Every call
    releases the GIL while kvferry works.
    """

    def __init__(self, config: Optional[RuntimeConfig] = None, **fields: Any) -> None:
        if config is None:
            config = RuntimeConfig(**fields)
        elif fields:
            config = dataclasses.replace(config, **fields)
        self._config = config
        self._rt = _core.Runtime(dataclasses.asdict(config))

    @property
    def config(self) -> RuntimeConfig:
        """The configuration this runtime was created with."""
        return self._config

    @property
    def backend(self) -> str:
        """"host" or "cuda": the backend in use."""
        return self._rt.backend

    @property
    def decode_is_capture_safe(self) -> bool:
        """Whether a planned decode step can be captured in a CUDA graph."""
        return self._rt.decode_is_capture_safe

    def add_sequence(self, seq: int) -> None:
        """Registers a new, empty sequence ``seq`` (an id the caller chooses)."""
        self._rt.add_sequence(seq)

    def remove_sequence(self, seq: int) -> None:
        """Frees every tier's data of ``seq``."""
        self._rt.remove_sequence(seq)

    def sequence_length(self, seq: int, layer: int) -> int:
        """Tokens stored for ``seq`` at ``layer``."""
        return self._rt.sequence_length(seq, layer)

    def prefill(self, seq: int, layer: int, q: Any, k: Any, v: Any, out: Any = None) -> Any:
        """Stores a prompt chunk's K/V of ``seq`` at ``layer`` and returns causal attention of the
        chunk's queries over everything stored plus the chunk. q/out: [T, Hq, D]; k/v: [T, Hkv, D].
        ``out`` (optional) is written in place; otherwise a tensor like q is returned."""
        if out is None:
            out = _new_out(q)
        self._rt.prefill(seq, layer, q, k, v, out, _stream_of(q))
        return out

    def append(self, seq: int, layer: int, k: Any, v: Any) -> None:
        """Stores a chunk's K/V of ``seq`` at ``layer`` without attention. k/v: [T, Hkv, D]."""
        self._rt.append(seq, layer, k, v, _stream_of(k))

    def decode(self, seqs: Sequence[int], layer: int, q: Any, k: Any, v: Any,
               out: Any = None) -> Any:
        """Appends one token per sequence of ``seqs`` at ``layer`` and returns attention of its
        query over the positions the policy selects. q/out: [B, Hq, D]; k/v: [B, Hkv, D]."""
        if out is None:
            out = _new_out(q)
        self._rt.decode(list(seqs), layer, q, k, v, out, _stream_of(q))
        return out

    def plan_decode(self, seqs: Iterable[int], stream: Optional[int] = None) -> None:
        """Plans one decode token step of ``seqs`` (all layers); see the C++ PlanDecode."""
        if stream is None:
            stream = 0
            try:
                import torch

                if torch.cuda.is_available() and self.backend == "cuda":
                    stream = _torch_stream()
            except ImportError:
                pass
        self._rt.plan_decode(list(seqs), stream)

    def last_selection(self, seq: int, layer: int, kv_head: int) -> List[int]:
        """Positions attended at the last decode of (seq, layer, kv_head), ascending."""
        return list(self._rt.last_selection(seq, layer, kv_head))

    def synchronize(self) -> None:
        """Waits for all work issued on the runtime's streams."""
        self._rt.synchronize()

    def stats(self) -> Dict[str, float]:
        """Cumulative counters (kvferry::Stats) as a dict: rows per tier, PCIe bytes, ms per stage."""
        return dict(self._rt.stats())

    def device_memory(self) -> Dict[str, Any]:
        """The device memory reserved at creation (kvferry::Runtime::device_memory): ``parts``
        ({name: bytes}, largest first: "resident tier" is the sinks and window of every sequence,
        layer and KV head, "bank rows" the token bank; the rest are staging buffers and
        workspaces; "sliding-window rings" the rows of sliding-window layers beyond the resident
        tier's), ``total_bytes``, ``cap_bytes`` (``gpu_bytes``), ``bank_slots`` and
        ``layer_bytes`` (per layer, the device bytes of its K and V rows). On the
        host backend the same buffers are held in host memory. stats()["device_bytes_reserved"]
        is the device's own count: this total plus a workspace per caller stream (CUDA)."""
        d = dict(self._rt.device_memory())
        d["parts"] = dict(d["parts"])
        d["layer_bytes"] = list(d["layer_bytes"])
        return d

    def reset_stats(self) -> None:
        """Zeroes the counters."""
        self._rt.reset_stats()

    def time_device_select(self, on: bool) -> None:
        """Times each eager decode's device selection into stats()["ms_select_device"] while on."""
        self._rt.time_device_select(on)

    def __repr__(self) -> str:
        c = self._config
        return (f"kvferry.Runtime(policy={c.policy!r}, budget={c.budget}, backend={self.backend!r}, "
                f"layers={c.num_layers}, heads={c.num_q_heads}/{c.num_kv_heads}x{c.head_dim})")
