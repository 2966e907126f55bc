# Copyright kvferry authors. Apache-2.0.
"""examples/python/hf_generate.py end to end on a tiny random Llama (made here, CPU, a few steps):
both paths run, and the figures it reports are the ones it says (KV bytes of each cache, tokens
attended per step against the budget), with no deprecation warning."""
import importlib.util
import os
import random
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import kvferry  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLE = os.path.join(ROOT, "examples", "python", "hf_generate.py")

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16


def load_example():
    spec = importlib.util.spec_from_file_location("hf_generate_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 2-layer Llama with a word-level tokenizer, saved as a model directory, and a text."""
    d = tmp_path_factory.mktemp("tiny_llama")
    words = [f"w{i}" for i in range(120)]
    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2}
    for w in words:
        vocab[w] = len(vocab)
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", eos_token="[EOS]",
                                         pad_token="[PAD]").save_pretrained(d)
    cfg = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=HEADS * HEAD_DIM,
                                   intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                   head_dim=HEAD_DIM, max_position_embeddings=512,
                                   pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    rng = random.Random(0)
    text = d / "text.txt"
    text.write_text(" ".join(rng.choice(words) for _ in range(600)), encoding="utf-8")
    return d, text


def test_main_compares_both_paths_and_measures_what_it_says(tiny, capsys):
    model_dir, text = tiny
    prompt, new, budget, sinks, window = 96, 6, 24, 4, 8
    mod = load_example()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = mod.main(["--model", str(model_dir), "--text", str(text), "--device", "cpu",
                        "--prompt-tokens", str(prompt), "--new-tokens", str(new),
                        "--policy", "oracle", "--budget", str(budget), "--sinks", str(sinks),
                        "--window", str(window)])
    deprecations = [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))
                    and ("transformers" in w.filename or "hf_generate" in w.filename
                         or "kvferry" in w.filename)]
    assert not deprecations, [f"{w.filename}:{w.lineno}: {w.message}" for w in deprecations]

    assert res["device"] == "cpu" and res["backend"] == "host"
    assert res["prompt_tokens"] == prompt and res["new_tokens"] == new
    d, k = res["dense"], res["kvferry"]
    for r in (d, k):
        assert len(r["tokens"]) == new
        assert r["prefill_s"] > 0 and r["decode_s"] > 0
        assert r["decode_tok_s"] == pytest.approx((new - 1) / r["decode_s"])
    assert 0 <= res["same_tokens"] <= new

    # Dense: the DynamicCache holds every token but the last generated one, float32 on the CPU.
    assert d["kv_dtype"] == "float32"
    assert d["kv_device_bytes"] == LAYERS * 2 * KV_HEADS * HEAD_DIM * (prompt + new - 1) * 4
    assert d["attended_per_step"] == pytest.approx(prompt + new / 2)

    # kvferry: the device tier is the resident tier (sinks + window, no bank), the rest of its
    # device buffers are reported apart, and the host store holds every token.
    assert k["kv_dtype"] == "bf16"
    assert k["kv_device_bytes"] == k["device_parts"]["resident tier"]
    assert k["kv_device_bytes"] >= LAYERS * 2 * KV_HEADS * HEAD_DIM * (sinks + window) * 2
    assert k["kv_device_bytes"] < d["kv_device_bytes"]
    assert k["other_device_bytes"] == k["device_bytes_reserved"] - k["kv_device_bytes"]
    assert k["host_store_bytes"] >= LAYERS * 2 * KV_HEADS * HEAD_DIM * (prompt + new - 1) * 2
    # The oracle attends exactly its budget (sinks and window included) once the context exceeds
    # it; the stats of the warm-up are not counted.
    assert k["attended_per_step"] == budget
    assert k["decode_steps"] == new - 1

    out = capsys.readouterr().out
    assert "each path warmed up first" in out
    assert "device tier (host-emulated)" in out and "resident tier" in out
    assert f"budget {budget} = {sinks}+{window}+{budget - sinks - window}" in out


def test_main_refuses_bad_values_and_a_missing_gpu(tiny, capsys):
    model_dir, text = tiny
    mod = load_example()
    base = ["--model", str(model_dir), "--text", str(text)]
    with pytest.raises(SystemExit) as e:
        mod.main(base + ["--budget", "-5"])
    assert e.value.code == 2
    assert "--budget must be >= 0 (got -5)" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="torch sees no CUDA device; use --device cpu"):
            mod.main(base + ["--device", "cuda"])
