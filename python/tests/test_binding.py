# Copyright kvferry authors. Apache-2.0.
"""The Python binding against float64 references of what the C++ runtime computes (host backend),
its errors, and that it releases the GIL. Fresh random inputs every run."""
import math
import threading

import numpy as np
import pytest

import kvferry

torch = pytest.importorskip("torch")

HQ, HKV, D = 8, 2, 64
GROUP = HQ // HKV


def make_rt(**kw):
    cfg = dict(num_layers=2, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, backend="host",
               max_sequences=4, max_tokens_per_sequence=4096, max_batch=4, max_prefill_chunk=1024,
               sink_tokens=4, window_tokens=32, policy="dense", budget=0, cpu_threads=2,
               probe_at_start=False)
    cfg.update(kw)
    return kvferry.Runtime(**cfg)


def rnd(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float32).to(dtype)


def stored(x, kv_dtype=torch.bfloat16):
    """K/V as the runtime stores them (rounded to the KV dtype), in float64."""
    return x.to(kv_dtype).to(torch.float64)


def attend(q, k, v, positions_per_head=None):
    """float64 attention of queries q [Hq, D] over k/v [N, Hkv, D]; positions_per_head[h] limits KV
    head h to those rows (else all)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    scale = 1.0 / math.sqrt(D)
    for hq in range(HQ):
        h = hq // GROUP
        rows = slice(None) if positions_per_head is None else positions_per_head[h]
        kk, vv = k[rows, h], v[rows, h]
        s = (kk @ q[hq].double()) * scale
        p = torch.softmax(s, dim=0)
        out[hq] = p @ vv
    return out


# Prefill runs the tensor-core kernel's arithmetic (q and P rounded to bf16, fp32 accumulation)
# also on the host backend, so it is compared with the tolerance the C++ tests use for it.
PREFILL_TOL = 2e-2


def causal_prefill_ref(q, k, v):
    t = q.shape[0]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(t):
        out[i] = attend(q[i], k[: i + 1], v[: i + 1])
    return out


def test_prefill_then_decode_dense_equals_reference():
    rt = make_rt()
    rt.add_sequence(3)
    t = 70
    q, k, v = rnd(t, HQ, D), rnd(t, HKV, D), rnd(t, HKV, D)
    out = rt.prefill(3, 0, q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = causal_prefill_ref(q, stored(k), stored(v))
    assert torch.allclose(out.double(), ref, atol=PREFILL_TOL)
    ks, vs = [k], [v]
    for step in range(3):
        q1, k1, v1 = rnd(1, HQ, D), rnd(1, HKV, D), rnd(1, HKV, D)
        ks.append(k1)
        vs.append(v1)
        o1 = rt.decode([3], 0, q1, k1, v1)
        ref1 = attend(q1[0], stored(torch.cat(ks)), stored(torch.cat(vs)))
        assert torch.allclose(o1[0].double(), ref1, atol=2e-5, rtol=1e-4), step
    assert rt.sequence_length(3, 0) == t + 3
    assert rt.sequence_length(3, 1) == 0
    s = rt.stats()
    assert s["prefill_tokens"] == t and s["decode_tokens"] == 3
    assert s["rows_selected"] == HKV * ((t + 1) + (t + 2) + (t + 3))  # every row, each step
    assert set(s) >= {"bytes_h2d", "rows_resident", "rows_fetched", "ms_select", "host_bytes_reserved"}


def test_time_device_select():
    rt = make_rt(policy="quest", budget=40)
    rt.add_sequence(1)
    t = 300
    rt.prefill(1, 0, rnd(t, HQ, D), rnd(t, HKV, D), rnd(t, HKV, D))
    rt.decode([1], 0, rnd(1, HQ, D), rnd(1, HKV, D), rnd(1, HKV, D))
    assert rt.stats()["ms_select_device"] == 0  # off until asked
    rt.time_device_select(True)
    rt.decode([1], 0, rnd(1, HQ, D), rnd(1, HKV, D), rnd(1, HKV, D))
    assert rt.stats()["ms_select_device"] > 0


def test_streaming_attends_sinks_and_recent():
    budget = 40
    rt = make_rt(policy="streaming", budget=budget)
    rt.add_sequence(1)
    t = 200
    q, k, v = rnd(t, HQ, D), rnd(t, HKV, D), rnd(t, HKV, D)
    rt.prefill(1, 0, q, k, v)
    q1, k1, v1 = rnd(1, HQ, D), rnd(1, HKV, D), rnd(1, HKV, D)
    o1 = rt.decode([1], 0, q1, k1, v1)
    n = t + 1
    want = list(range(4)) + list(range(n - (budget - 4), n))
    sel = [rt.last_selection(1, 0, h) for h in range(HKV)]
    assert all(s == want for s in sel)
    kk, vv = stored(torch.cat([k, k1])), stored(torch.cat([v, v1]))
    ref = attend(q1[0], kk, vv, positions_per_head=[want] * HKV)
    assert torch.allclose(o1[0].double(), ref, atol=2e-5, rtol=1e-4)


def test_kvpop_trained_scorer_selects_on_the_device_as_on_the_host():
    # The committed SmolLM2 scorer (30 layers, 3 KV heads, head_dim 64): kvpop's device selection
    # (the host backend runs its twin of the GPU kernel) keeps exactly the tokens of its host
    # Select ("device" 0), step after step; the zero scorer's lists are streaming's.
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    weights = os.path.join(here, "..", "..", "policies", "weights", "kvpop_smollm2.safetensors")
    if not os.path.exists(weights):
        pytest.skip("the kvpop weights are not in this checkout")
    shape = dict(num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64, sink_tokens=4,
                 window_tokens=16, budget=48, max_tokens_per_sequence=1024)
    dev = make_rt(policy="kvpop", weights_path=weights, **shape)
    host = make_rt(policy="kvpop", params={"device": 0.0}, weights_path=weights, **shape)
    zero = make_rt(policy="kvpop", **shape)
    stream = make_rt(policy="streaming", **shape)
    rts = (dev, host, zero, stream)
    for rt in rts:
        rt.add_sequence(1)
    # The file's decays per layer (its metadata): recency (0.01) where the scorer did not pay, so
    # the layers checked are the first, the last and the first whose scorer decides.
    import json
    import struct
    with open(weights, "rb") as f:
        meta = json.loads(f.read(struct.unpack("<Q", f.read(8))[0])).get("__metadata__", {})
    decays = [float(x) for x in meta.get("layer_decays", "").split(",") if x]
    scored = next((l for l, g in enumerate(decays) if g > 0.01), 17)
    t, layers = 150, tuple(sorted({0, scored, 29}))
    for layer in layers:
        q, k, v = rnd(t, 9, 64), rnd(t, 3, 64), rnd(t, 3, 64)
        for rt in rts:
            rt.prefill(1, layer, q, k, v)
    differs = False
    for _ in range(12):
        for layer in layers:
            q1, k1, v1 = rnd(1, 9, 64), rnd(1, 3, 64), rnd(1, 3, 64)
            outs = [rt.decode([1], layer, q1, k1, v1) for rt in rts]
            assert torch.allclose(outs[0], outs[1], atol=1e-6)
            for h in range(3):
                sel = [rt.last_selection(1, layer, h) for rt in rts]
                assert sel[0] == sel[1]
                assert sel[2] == sel[3]
                assert len(sel[0]) == 48
                differs |= sel[0] != sel[3]
    assert differs  # the trained scorer keeps other tokens than recency


def test_oracle_selects_the_exact_top_k_of_the_group_softmax():
    budget = 24
    rt = make_rt(policy="oracle", budget=budget, sink_tokens=2, window_tokens=8)
    rt.add_sequence(5)
    t = 300
    q, k, v = rnd(t, HQ, D), rnd(t, HKV, D), rnd(t, HKV, D)
    rt.prefill(5, 0, q, k, v)
    q1, k1, v1 = rnd(1, HQ, D), rnd(1, HKV, D), rnd(1, HKV, D)
    o1 = rt.decode([5], 0, q1, k1, v1)
    n = t + 1
    kk, vv = stored(torch.cat([k, k1])), stored(torch.cat([v, v1]))
    chosen = []
    for h in range(HKV):
        sel = rt.last_selection(5, 0, h)
        assert sel == sorted(set(sel)) and len(sel) == budget
        # The positions of largest group-summed softmax mass (the oracle's definition).
        qs = q1[0, h * GROUP:(h + 1) * GROUP].double()
        p = torch.softmax((kk[:, h] @ qs.T) / math.sqrt(D), dim=0).sum(dim=1)
        want = set(torch.topk(p, budget).indices.tolist())
        got = set(sel)
        # Ties within fp32 rounding may swap the last place: the masses must agree.
        mass_got = sum(float(p[i]) for i in got)
        mass_want = sum(float(p[i]) for i in want)
        assert len(got ^ want) <= 2 and abs(mass_got - mass_want) < 1e-5
        chosen.append(sel)
    ref = attend(q1[0], kk, vv, positions_per_head=chosen)
    assert torch.allclose(o1[0].double(), ref, atol=2e-5, rtol=1e-4)


def test_batch_of_sequences_of_different_lengths_and_dtypes():
    rt = make_rt()
    lens = {10: 33, 11: 90, 12: 5}
    kv = {}
    for s, t in lens.items():
        rt.add_sequence(s)
        q, k, v = rnd(t, HQ, D), rnd(t, HKV, D), rnd(t, HKV, D)
        rt.prefill(s, 1, q, k, v)
        kv[s] = (k, v)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        q1, k1, v1 = rnd(3, HQ, D, dtype=dt), rnd(3, HKV, D, dtype=dt), rnd(3, HKV, D, dtype=dt)
        out = torch.zeros(3, HQ, D, dtype=dt)
        ret = rt.decode(list(lens), 1, q1, k1, v1, out=out)
        assert ret is out
        for b, s in enumerate(lens):
            k, v = kv[s]
            k, v = torch.cat([k, k1[b:b + 1].float()]), torch.cat([v, v1[b:b + 1].float()])
            kv[s] = (k, v)
            ref = attend(q1[b].float(), stored(k), stored(v))
            tol = 2e-5 if dt == torch.float32 else 1e-2
            assert torch.allclose(out[b].double(), ref, atol=tol, rtol=tol), (dt, s)


def test_strided_views_are_refused_and_numpy_inputs_work():
    rt = make_rt()
    rt.add_sequence(0)
    t = 12
    qkv = rnd(t, HQ + 2 * HKV, D)  # one fused projection; q/k/v are strided views of it
    q, k, v = qkv[:, :HQ], qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:]
    assert not q.is_contiguous()
    with pytest.raises(ValueError, match="contiguous"):  # prefill wants dense chunks
        rt.prefill(0, 0, q, k, v)
    assert rt.sequence_length(0, 0) == 0
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = rt.prefill(0, 0, q, k, v)
    ref = causal_prefill_ref(q, stored(k), stored(v))
    assert torch.allclose(out.double(), ref, atol=PREFILL_TOL)
    rt2 = make_rt()
    rt2.add_sequence(0)
    out_np = rt2.prefill(0, 0, q.numpy(), k.numpy(), v.numpy())
    assert isinstance(out_np, np.ndarray) and out_np.dtype == np.float32
    assert np.allclose(out_np, out.numpy(), atol=1e-6)


def test_bad_inputs_raise_with_the_argument_named():
    rt = make_rt()
    rt.add_sequence(1)
    q, k, v = rnd(4, HQ, D), rnd(4, HKV, D), rnd(4, HKV, D)
    with pytest.raises(ValueError, match="q: expected 3 dimensions"):
        rt.prefill(1, 0, q[0], k, v)
    with pytest.raises(ValueError, match="k: expected shape"):
        rt.prefill(1, 0, q, rnd(4, HKV + 1, D), v)
    with pytest.raises(ValueError, match="v: 3 rows"):
        rt.prefill(1, 0, q, k, v[:3])
    with pytest.raises(ValueError, match="dtype"):
        rt.prefill(1, 0, q.double(), k, v)
    with pytest.raises(ValueError, match="contiguous"):
        rt.prefill(1, 0, rnd(4, HQ, 2 * D)[:, :, ::2], k, v)
    with pytest.raises(ValueError, match="not found|unknown|sequence"):
        rt.prefill(99, 0, q, k, v)
    with pytest.raises(ValueError, match="layer"):
        rt.prefill(1, 7, q, k, v)
    with pytest.raises(ValueError, match="batch"):
        rt.decode([1, 1], 0, rnd(1, HQ, D), rnd(1, HKV, D), rnd(1, HKV, D))
    with pytest.raises(ValueError):
        rt.add_sequence(1)  # already live
    # Nothing above changed the sequence.
    assert rt.sequence_length(1, 0) == 0
    with pytest.raises(ValueError, match="unknown policy"):
        make_rt(policy="nonsense", budget=16)
    with pytest.raises(ValueError, match="nonsense"):
        make_rt(policy="oracle", budget=16, params={"nonsense": 1.0})
    with pytest.raises(ValueError, match="route"):
        make_rt(route="sideways")
    with pytest.raises(TypeError):
        make_rt(not_a_field=1)


def test_host_capacity_is_a_memory_error_and_leaves_other_sequences_intact():
    rt = make_rt(max_host_bytes=1 << 20)
    rt.add_sequence(1)
    rt.add_sequence(2)
    q, k, v = rnd(8, HQ, D), rnd(8, HKV, D), rnd(8, HKV, D)
    rt.prefill(2, 0, q, k, v)
    big = 1024
    with pytest.raises(MemoryError):
        for layer in range(2):
            rt.prefill(1, layer, rnd(big, HQ, D), rnd(big, HKV, D), rnd(big, HKV, D))
    assert rt.sequence_length(2, 0) == 8
    q1, k1, v1 = rnd(1, HQ, D), rnd(1, HKV, D), rnd(1, HKV, D)
    o1 = rt.decode([2], 0, q1, k1, v1)
    ref = attend(q1[0], stored(torch.cat([k, k1])), stored(torch.cat([v, v1])))
    assert torch.allclose(o1[0].double(), ref, atol=2e-5, rtol=1e-4)


def test_prefill_prefetch_is_a_field_and_its_count_a_stat():
    """Capacity.prefill_prefetch reaches the runtime (the host backend has no staging, so no chunk
    is ever prefetched there, in any order), and a value of the wrong type is refused."""
    for on in (True, False):
        rt = make_rt(prefill_prefetch=on)
        rt.add_sequence(1)
        for _chunk in range(2):
            for layer in (0, 1):  # chunk-major
                q, k, v = rnd(100, HQ, D), rnd(100, HKV, D), rnd(100, HKV, D)
                rt.prefill(1, layer, q, k, v)
        s = rt.stats()
        assert s["prefill_tokens"] == 400
        assert s["prefill_chunks_prefetched"] == 0
    with pytest.raises(TypeError, match=r"prefill_prefetch must be a bool \(got 'yes', a str\)"):
        make_rt(prefill_prefetch="yes")
    with pytest.raises(TypeError, match=r"max_batch must be an int \(got '4', a str\)"):
        make_rt(max_batch="4")
    with pytest.raises(TypeError, match=r"route must be a str \(got 1, an int\)"):
        make_rt(route=1)


def test_async_cpu_part_equals_the_serial_one():
    """RuntimeConfig.async_cpu reaches the runtime: lfps's CPU part on the runtime's thread (1)
    gives the serial part's (0) outputs bit for bit, over planned decode steps of two sequences."""
    rts = [make_rt(policy="lfps", budget=48, async_cpu=a) for a in (1, 0)]
    for rt in rts:
        rt.add_sequence(1)
        rt.add_sequence(2)
    for seq, n in ((1, 300), (2, 70)):
        for layer in (0, 1):
            q, k, v = rnd(n, HQ, D), rnd(n, HKV, D), rnd(n, HKV, D)
            for rt in rts:
                rt.prefill(seq, layer, q, k, v)
    for _step in range(4):
        for rt in rts:
            rt.plan_decode([1, 2])
        for layer in (0, 1):
            q, k, v = rnd(2, HQ, D), rnd(2, HKV, D), rnd(2, HKV, D)
            a, b = (rt.decode([1, 2], layer, q, k, v) for rt in rts)
            assert torch.equal(a, b)
    assert rts[0].stats()["decode_planned"] == 8
    assert rts[0].stats()["rows_cpu"] == rts[1].stats()["rows_cpu"] > 0
    with pytest.raises(TypeError, match=r"async_cpu must be an int \(got 'on', a str\)"):
        make_rt(async_cpu="on")


