# Copyright kvferry authors. Apache-2.0.
"""Per-layer attention types (RuntimeConfig.layer_window): the binding takes the windows, a sliding
layer attends exactly its last w tokens (numpy reference, host backend); kvferry.hf reads
transformers' layer_types / sliding_window (Gemma 3, Mistral, Qwen2, GPT-OSS), and tiny Gemma 3
and Mistral models give their eager attention's logits through a KvferryCache at full budget.
The transformers tests skip without torch and transformers."""
import math

import pytest

np = pytest.importorskip("numpy")

import kvferry  # noqa: E402

HQ, HKV, D = 4, 2, 64


def make_runtime(windows, **kw):
    args = dict(num_layers=len(windows), num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                kv_dtype="f16", layer_window=list(windows), max_sequences=2, max_batch=2,
                max_tokens_per_sequence=128, max_prefill_chunk=32, sink_tokens=2,
                window_tokens=4, policy="dense", budget=0, backend="host", cpu_threads=2,
                probe_at_start=False)
    args.update(kw)
    return kvferry.Runtime(**args)


def reference(q, ks, vs):
    """Attention of q [HQ, D] over rows ks, vs [n, HKV, D] (float16-rounded), in float64."""
    out = np.zeros((HQ, D))
    for h in range(HQ):
        kh = ks[:, h // (HQ // HKV)].astype(np.float64)
        vh = vs[:, h // (HQ // HKV)].astype(np.float64)
        logits = kh @ q[h].astype(np.float64) / math.sqrt(D)
        w = np.exp(logits - logits.max())
        out[h] = (w / w.sum()) @ vh
    return out


def test_sliding_layer_attends_its_window():
    rng = np.random.default_rng(0)
    w = 6
    rt = make_runtime([0, w])
    rt.add_sequence(1)
    ks, vs = [], []
    n = 20
    q = rng.standard_normal((n, HQ, D)).astype(np.float32)
    k = rng.standard_normal((n, HKV, D)).astype(np.float32)
    v = rng.standard_normal((n, HKV, D)).astype(np.float32)
    out = rt.prefill(1, 1, q, k, v)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    for t in range(n):
        lo = max(0, t - w + 1)
        np.testing.assert_allclose(out[t], reference(q[t], k16[lo:t + 1], v16[lo:t + 1]),
                                   rtol=1e-4, atol=1e-4)
    ks, vs = list(k16), list(v16)
    for _ in range(5):
        q1 = rng.standard_normal((1, HQ, D)).astype(np.float32)
        k1 = rng.standard_normal((1, HKV, D)).astype(np.float32)
        v1 = rng.standard_normal((1, HKV, D)).astype(np.float32)
        out1 = rt.decode([1], 1, q1, k1, v1)
        ks.append(k1[0].astype(np.float16))
        vs.append(v1[0].astype(np.float16))
        np.testing.assert_allclose(out1[0], reference(q1[0], np.stack(ks[-w:]), np.stack(vs[-w:])),
                                   rtol=1e-4, atol=1e-4)
    m = len(ks)
    assert rt.last_selection(1, 1, 0) == list(range(m - w, m))
    s = rt.stats()
    assert s["rows_window"] == 5 * HKV * w
    assert s["bytes_h2d"] == 0 and s["bytes_d2h"] == 0
    mem = rt.device_memory()
    assert len(mem["layer_bytes"]) == 2
    assert mem["layer_bytes"][0] == mem["layer_bytes"][1]  # a window of 6 fits the tier's 6 rows
    assert not rt.decode_is_capture_safe


def test_bad_layer_windows_raise():
    with pytest.raises(ValueError, match="layer_window has 1 entries; expected num_layers=2"):
        make_runtime([0, 4], num_layers=2, layer_window=[4])
    with pytest.raises(ValueError, match=r"layer_window\[1\] = -1 must be >= 0"):
        make_runtime([0, -1])
    with pytest.raises(ValueError, match="exceeds max_tokens_per_sequence 128"):
        make_runtime([0, 129])
    with pytest.raises(TypeError, match="layer_window"):
        make_runtime([0, 4], layer_window="0,4")
    with pytest.raises(TypeError, match=r"layer_window\[1\] must be an int"):
        make_runtime([0, 4], layer_window=[0, 4.5])
    make_runtime([0, 0])  # all global, as an empty list


# ---- transformers ------------------------------------------------------------------------------

def _hf():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import kvferry.hf as kh
    return torch, kh


def test_layer_windows_from_transformers_configs():
    _, kh = _hf()
    from transformers import Gemma3TextConfig, GptOssConfig, MistralConfig, Qwen2Config
    g = Gemma3TextConfig(num_hidden_layers=6, sliding_window=8)
    assert kh.layer_windows(g, 100) == [8, 8, 8, 8, 8, 0]  # five local layers, one global
    assert kh.layer_windows(GptOssConfig(num_hidden_layers=4, sliding_window=16), 100) == \
        [16, 0, 16, 0]  # alternation, from layer_types
    assert kh.layer_windows(MistralConfig(num_hidden_layers=3, sliding_window=8), 100) == [8, 8, 8]
    assert kh.layer_windows(MistralConfig(num_hidden_layers=3, sliding_window=8), 5) == [5, 5, 5]
    assert kh.layer_windows(MistralConfig(num_hidden_layers=3, sliding_window=None), 100) == []
    assert kh.layer_windows(Qwen2Config(num_hidden_layers=4), 100) == []  # use_sliding_window off
    q = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=16,
                    max_window_layers=2)
    assert kh.layer_windows(q, 100) == [0, 0, 16, 16]
    g.layer_types = ["sliding_attention"] * 5 + ["chunked_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        kh.layer_windows(g, 100)


def _logits(model, ids, impl, cache=None):
    torch, _ = _hf()
    model.config._attn_implementation = impl
    with torch.no_grad():
        if cache is None:
            return model(ids).logits
        return model(ids, past_key_values=cache, use_cache=True).logits


def _cache(kh, model):
    return kh.KvferryCache(model.config, policy="dense", budget=0, backend="host", kv_dtype="f16",
                           max_tokens=256, probe_at_start=False, cpu_threads=2)


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_sliding_models_equal_eager(arch):
    torch, kh = _hf()
    torch.manual_seed(0)
    if arch == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig
        cfg = Gemma3TextConfig(vocab_size=300, hidden_size=128, intermediate_size=256,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=64, sliding_window=6, query_pre_attn_scalar=48,
                               layer_types=["sliding_attention", "sliding_attention",
                                            "full_attention", "sliding_attention"])
        model = Gemma3ForCausalLM(cfg).eval()
    else:
        from transformers import MistralConfig, MistralForCausalLM
        cfg = MistralConfig(vocab_size=300, hidden_size=128, intermediate_size=256,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            sliding_window=5)
        model = MistralForCausalLM(cfg).eval()
    ids = torch.randint(0, 300, (1, 24))
    cache = _cache(kh, model)
    assert any(cache.layer_window) and cache.runtime.config.layer_window == cache.layer_window
    want = _logits(model, ids, "eager")
    got = _logits(model, ids, "kvferry", cache)
    spread = float(want.std())
    assert float((got - want).abs().max()) < 1e-2 * spread
    # Decode past the windows, token by token, against eager over the whole sequence.
    seq = ids
    for _ in range(6):
        nxt = torch.randint(0, 300, (1, 1))
        seq = torch.cat([seq, nxt], dim=1)
        step = _logits(model, nxt, "kvferry", cache)[:, -1]
        ref = _logits(model, seq, "eager")[:, -1]
        assert float((step - ref).abs().max()) < 1e-2 * spread
    assert cache.runtime.stats()["rows_window"] > 0
