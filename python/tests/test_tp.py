# Copyright kvferry authors. Apache-2.0.
"""kvferry.hf under tensor parallelism: transformers' ``tp_plan="auto"`` run by ``torchrun
--nproc-per-node 2`` on the CPU (gloo), a small Llama-shaped model with random weights made here
(4 query / 2 KV heads, 2 layers, hidden 64). Each rank's KvferryCache holds its own KV head; greedy
tokens and logits (prefill, then decode steps) equal the single-process run, dense and streaming;
each rank's Stats count half of the KV. Also: heads that do not divide by the world size are
refused with the numbers, and world size 1 takes the same code.

This file is also the worker torchrun runs (``python test_tp.py --worker OUT``)."""
import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

import kvferry.hf as kh  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

PROMPT = 48      # prompt tokens (prefill)
STEPS = 8        # decode steps fed from a fixed sequence (logits compared)
NEW = 8          # greedy tokens generated (compared)
# (name, KvferryCache arguments): the dense policy, and streaming with a budget below the prompt
# (its choice depends only on positions, so both runs must attend the same rows)
RUNS = [
    ("dense", dict(policy="dense", budget=0)),
    ("streaming", dict(policy="streaming", budget=20, sink_tokens=4, window_tokens=8)),
]
# per-rank counters that scale with the KV heads a rank holds: each rank's is half the single run's
PER_HEAD = ("rows_selected", "rows_resident", "rows_cpu", "rows_fetched")


def make_model(path, num_heads=4, num_kv_heads=2, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=16 * num_heads, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=num_heads,
                      num_key_value_heads=num_kv_heads, head_dim=16,
                      max_position_embeddings=512)
    LlamaForCausalLM(cfg).eval().save_pretrained(path)


def run_model(model, ids):
    """Per policy: logits of the prompt and STEPS decode steps, greedy tokens, the Stats."""
    model.config._attn_implementation = "kvferry"
    result = {}
    for name, kw in RUNS:
        args = dict(backend="host", kv_dtype="f16", max_tokens=256, max_batch=1,
                    probe_at_start=False)
        args.update(kw)
        cache = kh.KvferryCache(model.config, **args)
        with torch.no_grad():
            logits = [model(ids[:, :PROMPT], past_key_values=cache, use_cache=True).logits[0]]
            for t in range(PROMPT, PROMPT + STEPS):
                logits.append(model(ids[:, t:t + 1], past_key_values=cache,
                                    use_cache=True).logits[0])
        stats = cache.runtime.stats()
        # what the last decode step attended, per layer and local KV head
        chosen = [[cache.runtime.last_selection(0, layer, h) for h in range(cache.num_kv_heads)]
                  for layer in range(model.config.num_hidden_layers)]
        gen_cache = kh.KvferryCache(model.config, **args)
        with torch.no_grad():
            out = model.generate(ids[:, :PROMPT], max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False, past_key_values=gen_cache)
        result[name] = dict(logits=torch.cat(logits), tokens=out[0, PROMPT:].tolist(),
                            stats=stats, chosen=chosen,
                            heads=(cache.num_q_heads, cache.num_kv_heads),
                            tp=(cache.tp_size, cache.tp_rank),
                            cpu_threads=cache.runtime.config.cpu_threads)
    return result


def worker(out):
    """One torchrun rank: loads the model with tp_plan="auto" and runs what run_model runs; then
    checks that a model whose KV heads do not divide by the world size is refused."""
    rank = int(os.environ["RANK"])
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "model"), tp_plan="auto",
                                                 dtype=torch.float32).eval()
    ids = torch.load(os.path.join(out, "ids.pt"))
    result = run_model(model, ids)
    q_local = model.model.layers[0].self_attn.q_proj.weight
    result["q_proj_local_rows"] = (q_local.to_local() if hasattr(q_local, "to_local")
                                   else q_local).shape[0]
    from_model = kh.KvferryCache(model, policy="dense", budget=0, backend="host",
                                 probe_at_start=False)  # the model itself: its mesh, its plan
    result["from_model"] = (from_model.tp_size, from_model.tp_rank, from_model.num_q_heads,
                            from_model.num_kv_heads)
    odd = os.path.join(out, "odd")
    if os.path.isdir(odd):
        try:
            m = AutoModelForCausalLM.from_pretrained(odd, tp_plan="auto", dtype=torch.float32)
        except Exception as e:  # noqa: BLE001 (reported to the test)
            result["odd"] = f"transformers refused to load: {type(e).__name__}: {e}"
        else:
            try:
                kh.KvferryCache(m.config, policy="dense", budget=0, backend="host")
                result["odd"] = "no error"
            except ValueError as e:
                result["odd"] = str(e)
    result["seconds"] = time.perf_counter() - t0
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def _gloo_available():
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


def _torchrun(tmp_path, nproc):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU and gloo, on any machine
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           os.path.abspath(__file__), "--worker", str(tmp_path)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    took = time.perf_counter() - t0
    if p.returncode != 0:
        pytest.fail(f"torchrun exited {p.returncode} after {took:.1f} s\n--- stdout\n"
                    f"{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-8000:]}")
    return [torch.load(os.path.join(tmp_path, f"rank{r}.pt")) for r in range(nproc)], took


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if not _gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    d = tmp_path_factory.mktemp("tp")
    make_model(d / "model")
    make_model(d / "odd", num_heads=6, num_kv_heads=3, seed=1)
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (1, PROMPT + STEPS))
    torch.save(ids, d / "ids.pt")
    torch.set_num_threads(1)
    single = run_model(AutoModelForCausalLM.from_pretrained(d / "model", dtype=torch.float32)
                       .eval(), ids)
    return d, single