def test_xl_prefetch_reaches_the_config():
    """RuntimeConfig.xl_prefetch (the cross-layer prefetch of xl+ with the device bank) is checked
    at create; the stats carry the measured time between layers (-1: not measured, as on the host
    backend, which has no device bank)."""
    with pytest.raises(ValueError, match="xl_prefetch 2 must be -1"):
        make_rt(policy="xl+oracle", budget=48, xl_prefetch=2)
    with pytest.raises(TypeError, match=r"xl_prefetch must be an int \(got 'auto', a str\)"):
        make_rt(xl_prefetch="auto")
    for mode in (-1, 0, 1):
        rt = make_rt(policy="xl+oracle", budget=48, xl_prefetch=mode)
        assert rt.stats()["xl_gap_us"] == -1.0
        assert rt.stats()["decode_prefetched"] == 0


def test_tuning_fields_reach_the_config():
    """The scheduler's and CPU pool's tuning fields are checked at create, each bad value named;
    good ones make a runtime; a weights file that is not one is refused naming weights_path."""
    bad = [("xl_prefetch_gap_us", -1.0), ("split_share", 1.5), ("split_share", -0.5),
           ("split_min_us", -2.0), ("cpu_spin_us", -1), ("cpu_spin_us", 2000000)]
    for name, value in bad:
        with pytest.raises(ValueError, match=name):
            make_rt(policy="oracle", budget=48, **{name: value})
    with pytest.raises(TypeError, match="split_share must be a float"):
        make_rt(split_share="half")
    make_rt(policy="oracle", budget=48, xl_prefetch_gap_us=0.0, split_share=0.5, split_min_us=0.0,
            cpu_spin_us=10)
    with pytest.raises(ValueError, match="policy.weights_path '/nonexistent/w.safetensors'"):
        make_rt(policy="kvpop", budget=48, weights_path="/nonexistent/w.safetensors")


