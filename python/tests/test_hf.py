# Copyright kvferry authors. Apache-2.0.
"""kvferry.hf: a transformers Llama model whose KV cache and attention are kvferry's (host backend,
CPU). At full budget its logits equal the model's own eager attention; with a sparse policy it
generates and attends the positions the C++ engine chooses."""
import math
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import kvferry  # noqa: E402
import kvferry.hf as kh  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GGUF = os.path.join(ROOT, "data", "SmolLM2-135M-Instruct.Q4_1.gguf")
KJV = os.path.join(ROOT, "data", "kjv.txt")

# K and V are stored as float16 here (kv_dtype="f16") and prefill rounds q and the softmax weights
# to that type (the tensor-core kernel's arithmetic): logits then agree with fp32 eager attention
# to ~1e-3 of their spread (measured: max |diff| 2e-4 with logits of std 0.22).
KV = "f16"


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    return LlamaForCausalLM(cfg).eval()


def cache_for(model, **kw):
    args = dict(policy="dense", budget=0, backend="host", kv_dtype=KV, max_tokens=2048,
                probe_at_start=False, cpu_threads=2)
    args.update(kw)
    return kh.KvferryCache(model.config, **args)


def logits(model, ids, impl, cache=None):
    model.config._attn_implementation = impl
    with torch.no_grad():
        if cache is None:
            return model(ids).logits
        return model(ids, past_key_values=cache, use_cache=True).logits


def test_full_budget_prefill_and_decode_logits_equal_eager():
    m = tiny_model()
    ids = torch.randint(0, 300, (2, 260))
    ref = logits(m, ids, "eager")
    c = cache_for(m)
    got = logits(m, ids[:, :200], "kvferry", c)  # prompt: prefill
    scale = ref.std().item()
    assert (got - ref[:, :200]).abs().max().item() < 5e-3 * scale
    for t in range(200, 260):  # then one token at a time: decode
        step = logits(m, ids[:, t:t + 1], "kvferry", c)
        assert (step[:, 0] - ref[:, t]).abs().max().item() < 5e-3 * scale, t
    assert c.get_seq_length() == 260
    assert c.runtime.stats()["decode_tokens"] == 2 * 2 * 60  # batch 2, 2 layers, 60 steps


def test_greedy_generation_equals_eager_at_full_budget():
    m = tiny_model(1)
    ids = torch.randint(0, 300, (1, 64))
    m.config._attn_implementation = "eager"
    want = m.generate(ids, max_new_tokens=24, do_sample=False)
    m.config._attn_implementation = "kvferry"
    got = m.generate(ids, max_new_tokens=24, do_sample=False, past_key_values=cache_for(m))
    assert torch.equal(got, want)


