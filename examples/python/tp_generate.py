#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""Tensor-parallel generation with kvferry holding each rank's KV cache: transformers shards a
Llama-family model over the ranks (``DistributedConfig(tp_plan="auto")``, the same as
``tp_plan="auto"``), each rank's KvferryCache runs one kvferry Runtime over its own KV heads, and
the ranks' Stats are summed at the end. Run with torchrun; gloo on the CPU, NCCL on GPUs (one GPU
per rank, the GPU of LOCAL_RANK). See docs/tensor-parallel.md.

    pip install .[hf]            # or: pip install . torch transformers accelerate
    # a small Llama with random weights (4 query / 2 KV heads), no download, 2 CPU ranks:
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/python/tp_generate.py --check
    # a checkpoint directory or hub id whose head counts divide by the number of ranks:
    torchrun --nproc-per-node 2 examples/python/tp_generate.py --model PATH \\
        [--prompt-tokens 512] [--new-tokens 32] [--policy lfps] [--budget 128] [--device cpu|cuda]

``--check`` also generates in one process (rank 0, the unsharded model, the same policy) and
reports whether the tokens are the same.
"""
import argparse
import os
import sys
import tempfile
import time


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory or hub id (default: a random small Llama)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--policy", default="lfps")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--kv-dtype", default="bf16")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="auto: cuda where torch sees a GPU")
    ap.add_argument("--check", action="store_true", help="compare with a one-process run")
    return ap.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    # before torch looks for GPUs: transformers picks the mesh's device (and gloo) from what it sees
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import (AutoModelForCausalLM, DistributedConfig, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM)

import kvferry  # noqa: E402
import kvferry.hf  # noqa: E402

# Counters that add up over ranks (each rank counts its own heads); decode_tokens and
# prefill_tokens count (sequence, layer) calls, the same on every rank, and the cost_* rates,
# split_share and xl_gap_us are per-rank measurements: none of those is summed.
SUMMED = ("rows_selected", "rows_resident", "rows_bank_hit",
          "rows_fetched", "rows_cpu", "bytes_h2d", "bytes_d2h", "host_bytes_reserved",
          "device_bytes_reserved", "ms_prefill", "ms_select", "ms_attend_cpu", "ms_attend_gpu")


def random_llama(path):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=4096)
    LlamaForCausalLM(cfg).save_pretrained(path)


def generate(model, ids, a, backend):
    cache = kvferry.hf.KvferryCache(model.config, policy=a.policy, budget=a.budget,
                                    window_tokens=a.window, backend=backend, kv_dtype=a.kv_dtype,
                                    max_tokens=ids.shape[1] + a.new_tokens + 16, max_batch=1)
    model.config._attn_implementation = "kvferry"
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                             do_sample=False, past_key_values=cache)
    return out[0, ids.shape[1]:], time.perf_counter() - t0, cache


def main():
    a = ARGS
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if "RANK" not in os.environ:
        sys.exit("tp_generate: run it with torchrun, e.g. torchrun --nproc-per-node 2 " + sys.argv[0])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if a.device == "cuda":
        if not kvferry.cuda_available():
            sys.exit("tp_generate: kvferry was built without CUDA or sees no GPU; use --device cpu")
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")

    tmp = None
    path = a.model
    if path is None:  # rank 0 writes the random model, the others wait for it
        tmp = tempfile.TemporaryDirectory() if rank == 0 else None
        name = [tmp.name if tmp else None]
        dist.broadcast_object_list(name, src=0)
        path = name[0]
        if rank == 0:
            random_llama(path)
        dist.barrier()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    # transformers shards q/k/v/o (and the MLP) over the ranks: each rank's attention sees
    # num_attention_heads / world query heads and num_key_value_heads / world KV heads
    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_plan="auto"), dtype=dtype).eval()
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, a.prompt_tokens), generator=g).to(a.device)
    backend = "cuda" if a.device == "cuda" else "host"

    try:
        out, secs, cache = generate(model, ids, a, backend)
    except ValueError as e:  # e.g. heads that do not divide by the world size
        sys.exit(f"tp_generate (rank {rank}): {e}")
    st = cache.runtime.stats()
    mine = {k: float(st[k]) for k in SUMMED}
    every = [None] * world
    dist.all_gather_object(every, dict(heads=(cache.num_q_heads, cache.num_kv_heads),
                                       threads=cache.runtime.config.cpu_threads,
                                       rows=mine["rows_selected"],
                                       host=mine["host_bytes_reserved"]))
    total = torch.tensor([mine[k] for k in SUMMED], dtype=torch.float64)
    if a.device == "cuda":
        total = total.cuda()
    dist.all_reduce(total)  # Stats per rank, summed by the caller
    same_tokens = None
    if a.check and rank == 0:
        single = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(a.device).eval()
        ref, ref_secs, _ = generate(single, ids, a, backend)
        same_tokens = int((ref == out).sum())
    if rank == 0:
        c = model.config.get_text_config()
        print(f"model {path if a.model else 'random Llama'}: {c.num_attention_heads} query / "
              f"{c.num_key_value_heads} KV heads, {c.num_hidden_layers} layers; {world} ranks "
              f"({a.device}, {dist.get_backend()}), prompt {ids.shape[1]}, {a.new_tokens} new "
              f"tokens, {a.policy}@{a.budget}")
        for r, e in enumerate(every):
            print(f"  rank {r}: Runtime over {e['heads'][0]} query / {e['heads'][1]} KV heads, "
                  f"{e['threads']} CPU threads, rows attended {e['rows']:,.0f}, "
                  f"host bytes reserved {e['host']:,.0f}")
        summed = dict(zip(SUMMED, total.tolist()))
        print(f"  summed: rows attended {summed['rows_selected']:,.0f}, host bytes reserved "
              f"{summed['host_bytes_reserved']:,.0f}, decode calls per rank "
              f"{int(st['decode_tokens']):,d}")
        print(f"  {a.new_tokens / secs:.1f} tokens/s (prefill + decode)")
        print(f"  tokens: {out.tolist()}")
        if same_tokens is not None:
            print(f"  one-process run: {same_tokens} / {len(out)} tokens the same "
                  f"({a.new_tokens / ref_secs:.1f} tokens/s)")
    dist.barrier()
    if tmp is not None:
        tmp.cleanup()
    dist.destroy_process_group()
    if same_tokens is not None and same_tokens != len(out):
        sys.exit(1)


if __name__ == "__main__":
    main()