def _close(got, want):
    # fp32 rounding: the row-parallel projections sum their halves in another order
    return (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_two_ranks_equal_the_single_process_run(setup):
    d, single = setup
    ranks, took = _torchrun(d, 2)
    work = ", ".join(f"{r['seconds']:.1f}" for r in ranks)
    print(f"\ntorchrun --nproc-per-node 2: {took:.1f} s (each rank's load and runs: {work} s)")
    for r, res in enumerate(ranks):
        assert res["q_proj_local_rows"] == 2 * 16  # transformers did shard: 2 of 4 query heads
        assert res["from_model"] == (2, r, 2, 1)
        for name, _ in RUNS:
            got, want = res[name], single[name]
            assert got["tp"] == (2, r)
            assert got["heads"] == (2, 1)
            assert want["heads"] == (4, 2)
            assert got["cpu_threads"] >= 1
            assert got["tokens"] == want["tokens"], (name, r)
            assert _close(got["logits"], want["logits"]), \
                (name, r, (got["logits"] - want["logits"]).abs().max().item())
            gs, ws = got["stats"], want["stats"]
            assert gs["decode_tokens"] == ws["decode_tokens"] == 2 * STEPS  # 2 layers
            assert gs["prefill_tokens"] == ws["prefill_tokens"]
            assert ws["rows_selected"] > 0
            for key in PER_HEAD:
                assert 2 * gs[key] == ws[key], (name, r, key, gs[key], ws[key])
            # rank r holds KV head r of the model: it attended what the single run did there
            for layer in range(2):
                assert got["chosen"][layer] == [want["chosen"][layer][r]], (name, r, layer)
    for name, _ in RUNS:  # summed by the caller: the ranks' counters add up to the single run's
        for key in PER_HEAD:
            assert sum(res[name]["stats"][key] for res in ranks) == single[name]["stats"][key]
    # streaming attends its budget of 20 rows per KV head, layer and step: 4 sinks, the last 16
    assert single["streaming"]["stats"]["rows_selected"] == 2 * 2 * STEPS * 20
    n = PROMPT + STEPS
    assert single["streaming"]["chosen"][0][1] == list(range(4)) + list(range(n - 16, n))
    # 3 KV heads over 2 ranks: refused with the numbers
    for res in ranks:
        assert "num_key_value_heads=3" in res["odd"] and "2 ranks" in res["odd"], res["odd"]


def test_example_runs_with_two_cpu_ranks(tmp_path):
    """examples/python/tp_generate.py as docs/tensor-parallel.md runs it (a random Llama, 2 CPU
    ranks), small: its --check compares the tokens with a one-process run and exits 1 if any
    differ."""
    if not _gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    example = os.path.join(ROOT, "examples", "python", "tp_generate.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), example,
           "--device", "cpu", "--prompt-tokens", "64", "--new-tokens", "8", "--policy",
           "streaming", "--budget", "24", "--window", "8", "--check"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    print(f"\ntp_generate.py, 2 ranks: {time.perf_counter() - t0:.1f} s\n{p.stdout}")
    assert p.returncode == 0, f"--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-8000:]}"
    assert "rank 1: Runtime over 2 query / 1 KV heads" in p.stdout
    assert "one-process run: 8 / 8 tokens the same" in p.stdout


def test_heads_not_dividing_are_refused_with_the_numbers():
    cfg = LlamaConfig(vocab_size=64, hidden_size=144, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=16)  # SmolLM2's heads
    with pytest.raises(ValueError, match=r"over 2 ranks.*num_attention_heads=9 and "
                                         r"num_key_value_heads=3 do not both divide by 2"):
        kh.KvferryCache(cfg, policy="dense", budget=0, backend="host", tp_size=2)
    c = kh.KvferryCache(cfg, policy="dense", budget=0, backend="host", tp_size=3, tp_rank=1,
                        probe_at_start=False)
    assert (c.num_q_heads, c.num_kv_heads, c.tp_size, c.tp_rank) == (3, 1, 3, 1)
    assert c.runtime.config.num_kv_heads == 1


def test_cache_for_unsharded_config_refuses_sharded_attention():
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    c = kh.KvferryCache(cfg, policy="dense", budget=0, backend="host", probe_at_start=False)
    q = torch.zeros(1, 2, 3, 16)
    k = torch.zeros(1, 1, 3, 16)
    with pytest.raises(ValueError, match="2 query and 1 KV heads; this cache was made for 4 and 2"):
        c.attend(0, q, k, k)


def test_world_size_one_takes_the_same_path(setup, monkeypatch):
    """The tensor-parallel load in one process (WORLD_SIZE 1, what torchrun --nproc-per-node 1
    sets; DistributedConfig(tp_plan="auto"), which tp_plan="auto" becomes): the same
    from_pretrained and KvferryCache code, tp_size 1, the whole heads, results identical to the
    plain single-process run."""
    from transformers import DistributedConfig

    d, single = setup
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(k, v)
    model = AutoModelForCausalLM.from_pretrained(
        d / "model", distributed_config=DistributedConfig(tp_plan="auto"),
        dtype=torch.float32).eval()
    assert model.config.distributed_config.tp_size == 1
    got = run_model(model, torch.load(d / "ids.pt"))
    for name, _ in RUNS:
        assert got[name]["tp"] == (1, 0) and got[name]["heads"] == (4, 2)
        assert got[name]["tokens"] == single[name]["tokens"]
        assert torch.equal(got[name]["logits"], single[name]["logits"])
        for key in PER_HEAD + ("decode_tokens",):
            assert got[name]["stats"][key] == single[name]["stats"][key]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        sys.exit("usage: torchrun --nproc-per-node N test_tp.py --worker DIR (run by pytest)")