def test_config_fields_are_one_table():
    """The dataclass has exactly the fields the core reads, in its order (kvferry_core.cpp's
    kConfigFields, the one table of them)."""
    import dataclasses

    assert [f.name for f in dataclasses.fields(kvferry.RuntimeConfig)] == list(kvferry._core.config_fields())


def test_reference_paths_are_config_fields():
    """The reference paths (RuntimeConfig::paths) are fields, checked at create: lfps primed after
    every chunk (prime_eager) decodes as the deferred priming does, bit for bit; the host backend's
    copy of the device priming and scan paths (prime_path / shadow_scan_path "device") gives the same
    outputs within fp32 rounding, and the scan path is the one that ran."""
    for name in ("prime_path", "shadow_scan_path"):
        with pytest.raises(ValueError, match=rf"{name} must be 'auto', 'host' or 'device' \(got 'gpu'\)"):
            make_rt(**{name: "gpu"})
    with pytest.raises(TypeError, match=r"prime_eager must be a bool"):
        make_rt(prime_eager="yes")
    variants = [{}, {"prime_eager": True}, {"prime_path": "device"},
                {"prime_path": "device", "shadow_scan_path": "device"}]
    rts = [make_rt(policy="lfps", budget=48, max_prefill_chunk=128, **v) for v in variants]
    for rt in rts:
        rt.add_sequence(1)
    n = 300
    for layer in (0, 1):
        q, k, v = rnd(n, HQ, D), rnd(n, HKV, D), rnd(n, HKV, D)
        for start in range(0, n, 128):
            for rt in rts:
                rt.prefill(1, layer, q[start:start + 128], k[start:start + 128], v[start:start + 128])
    assert rts[0].stats()["ms_prime"] == 0 < rts[1].stats()["ms_prime"]  # deferred vs every chunk
    for _step in range(3):
        for layer in (0, 1):
            q, k, v = rnd(1, HQ, D), rnd(1, HKV, D), rnd(1, HKV, D)
            outs = [rt.decode([1], layer, q, k, v) for rt in rts]
            assert torch.equal(outs[0], outs[1])
            for o in outs[2:]:
                assert torch.allclose(o, outs[0], rtol=0, atol=1e-5)
    assert rts[0].stats()["scans_device"] == 0 < rts[3].stats()["scans_device"]


