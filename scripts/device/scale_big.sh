#!/usr/bin/env bash
# The scale points past 128 GiB of host KV, for a machine that has the memory (the one-GPU kind
# has 128 GiB). KV bytes of the Llama-3.1-8B attention
# shape (32 layers, 8 KV heads, d128, bf16): 128 KiB a token, so
#   POINT=128k16: 256 GiB of host KV (the nvidia-h200-x4 kind, 512 GiB, is enough; one GPU used)
#   POINT=512k4:  256 GiB (the same)
#   POINT=512k16: 1 TiB
#   POINT=128k6:  96 GiB (the largest batch at 128K that the one-GPU kind's 125 GiB holds)
#   POINT=32k4:   16 GiB (a smoke check of this script on any machine)
# PART picks what one call (10 minutes at most) runs, a comma list of (the fills alone take about
# 0.5 s a GiB):
#   PART=bank:   kvpop_bank, xl+kvpop_bank (the best GPU policy, with PrHS's selectors: psaw+ in
#                MODES=psaw+kvpop_bank), the 8 GiB cap, eager and graph steps
#   PART=routes: kvpop without a bank on route gpu, auto (the scheduler's split) and every miss on
#                the CPU (--split-share 1)
#   PART=base:   full_streaming (every row over PCIe) and dense_cpu (every row on the CPU cores),
#                2 steps each
# Every part then times torch SDPA with the KV on the GPU (as many distinct layers as fit in
# 70 GiB, scripts/device/e2e_sdpa.py) in the same call, and leaves $D/e2e_big_<POINT>_<PART>.json.
# HOST_GIB: the host memory kvferry-e2e may take (default: MemTotal less 24 GiB).
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
P=${POINT:-128k16}
PART=${PART:-bank}
case $P in
  128k16) C=131072; N=16 ;;
  512k4) C=524288; N=4 ;;
  512k16) C=524288; N=16 ;;
  128k6) C=131072; N=6 ;;
  32k4) C=32768; N=4 ;;
  *) echo "POINT $P: one of 128k16 512k4 512k16 128k6 32k4"; exit 2 ;;
esac
mem_gib=$(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo)
H=${HOST_GIB:-$(( mem_gib - 24 ))}
need=$(( C * N * 128 / 1048576 ))  # GiB of host KV
echo "point $P: $need GiB of host KV, host $mem_gib GiB, kvferry-e2e may take $H GiB"
if [ $(( need * 105 / 100 )) -gt "$H" ]; then
  echo "this machine cannot hold $P's KV ($need GiB plus 5% against $H GiB); nothing run"; exit 3
fi
kvf_build kvferry-e2e
rm -f $D/rows.jsonl
export KVF_TIMEOUT=${KVF_TIMEOUT:-280}
U="--unique-kv --gpu-gib 8 --host-gib $H --contexts $C --batches $N"
for part in ${PART//,/ }; do
  case $part in
    bank)
      for m in ${MODES:-kvpop_bank xl+kvpop_bank}; do
        kvf_e2e ${P}_$m -- --modes $m --steps 8 $U
      done ;;
    routes) kvf_route_rows "$P" kvpop --steps 8 $U ;;
    base)
      for m in full_streaming dense_cpu; do
        kvf_e2e ${P}_$m -- --modes $m --steps 2 $U
      done ;;
    *) echo "PART $part: bank, routes or base"; exit 2 ;;
  esac
done
kvf_rows
timeout 150 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_big_${P}_${PART//,/_}.json > $D/sdpa.log 2>&1
echo "sdpa rc=$?"; tail -6 $D/sdpa.log
