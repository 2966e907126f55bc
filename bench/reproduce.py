#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""Regenerates one results file, bench/results/NAME.json, on the machine at hand, in one run.

  python3 bench/reproduce.py --list          the names, whether each needs a GPU, what it measures
  python3 bench/reproduce.py NAME            build what NAME needs, run it (baselines included),
                                             write bench/results/NAME.json
  python3 bench/reproduce.py NAME --dry-run  print the commands only

Every row written carries "provenance": the commit (git rev-parse HEAD, "+dirty" when the tree has
changes), the date, the GPU and driver (nvidia-smi, when present), the CPU model and core count
(/proc/cpuinfo), and the exact commands of the run. Environment: B (build folder, default
build-release), T (scratch folder, default /tmp/kvferry-reproduce/NAME), KVFERRY_CUDA_ARCHS (default
90), JOBS (build jobs, default all cores). Without CUDA the GPU names refuse to run and say so.
docs/benchmarks.md says what each file measures and on which machine its committed rows ran.
"""
import argparse
import datetime
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RES = os.path.join(ROOT, "bench", "results")
B = os.environ.get("B", "build-release")  # relative to the repository root, where commands run
PY = "python3"
E2E = f"{B}/bench/kvferry-e2e"
LLAMA = f"{B}/examples/llama/kvferry-llama"
BENCH = f"{B}/bench/kvferry-bench"
MODEL = "data/SmolLM2-135M-Instruct.Q4_1.gguf"


def host_gib():
    try:
        kb = int(next(l for l in open("/proc/meminfo") if l.startswith("MemTotal")).split()[1])
        return max(8, kb // 1048576 - 24)
    except (OSError, StopIteration):
        return 64


# ------------------------------------------------------------------------------------------ specs
# Each spec: gpu (needs CUDA), targets (CMake targets to build), examples (needs the examples
# built), what (one line), run(T) -> list of commands (strings run by bash from the repository
# root), merge(T) -> the JSON object to write (its rows get provenance).

def e2e_cmds(T):
    base = f"{E2E} --unique-kv --steps 8"
    return [
        f"{base} --contexts 32768,131072 --batches 1,4 --modes dense_resident,streaming_resident,"
        f"streaming,quest,sparcas,quest_bank,sparcas_bank,hip_bank,kvpop,kvpop_bank,xl+quest_bank,"
        f"xl+sparcas_bank,xl+kvpop_bank --json {T}/decode.jsonl",
        f"{base} --contexts 32768,131072 --batches 1 --modes oracle,oracle_bank,lfps --json {T}/slow.jsonl",
        f"{E2E} --unique-kv --steps 2 --contexts 32768,131072 --batches 1 --modes full_streaming --json {T}/full.jsonl",
        f"{base} --contexts 131072 --batches 1 --query-drift 0.5 --modes quest_bank,sparcas_bank,hip_bank,"
        f"kvpop_bank --json {T}/drift05.jsonl",
        f"{base} --contexts 131072 --batches 1 --query-drift 1 --modes quest_bank,sparcas_bank --json {T}/drift1.jsonl",
        *[f"{base} --contexts 131072 --batches 1 --modes lfps --async-cpu {a} --engine-us {u} --json {T}/async_{a}_{u}.jsonl"
          for a in (0, 1) for u in (0, 300)],
        *[f"{E2E} --contexts 8192,32768,131072 --modes prefill_dense,prefill_lfps --prefill-chunks 2048,8192 "
          f"--prefill-order {o} --json {T}/prefill_{o}.jsonl" for o in ("chunk", "layer")],
        f"cat {T}/*.jsonl > {T}/rows.jsonl",
        f"{PY} scripts/device/e2e_sdpa.py {T}/rows.jsonl {T}/e2e_sdpa.json",
    ]


def e2e_merge(T):
    d = json.load(open(f"{T}/e2e_sdpa.json"))
    d["bench"] = "kvferry-e2e (bench/e2e_bench.cu) + torch SDPA in the same run (scripts/device/e2e_sdpa.py)"
    d["regenerate"] = "python3 bench/reproduce.py e2e"
    return d


SCALE_POINTS = [(32768, 4), (32768, 16), (131072, 1), (131072, 4), (524288, 1)]


def scale_cmds(T):
    H = host_gib()
    cap = f"--unique-kv --gpu-gib 8 --host-gib {H}"
    cmds = []
    for c, n in SCALE_POINTS:
        need = c * n * 128 // 1048576  # GiB of host KV (128 KiB a token)
        if need * 1.05 > H:
            cmds.append(f"echo 'scale: {c}x{n} needs {need} GiB of host KV, this machine gives {H}: skipped'")
            continue
        p = f"{T}/p{c}x{n}"
        cmds += [
            f"{E2E} {cap} --contexts {c} --batches {n} --steps 8 --modes kvpop_bank,psaw+kvpop_bank,"
            f"xl+kvpop_bank,quest_bank,sparcas_bank,hip_bank --json {p}_bank.jsonl",
            f"{E2E} {cap} --contexts {c} --batches {n} --steps 2 --modes full_streaming,dense_cpu --json {p}_base.jsonl",
            f"{E2E} {cap} --contexts {c} --batches {n} --steps 8 --modes sparcas,kvpop --route gpu --json {p}_route_gpu.jsonl",
            f"{E2E} {cap} --contexts {c} --batches {n} --steps 8 --modes sparcas,kvpop --route auto --json {p}_route_auto.jsonl",
            f"KVFERRY_SPLIT_SHARE=1 {E2E} {cap} --contexts {c} --batches {n} --steps 8 --modes sparcas,kvpop "
            f"--route auto --json {p}_route_cpu.jsonl",
        ]
    cmds += [f"{E2E} {cap} --contexts {c} --batches {n} --steps 8 --modes dense_resident --json {T}/dense_{c}x{n}.jsonl"
             for c, n in ((32768, 1), (49152, 1), (57344, 1), (131072, 1), (32768, 2))]
    cmds += [f"for f in {T}/*.jsonl; do {PY} scripts/device/e2e_sdpa.py $f ${{f%.jsonl}}.sdpa.json; done"]
    return cmds


def scale_merge(T):
    rows = []
    for f in sorted(glob.glob(f"{T}/*.sdpa.json")):
        tag = os.path.basename(f).split(".")[0]
        for r in json.load(open(f))["rows"]:
            r["_file"] = tag
            rows.append(r)
    base = {}
    for r in rows:
        if r["_file"].endswith("_base") and "skipped" not in r:
            base[(r["context"], r["batch"], r["mode"])] = r["ms_per_token_step"]
    out = []
    for r in rows:
        tag = r.pop("_file")
        route_kind = tag.split("_route_")[1] if "_route_" in tag else None
        mode = r["mode"]
        policy = mode.split("+")[-1].replace("_bank", "").replace("_resident", "")
        row = {"policy": "dense" if mode in ("full_streaming", "dense_cpu", "dense_resident") else policy,
               "mode": mode, "selectors": "+".join(mode.split("+")[:-1]) or "none",
               "context": r["context"], "batch": r["batch"],
               "route": "cpu" if mode == "dense_cpu" else (route_kind or r.get("route", "gpu")),
               "gpu_bytes_cap": 8 << 30}
        if route_kind:
            row["mode"] = f"{mode} ({ {'gpu': 'route gpu', 'auto': 'split', 'cpu': 'all misses on CPU'}[route_kind] })"
            if route_kind == "cpu":
                row["route"] = "auto, KVFERRY_SPLIT_SHARE=1"
        if "skipped" in r:
            out.append({**row, "skipped": r["skipped"]})
            continue
        # A route row's time is the eager step (a captured step holds no host work).
        ms = r.get("ms_per_token_step_no_graph") if route_kind else r["ms_per_token_step"]
        fs = base.get((r["context"], r["batch"], "full_streaming"))
        dc = base.get((r["context"], r["batch"], "dense_cpu"))
        sdpa = r.get("sdpa_ms_per_token_step")
        row.update(ms_per_token_step=ms, tokens_per_s=round(r["batch"] * 1e3 / ms, 1),
                   speedup_vs_full_streaming=round(fs / ms, 2) if fs else None,
                   speedup_vs_dense_cpu=round(dc / ms, 2) if dc else None,
                   sdpa_uncapped_ms_per_token_step=sdpa, ratio_vs_sdpa_uncapped=ms / sdpa if sdpa else None)
        row.update({k: r[k] for k in ("gpu_bytes", "host_bytes", "bank_slots", "bank_hit_rate",
                                      "rows_selected_per_step", "rows_bank_hit_per_step",
                                      "rows_fetched_per_step", "rows_cpu_per_step", "decode_split_per_step",
                                      "split_share", "host_syncs_per_step", "capture_safe",
                                      "stages_ms_per_step", "fill_s", "unique_kv") if k in r})
        if route_kind:
            row["ms_per_token_step_graph"] = r.get("ms_per_token_step")
        out.append(row)
    return {"bench": "kvferry-e2e under an 8 GiB device-memory cap (--gpu-gib 8), 32 layers of the "
                     "Llama-3.1-8B attention shape, budget 2%",
            "regenerate": "python3 bench/reproduce.py scale", "rows": out}


def split_cmds(T):
    H = host_gib()
    cap = f"--unique-kv --gpu-gib 8 --host-gib {H} --contexts 131072 --batches 1,4 --steps 8 --modes sparcas,kvpop"
    return [f"{E2E} {cap} --route gpu --json {T}/gpu.jsonl",
            f"{E2E} {cap} --route auto --json {T}/auto.jsonl",
            f"KVFERRY_SPLIT_SHARE=1 {E2E} {cap} --route auto --json {T}/cpu.jsonl"]


def split_merge(T):
    rows = []
    for kind in ("gpu", "auto", "cpu"):
        for l in open(f"{T}/{kind}.jsonl"):
            if l.strip():
                r = json.loads(l)
                r["route"] = {"gpu": "gpu", "auto": "split", "cpu": "cpu"}[kind]
                rows.append(r)
    return {"what": "the scheduler's split inside the planned step: device-selected policies (2%) "
                    "without a bank, route gpu vs the split (route auto) vs every miss on the CPU "
                    "(KVFERRY_SPLIT_SHARE=1), 8 GiB cap", "regenerate": "python3 bench/reproduce.py split",
            "rows": rows}


def quality_cmds(T):
    L = f"{LLAMA} --model {MODEL}"
    ppl = "--perplexity --text data/kjv.txt --context 8192 --scored 1024 --backend host"
    pk = "--passkey --text data/kjv.txt --backend host"
    W = "KVFERRY_KVPOP_WEIGHTS=policies/weights/kvpop_smollm2.safetensors"
    cmds = [
        "bash scripts/fetch-data.sh --model-only",
        f"{L} {ppl} --policy streaming,oracle,quest,sparcas,hip,lfps --budget 256,512 --json {T}/ppl.json",
        f"{W} {L} {ppl} --policy kvpop --budget 256,512 --no-dense --json {T}/ppl_kvpop.json",
        f"{L} {ppl} --policy kvpop --param scorer=2 --budget 256,512 --no-dense --json {T}/ppl_kvpop2.json",
        f"{L} {ppl} --policy sparcas --param bits=16 --param d_b=8 --budget 256,512 --no-dense --json {T}/ppl_sparcas16.json",
        f"{L} {ppl} --policy hip --param bits=16 --param align=0 --budget 256,512 --no-dense --json {T}/ppl_hip32.json",
        f"{L} {pk} --lengths 2048,4096 --depths 0.1,0.5,0.9 --policy streaming,oracle,quest,sparcas,hip,lfps "
        f"--budget 256 --json {T}/passkey_24k.json",
        f"{W} {L} {pk} --lengths 2048,4096 --depths 0.1,0.5,0.9 --policy kvpop --budget 256 --no-dense --json {T}/passkey_kvpop.json",
        f"{L} {pk} --lengths 8192 --depths 0.5 --policy oracle,quest,sparcas,lfps --budget 256 --json {T}/passkey_8k.json",
        f"{L} --dump-trace {T}/kjv4k.safetensors --text data/kjv.txt --offset-lines 1000 --context 4096 "
        f"--trace-layers all --trace-steps 1 --policy dense --backend host",
        *[f"{BENCH} --trace {T}/kjv4k.safetensors --policy {p} --budget {b} --steps 64 --sink 4 --window 64 "
          f"--kv-dtype f16 --backend host --json {T}/replay_{p}_{b}.jsonl"
          for p in ("streaming", "oracle", "quest", "sparcas", "hip", "lfps", "kvpop") for b in (256, 512)],
        f"{PY} scripts/quality_smollm2.py --ppl {T}/ppl*.json --passkey {T}/passkey*.json "
        f"--replay {T}/replay_*.jsonl --out {T}/quality.json",
    ]
    return cmds


def quality_merge(T):
    d = json.load(open(f"{T}/quality.json"))
    d["regenerate"] = "python3 bench/reproduce.py quality_smollm2"
    return d


def simple(target, args, gpu, what, out_name=None, examples=False):
    """A benchmark binary that writes the JSON itself: {B}/bench/target args OUT."""
    def cmds(T):
        return [f"{B}/bench/{target} {args.format(T=T, OUT=f'{T}/out.json')}".strip()]

    def merge(T):
        return json.load(open(f"{T}/out.json"))
    return dict(gpu=gpu, targets=[target], what=what, run=cmds, merge=merge, examples=examples)


def bank_cmds(T):
    return [f"{B}/bench/bank_bench --churn {c} {T}/bank_{c}.json" for c in (0.05, 0.02, 0.01)]


def bank_merge(T):
    d = None
    for c in (0.05, 0.02, 0.01):
        x = json.load(open(f"{T}/bank_{c}.json"))
        for r in x["runs"]:
            r["churn"] = c
        if d is None:
            d = x
        else:
            d["runs"] += x["runs"]
    d["churn"] = [0.05, 0.02, 0.01]
    return d


def torch_sdpa_cmds(T):
    return [f"{B}/bench/gpu_attention_bench {T}/gpu_attention.json",
            f"{PY} scripts/device/torch_sdpa.py {T}/out.json --ours {T}/gpu_attention.json"]


def prefill_host_cmds(T):
    return [f"bash scripts/prefill-host-bench.sh --out {T}/out.json"]


def soak_cmds(T):
    return [f"{B}/tests/kvferry_soak --steps 1000000 --out {T}/out.json"]


def trace_cmds(T):
    return [f"{E2E} --unique-kv --gpu-gib 8 --contexts 32768 --batches 4 --steps 8 --modes kvpop --route auto "
            f"--trace {T}/trace --json {T}/rows.jsonl",
            f"cp \"$(ls {T}/trace*.json | head -1)\" {T}/out.json"]


def load_out(T):
    return json.load(open(f"{T}/out.json"))


SPECS = {
    "e2e": dict(gpu=True, targets=["kvferry-e2e"], run=e2e_cmds, merge=e2e_merge,
                what="the Runtime end to end per token step (32 layers, Llama-3.1-8B shape) vs torch SDPA, "
                     "every policy, repeated and moving query, chunked prefill"),
    "scale": dict(gpu=True, targets=["kvferry-e2e"], run=scale_cmds, merge=scale_merge,
                  what="(context, batch) points under an 8 GiB GPU cap with full-streaming, dense-CPU and "
                       "uncapped-SDPA baselines; the scheduler's routes"),
    "split": dict(gpu=True, targets=["kvferry-e2e"], run=split_cmds, merge=split_merge,
                  what="the scheduler's GPU/CPU split vs the single routes at 128K"),
    "quality_smollm2": dict(gpu=False, targets=["kvferry-bench"], examples=True, run=quality_cmds,
                            merge=quality_merge,
                            what="perplexity gap, passkey and attention-mass recall of every policy on SmolLM2-135M"),
    "bank": dict(gpu=True, targets=["bank_bench"], run=bank_cmds, merge=bank_merge,
                 what="the device token bank's decode speed vs all KV on the GPU at three hit rates"),
    "gpu_attention": simple("gpu_attention_bench", "{OUT}", True,
                            "dense and sparse decode kernels (HBM GB/s) and the PCIe transfer probe"),
    "torch_sdpa": dict(gpu=True, targets=["gpu_attention_bench"], run=torch_sdpa_cmds, merge=load_out,
                       what="kvferry's dense decode kernel vs torch SDPA, same run"),
    "transfer_span": simple("span_bench", "{OUT}", True,
                            "zero-copy gather rate vs the span of host memory the rows lie in"),
    "select_topk": simple("select_topk_bench", "{OUT}", True, "the device selection's multi-CTA top-k"),
    "cpu_attention": simple("cpu_attention_bench", "{OUT}", False,
                            "CPU sparse / dense attention throughput vs threads"),
    "lfps": simple("lfps_bench", "{OUT}", False, "LFPS vs exact top-k on the synthetic workload, one core"),
    "lfps_select_speed": simple("lfps_select_bench", "--json {OUT}", False,
                                "LFPS Select time per head vs exact top-k, one thread"),
    "prefill_host": dict(gpu=False, targets=[], run=prefill_host_cmds, merge=load_out,
                         out=lambda: f"prefill_host_{os.cpu_count()}core",
                         what="dense prefill on the host backend before/after (writes prefill_host_<cores>core.json)"),
    "soak": dict(gpu=False, targets=["kvferry_soak"], run=soak_cmds, merge=load_out,
                 what="1M decode steps of the host backend: RSS, store and device bytes stay flat"),
    "trace_step_split_kvpop": dict(gpu=True, targets=["kvferry-e2e"], run=trace_cmds, merge=load_out,
                                   what="a Chrome trace of kvpop's split step at 32K x 4 (Runtime::StartTrace)"),
}
# Files whose rows came from studies on SmolLM2 traces; their commands are recorded inside the
# file ("commands" / "command"), run by hand: not regenerated by this script.
RECORDED = ["lfps_quality_smollm2", "lfps_recall_smollm2", "lfps_step_profile", "prhs_etf_smollm2",
            "prhs_lfps_quality_smollm2", "prhs_rho_smollm2", "kvpop_mass_smollm2", "kvpop_train_smollm2",
            "llama_smollm2_kjv_passkey", "bank_hit_smollm2_kjv4k"]


# ------------------------------------------------------------------------------------- provenance
def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, cwd=ROOT).stdout.strip()
    except OSError:
        return ""


def provenance(commands):
    commit = sh("git rev-parse --short=10 HEAD") or "unknown"
    if sh("git status --porcelain --untracked-files=no"):
        commit += "+dirty"
    gpu = sh("nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1")
    name, _, driver = gpu.partition(",")
    model, cores = "unknown", os.cpu_count()
    try:
        model = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "gpu": name.strip() or "none", "driver": driver.strip() or "n/a", "cpu": f"{model}, {cores} cores",
            "command": " && ".join(commands)}


def stamp(d, p):
    """Provenance on the file and on every row of its row lists."""
    if isinstance(d, dict):
        for key in ("rows", "runs", "dense", "sparse", "sparse_pool", "dense_decode", "llama_prefill"):
            for r in d.get(key, []) if isinstance(d.get(key), list) else []:
                if isinstance(r, dict):
                    r["provenance"] = p
        if "traceEvents" in d:
            d.setdefault("otherData", {})["provenance"] = p
        else:
            d = {"provenance": p, **{k: v for k, v in d.items() if k != "provenance"}}
    return d


def build(spec):
    targets = spec["targets"]
    if not targets and not spec.get("examples"):
        return []
    archs = os.environ.get("KVFERRY_CUDA_ARCHS", "90")
    cfg = (f"cmake -S . -B {B} -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVFERRY_CUDA_ARCHS={archs} "
           f"-DKVFERRY_BUILD_EXAMPLES={'ON' if spec.get('examples') else 'OFF'}")
    tg = " ".join(targets + (["kvferry-llama"] if spec.get("examples") else []))
    return [cfg, f"cmake --build {B} -j{os.environ.get('JOBS', os.cpu_count())} --target {tg}"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", nargs="?")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--no-build", action="store_true", help="use the binaries already in $B")
    a = ap.parse_args()
    if a.list or not a.name:
        for n, s in SPECS.items():
            print(f"{n:24s} {'GPU' if s['gpu'] else 'CPU':4s} {s['what']}")
        for n in RECORDED:
            print(f"{n:24s} --   recorded study: its commands are in the file (not run by this script)")
        return 0
    if a.name in RECORDED:
        print(f"reproduce: {a.name} is a recorded study; the commands that made it are in "
              f"bench/results/{a.name}.json ('commands' / 'command'); docs/benchmarks.md")
        return 2
    if a.name not in SPECS:
        print(f"reproduce: unknown name {a.name}; --list shows them")
        return 2
    spec = SPECS[a.name]
    T = os.environ.get("T", f"/tmp/kvferry-reproduce/{a.name}")
    cmds = ([] if a.no_build else build(spec)) + spec["run"](T)
    if a.dry_run:
        print("\n".join(cmds))
        return 0
    if spec["gpu"] and not shutil.which("nvidia-smi"):
        print(f"reproduce: {a.name} needs an NVIDIA GPU (nvidia-smi not found); nothing run")
        return 3
    os.makedirs(T, exist_ok=True)
    for c in cmds:
        print("+", c, flush=True)
        rc = subprocess.run(["bash", "-c", c], cwd=ROOT).returncode
        if rc:
            print(f"reproduce: command failed (rc {rc}): {c}")
            return rc
    out_name = spec["out"]() if "out" in spec else a.name
    d = stamp(spec["merge"](T), provenance(spec["run"](T)))
    path = os.path.join(RES, out_name + ".json")
    with open(path, "w") as f:
        json.dump(d, f, indent=1)
        f.write("\n")
    print(f"reproduce: wrote {os.path.relpath(path, ROOT)}; python3 scripts/docs_tables.py refreshes the docs, "
          f"python3 bench/plot.py the plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
