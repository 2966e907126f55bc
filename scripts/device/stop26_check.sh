#!/usr/bin/env bash
# For the next session's first GPU calls (written in stop 25, whose device time ran out):
#  PART=tests: the whole suite in two shards on stop 25's final code (the aligned HiP nodes ran
#    only the hip subset, 52 tests, plus the sanitizers over the hip tests);
#  PART=flat: issue 13's flat-step check for hip (its step reads a fixed number of keys between
#    rebuilds): hip_bank at 128K and 512K b1, keys unique, 16 steps; SDPA at 128K beside.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
if [ "${PART:-tests}" = tests ]; then
  kvf_build kvferry_tests
  T=$B/tests/kvferry_tests
  for i in 0 1; do
    GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout 330 $T --gtest_brief=1 > $D/shard$i.log 2>&1 &
  done
  wait
  for f in shard0 shard1; do
    echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/$f.log | head -12
  done
else
  kvf_build kvferry-e2e
  rm -f $D/rows.jsonl
  kvf_e2e flat -- --modes hip_bank --contexts 131072,524288 --batches 1 --steps 16 --unique-kv --host-gib 110
  python3 -c "
import json, sys
with open(sys.argv[2], 'w') as f:
    for l in open(sys.argv[1]):
        if json.loads(l)['context'] <= 131072: f.write(l)" $D/rows.jsonl $D/rows128.jsonl
  timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows128.jsonl $D/e2e_flat.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
  tail -3 $D/sdpa.log
fi