def test_gpu_bytes_cap_refuses_what_does_not_fit_and_sizes_the_auto_bank():
    with pytest.raises(MemoryError, match="capacity.gpu_bytes 4096 is below"):
        make_rt(gpu_bytes=4096)
    with pytest.raises(ValueError, match="bank_slots -1"):
        make_rt(bank_slots=-1)
    cap = 64 << 20
    rt = make_rt(policy="oracle", budget=16, gpu_bytes=cap, bank_slots=-1)
    assert 0 < rt.stats()["device_bytes_reserved"] <= cap


def test_the_gil_is_released_during_work():
    rt = make_rt(max_prefill_chunk=4096, cpu_threads=1)
    rt.add_sequence(1)
    t = 4096
    q, k, v = rnd(t, HQ, D), rnd(t, HKV, D), rnd(t, HKV, D)
    ticks = [0]
    done = threading.Event()

    def count():
        while not done.is_set():
            ticks[0] += 1

    th = threading.Thread(target=count)
    th.start()
    try:
        before = ticks[0]
        rt.prefill(1, 0, q, k, v)  # a second or so of causal attention on one thread
        during = ticks[0] - before
    finally:
        done.set()
        th.join()
    # With the GIL held for the whole call the counter could advance only at the switch before and
    # after it (a few hundred ticks); released, it runs the whole time.
    assert during > 10000, during


