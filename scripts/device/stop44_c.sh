#!/usr/bin/env bash
# Stop 44, call C: the host timeline (Chrome trace JSON) of one eager token step whose layers the
# scheduler splits: kvpop, no bank, 32K x 4 under the 8 GiB cap, keys unique, 2%, route auto (the
# share following the steps). Its cpu_split spans (the CPU's share of each layer, on the runtime's
# thread) start as the caller's launch of the layer's device share ends; the caller's next Decode
# starts when the last cpu_split ends (one part in flight). The kernels are not in a host timeline.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry-e2e
rm -f $D/rows.jsonl
kvf_e2e split_trace -- --modes kvpop --contexts 32768 --batches 4 --unique-kv --steps 8 \
  --gpu-gib 8 --host-gib 110 --route auto --trace $D/trace_split
ls -la $D/trace_split*
python3 - $D/trace_split_kvpop_32768_b4.json <<'PY'
import collections, json, sys
ev = json.load(open(sys.argv[1]))
ev = ev["traceEvents"] if isinstance(ev, dict) else ev
spans = [e for e in ev if e.get("ph") == "X"]
print(len(spans), collections.Counter((e["cat"], e["name"]) for e in spans).most_common())
t0 = min(e["ts"] for e in spans); t1 = max(e["ts"] + e["dur"] for e in spans)
print("step span %.3f ms" % ((t1 - t0) / 1e3))
for tid in sorted({e["tid"] for e in spans}):
    s = [e for e in spans if e["tid"] == tid]
    print("tid", tid, "spans", len(s), "busy %.3f ms" % (sum(e["dur"] for e in s) / 1e3),
          "first %.3f last end %.3f" % ((min(e["ts"] for e in s) - t0) / 1e3,
                                        (max(e["ts"] + e["dur"] for e in s) - t0) / 1e3))
PY