class RecordingCache(kh.KvferryCache):
    """Keeps what each layer's attention saw, to recompute the engine's choices in the test."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.keys = {}
        self.last_q = {}

    def attend(self, layer, query, key, value):
        prev = self.keys.get(layer)
        self.keys[layer] = key if prev is None else torch.cat([prev, key], dim=2)
        self.last_q[layer] = query
        return super().attend(layer, query, key, value)


def test_streaming_generation_attends_sinks_and_recent():
    m = tiny_model(2)
    ids = torch.randint(0, 300, (1, 400))
    c = cache_for(m, policy="streaming", budget=48, sink_tokens=4, window_tokens=16)
    m.config._attn_implementation = "kvferry"
    out = m.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=c)
    assert out.shape == (1, 408)
    n = c.get_seq_length()  # the last generated token is not fed back
    for layer in range(2):
        for h in range(2):
            assert c.runtime.last_selection(0, layer, h) == list(range(4)) + list(range(n - 44, n))


def test_oracle_generation_attends_the_exact_top_k():
    m = tiny_model(3)
    ids = torch.randint(0, 300, (1, 300))
    budget = 32
    c = RecordingCache(m.config, policy="oracle", budget=budget, backend="host", kv_dtype=KV,
                       max_tokens=1024, probe_at_start=False, sink_tokens=4, window_tokens=8)
    m.config._attn_implementation = "kvferry"
    m.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=c)
    d = m.config.head_dim
    group = m.config.num_attention_heads // m.config.num_key_value_heads
    for layer in range(2):
        k = c.keys[layer][0].to(torch.float16).double()  # [Hkv, N, D], as stored
        q = c.last_q[layer][0, :, -1].double()             # [Hq, D]
        for h in range(k.shape[0]):
            qs = q[h * group:(h + 1) * group]
            p = torch.softmax(k[h] @ qs.T / math.sqrt(d), dim=0).sum(dim=1)
            want = set(torch.topk(p, budget).indices.tolist())
            got = set(c.runtime.last_selection(0, layer, h))
            assert len(got) == budget
            assert len(got ^ want) <= 2, (layer, h)
            assert abs(sum(float(p[i]) for i in got) - sum(float(p[i]) for i in want)) < 1e-5


@pytest.mark.parametrize("policy", ["oracle", "streaming", "sparcas", "dense"])
def test_planned_steps_equal_layer_by_layer_planning(policy):
    """plan_steps (the default) plans each token step once at its first layer: the same tokens and
    selections as planning every layer's decode by itself, and the runtime counts one plan a step
    instead of one a layer."""
    m = tiny_model(4)
    ids = torch.randint(0, 300, (2, 200))
    outs, sels, plans = [], [], []
    for plan in (True, False):
        c = cache_for(m, policy=policy, budget=40, sink_tokens=4, window_tokens=8, plan_steps=plan)
        m.config._attn_implementation = "kvferry"
        outs.append(m.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=c))
        sels.append([c.runtime.last_selection(b, layer, h) for b in range(2) for layer in range(2)
                     for h in range(2)])
        plans.append(c.runtime.stats()["decode_plans"])
    assert torch.equal(outs[0], outs[1])
    assert sels[0] == sels[1]
    # 6 new tokens, the first from the prefill: 5 steps, planned once each or once a layer (2 layers)
    assert plans == [5, 10]


def test_kv_tensor_bytes_counts_a_dynamic_cache():
    from transformers import DynamicCache

    model = tiny_model()
    model.config._attn_implementation = "eager"
    cache = DynamicCache(config=model.config)
    assert kh.kv_tensor_bytes(cache) == 0
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    want = 2 * c.num_hidden_layers * 2 * c.num_key_value_heads * 5 * head_dim * 4  # K and V, fp32
    assert kh.kv_tensor_bytes(cache) == want


def test_bad_uses_raise():
    m = tiny_model(4)
    ids = torch.randint(0, 300, (2, 20))
    m.config._attn_implementation = "kvferry"
    with pytest.raises(ValueError, match="KvferryCache"):
        with torch.no_grad():
            m(ids, use_cache=False)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :5] = 0
    with pytest.raises(ValueError, match="padded"):
        with torch.no_grad():
            m(ids, attention_mask=mask, past_key_values=cache_for(m), use_cache=True)
    c = cache_for(m)
    with torch.no_grad():
        m(ids, past_key_values=c, use_cache=True)
        with pytest.raises(ValueError, match="batch of 2"):
            m(ids[:1, :1], past_key_values=c, use_cache=True)
    with pytest.raises(NotImplementedError, match="beam"):
        c.reorder_cache(torch.tensor([1, 0]))
    c.reset()
    assert c.get_seq_length() == 0
    with pytest.raises(ValueError, match="unknown policy"):
        cache_for(m, policy="nonsense", budget=16)


@pytest.mark.skipif(not os.path.exists(GGUF), reason="SmolLM2 GGUF not fetched (scripts/fetch-data.sh)")
def test_smollm2_full_budget_logits_equal_eager_on_kjv():
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = os.path.split(GGUF)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32,
                                             attn_implementation="eager").eval()
    text = open(KJV, encoding="utf-8").read()[:4000] if os.path.exists(KJV) else "In the beginning " * 100
    ids = tok(text, return_tensors="pt").input_ids[:, :320]
    ref = logits(m, ids, "eager")
    c = cache_for(m, max_tokens=1024)
    got = logits(m, ids[:, :300], "kvferry", c)
    for t in range(300, 320):
        got = torch.cat([got, logits(m, ids[:, t:t + 1], "kvferry", c)], dim=1)
    # SmolLM2's logits spread wider (std ~6): the f16 K/V and prefill rounding leave ~0.5% of it
    # (measured: max |diff| 0.033 with std 6.3); every position's top token must agree.
    diff = (got - ref).abs().max().item()
    assert diff < 1e-2 * ref.std().item(), diff
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
