# Copyright kvferry authors. Apache-2.0.
"""CUDA tensors through the binding: device memory in, device memory out, on torch's current
stream, equal to the host backend on the same inputs. Skips without a GPU."""
import pytest

import kvferry

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not (kvferry.cuda_available() and torch.cuda.is_available()),
    reason="needs kvferry built with CUDA and a GPU")

HQ, HKV, D = 32, 8, 128


def make(backend, policy, budget):
    return kvferry.Runtime(num_layers=2, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                           backend=backend, policy=policy, budget=budget, max_sequences=2,
                           max_tokens_per_sequence=8192, max_batch=2, max_prefill_chunk=2048,
                           sink_tokens=4, window_tokens=64, route="gpu", probe_at_start=False)


@pytest.mark.parametrize("policy,budget", [("dense", 0), ("streaming", 256), ("oracle", 256)])
def test_device_tensors_on_the_current_stream_equal_the_host_backend(policy, budget):
    cuda_rt = make("cuda", policy, budget)
    host_rt = kvferry.Runtime(cuda_rt.config, backend="host")
    assert cuda_rt.backend == "cuda" and host_rt.backend == "host"
    g = torch.Generator().manual_seed(1)
    t = 1500
    stream = torch.cuda.Stream()
    for rt in (cuda_rt, host_rt):
        rt.add_sequence(1)
        rt.add_sequence(2)
    q, k, v = (torch.randn(t, h, D, generator=g).bfloat16() for h in (HQ, HKV, HKV))
    steps = [tuple(torch.randn(2, h, D, generator=g).bfloat16() for h in (HQ, HKV, HKV))
             for _ in range(3)]
    with torch.cuda.stream(stream):
        for s in (1, 2):
            cuda_rt.prefill(s, 0, q.cuda(), k.cuda(), v.cuda())
        outs = [cuda_rt.decode([1, 2], 0, *(x.cuda() for x in st)) for st in steps]
    stream.synchronize()
    for s in (1, 2):
        host_rt.prefill(s, 0, q, k, v)
    for st, out in zip(steps, outs):
        assert out.is_cuda and out.dtype == torch.bfloat16
        ref = host_rt.decode([1, 2], 0, *st)
        assert torch.allclose(out.cpu().float(), ref.float(), atol=2e-2), policy
    for h in range(HKV):
        assert cuda_rt.last_selection(2, 0, h) == host_rt.last_selection(2, 0, h) or policy == "oracle"
    assert cuda_rt.stats()["decode_tokens"] == 6


def test_device_tensors_are_refused_by_the_host_backend():
    rt = make("host", "streaming", 128)
    rt.add_sequence(1)
    q, k, v = (torch.randn(4, h, D, device="cuda") for h in (HQ, HKV, HKV))
    with pytest.raises(ValueError):
        rt.prefill(1, 0, q, k, v)
    assert rt.sequence_length(1, 0) == 0