def test_config_dataclass_and_repr():
    cfg = kvferry.RuntimeConfig(num_layers=1, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                backend="host", policy="oracle", budget=16, probe_at_start=False)
    rt = kvferry.Runtime(cfg, budget=32)
    assert rt.config.budget == 32 and cfg.budget == 16
    assert rt.backend == "host" and "oracle" in repr(rt)
    assert "lfps" in kvferry.policy_names()
    assert isinstance(kvferry.cuda_available(), bool)


def test_config_errors_name_the_value_and_the_accepted_range():
    with pytest.raises(ValueError, match=r"budget must be >= 0 \(got -5"):
        make_rt(policy="oracle", budget=-5)
    with pytest.raises(ValueError, match=r"budget must be >= 0 \(got -5"):
        make_rt(policy="dense", budget=-5)
    with pytest.raises(ValueError,
                       match=r"budget must be >= 1 for policy 'oracle' \(got 0\), or set budget_fraction"):
        make_rt(policy="oracle", budget=0)
    make_rt(policy="oracle", budget=0, budget_fraction=0.5)  # the fraction instead: accepted
    with pytest.raises(ValueError, match=r"budget_fraction must be in \[0, 1\] \(got 1.5\)"):
        make_rt(policy="oracle", budget=0, budget_fraction=1.5)
    with pytest.raises(TypeError, match=r"budget must be an int \(got 1.5, a float\)"):
        make_rt(policy="oracle", budget=1.5)
    # Values the C++ field cannot hold are refused, not truncated.
    with pytest.raises(ValueError, match=r"num_layers must be in \[-2147483648, 2147483647\] "
                                         r"\(got 4294967298\)"):
        make_rt(num_layers=2**32 + 2)
    with pytest.raises(ValueError, match=r"budget must be in \[-9223372036854775808, "
                                         r"9223372036854775807\] \(got 1267650600228229401496703205376\)"):
        make_rt(policy="oracle", budget=2**100)
    assert make_rt(policy="oracle", budget=np.int64(16)).config.budget == 16  # integer scalars
    with pytest.raises(ValueError, match=r"route must be 'auto', 'gpu' or 'cpu' \(got 'sideways'\)"):
        make_rt(route="sideways")
    with pytest.raises(ValueError, match=r"backend must be 'auto', 'cuda' or 'host' \(got 'tpu'\)"):
        make_rt(backend="tpu")
    with pytest.raises(ValueError, match=r"kv_dtype must be 'bf16' or 'f16' \(got 'f32'\)"):
        make_rt(kv_dtype="f32")
    with pytest.raises(TypeError, match=r"params must map str to float \(got 'scan': 'fast'\)"):
        make_rt(policy="lfps", budget=48, params={"scan": "fast"})
    # The runtime's own checks name the value and the range too.
    with pytest.raises(ValueError, match=r"window_tokens 0 out of range \[1, 2\^30\]"):
        make_rt(window_tokens=0)
    with pytest.raises(ValueError, match=r"num_layers -1 must be >= 1"):
        make_rt(num_layers=-1)


