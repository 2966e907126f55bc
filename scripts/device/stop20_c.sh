#!/usr/bin/env bash
# Stop 20, call C: ncu's full set (stall reasons, occupancy, memory) on one steady-state layer of
# sparcas_bank at 128K (the list step with the bank, SparCas's scoring and the multi-CTA top-k)
# and of quest_bank (its one-CTA top-k and page scoring).
set -u
source scripts/device/build.sh
kvf_build kvferry-e2e
E=$B/bench/kvferry-e2e
NCU=/usr/local/cuda/bin/ncu
timeout 280 $NCU --clock-control none --set full -k regex:"StepAttn|MctaStats|MctaWeights|MctaWrite|MctaRadix|MctaCount|SparcasScoreThread|AdmitKernel" \
  --launch-skip 1500 --launch-count 11 --log-file $D/full_sparcas.txt \
  $E --modes sparcas_bank --contexts 131072 --batches 1 --steps 1 --json $D/s.jsonl > $D/s.log 2>&1
echo "sparcas rc=$? $(grep -c '^  [a-zA-Z].*(.*)x(.*)' $D/full_sparcas.txt)"
timeout 200 $NCU --clock-control none --set full -k regex:"QuestTopK|QuestScore" \
  --launch-skip 300 --launch-count 2 --log-file $D/full_quest.txt \
  $E --modes quest_bank --contexts 131072 --batches 1 --steps 1 --json $D/q.jsonl > $D/q.log 2>&1
echo "quest rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