@pytest.mark.parametrize("dtype,name", [(torch.float64, "float64"), (torch.int32, "int32"),
                                        (torch.uint8, "uint8"), (torch.bool, "bool"),
                                        (torch.complex64, "complex64")])
def test_a_tensor_of_another_dtype_is_named_with_the_dtypes_accepted(dtype, name):
    rt = make_rt()
    rt.add_sequence(1)
    q, k, v = rnd(4, HQ, D), rnd(4, HKV, D), rnd(4, HKV, D)
    with pytest.raises(ValueError, match=rf"^q: dtype {name} is not supported: use float32, float16 "
                                         r"or bfloat16$"):
        rt.prefill(1, 0, q.to(dtype), k, v, out=torch.empty_like(q))
    with pytest.raises(ValueError, match=rf"^v: dtype {name} is not supported"):
        rt.decode([1], 0, q[:1], k[:1], v[:1].to(dtype))
    assert rt.sequence_length(1, 0) == 0


def test_a_numpy_float64_array_is_named_too():
    rt = make_rt()
    rt.add_sequence(1)
    q, k, v = (np.zeros((4, h, D), dtype=np.float64) for h in (HQ, HKV, HKV))
    with pytest.raises(ValueError, match="k: dtype float64 is not supported: use float32, float16 "
                                         "or bfloat16"):
        rt.append(1, 0, k, v)


def test_device_memory_lists_the_resident_tier():
    sinks, window, layers = 4, 32, 2
    rt = make_rt(policy="oracle", budget=48, sink_tokens=sinks, window_tokens=window)
    mem = rt.device_memory()
    parts = mem["parts"]
    assert mem["total_bytes"] == sum(parts.values()) > 0
    assert mem["cap_bytes"] == 0 and mem["bank_slots"] == 0
    # Sinks and window of every sequence, layer and KV head, K and V, bf16: at least that much.
    assert parts["resident tier"] >= 4 * layers * HKV * (sinks + window) * D * 2 * 2
    assert list(parts.values()) == sorted(parts.values(), reverse=True)
    s = rt.stats()
    assert s["device_bytes_reserved"] >= mem["total_bytes"]
    assert s["bank_admit_failures"] == 0 and s["ms_prime"] == 0.0
