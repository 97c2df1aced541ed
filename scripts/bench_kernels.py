#!/usr/bin/env python3
"""H200 benchmark of the Pallas kernels (pallas_kernels/tree_attention.py, pallas_kernels/moe_int4.py).

One run: measures the HBM read roof (a 4.3 GB bf16 reduction) and the bf16 matmul rate, sweeps a few
kernel configurations on two cases per kernel and keeps the fastest correct one, then checks each kernel
against its XLA reference on the GPU (bf16 tolerance) and times kernel and reference at full Kimi width:
  MoE  D=7168, F=2048, E=384, top-8, INT4 (group-32 bf16 scales), T in {1, 9, 17, 33, 65, 129}, uniform
       random routing (R routings rotated so repeated calls do not hit the same experts in L2);
       also the bf16-weight variant.
  MLA  H=64, C=576, K=512, (B, L, T) in {(1,4k,9), (1,32k,9), (1,32k,33), (1,128k,17), (32,4k,9),
       (128,2k,9)}, committed length L - T (the whole cache is read), random tree masks; R cache copies
       rotated (>= ~240 MB per timed call group) so the cache is not served from L2.
Timing: jit of R calls on R different inputs, wall clock around jax.block_until_ready, median of reps,
divided by R.  Floors: HBM floor = bytes / measured read roof (MoE: distinct experts x bytes per expert;
MLA: the B*L*576*2 cache bytes); compute floor (MLA) = 2*B*T*H*L*(576+512) / measured matmul rate.
Writes $OUT/bench_kernels.json (updated after every case) and prints a table last.

  python scripts/bench_kernels.py [--budget SECONDS] [--no-sweep]
  python scripts/bench_kernels.py --moe-ab default,mgpu_words_d2 --moe-tokens 1,9,17,33,65,129
  python scripts/bench_kernels.py --attn-ab default,xla,m32w8,m16 --attn-heads 8    # TP-8's heads per device
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import moe_int4 as mi  # noqa: E402
from pallas_kernels import moe_int4_mgpu as mg  # noqa: E402
from pallas_kernels import tree_attention as ta  # noqa: E402
from timing import time_jit_sets  # noqa: E402

T0 = time.time()
SMALL = os.environ.get("BENCH_SMALL") == "1"  # CPU dry run of this script: tiny shapes, interpret mode
INTERPRET = jax.default_backend() != "gpu"
OUT = os.environ.get("OUT") or "/tmp/bench_kernels_out"
os.makedirs(OUT, exist_ok=True)
RES: dict = {"cases": {}, "sweeps": {}, "errors": []}


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def save():
    with open(os.path.join(OUT, "bench_kernels.json"), "w") as f:
        json.dump(RES, f, indent=1, default=float)


def elapsed():
    return time.time() - T0


def rel_err(a, b):
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    return float(np.linalg.norm((a - b).ravel()) / max(np.linalg.norm(b.ravel()), 1e-30))


def time_calls(fn, arg_sets, reps, rec=None, prefix="kernel"):
    """fn(*args) for each args in arg_sets inside one jit; -> (seconds per call (median), compile s).

    With `rec` (GPU): also the device time per call from the profiler (3 more runs), into rec[prefix + "_dev_us"]
    and the per-kernel split rec[prefix + "_kernels_us"]: wall time per call includes the host's dispatch of
    each launch, which exceeds the kernels' own time at small sizes (measured 2026-12-03 night: ~110 us of
    the 215 us wall time of the MoE at T=1 was not kernel time)."""
    t = time_jit_sets(fn, arg_sets, reps, profile_runs=3 if rec is not None and not INTERPRET else 0)
    if "kernel_us" in t:
        rec[prefix + "_dev_us"] = t["kernel_us"]
        rec[prefix + "_kernels_us"] = t["kernels_us"]
    return t["wall_s"], t["compile_s"]


# ------------------------------------------------------------------------------------------------
# roofs
# ------------------------------------------------------------------------------------------------


def measure_roofs():
    n = 2 ** 31 if not SMALL else 2 ** 22
    x = jax.random.normal(jax.random.key(1), (n // 8192, 8192), jnp.bfloat16)
    red = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    cp = jax.jit(lambda x: x * 2)
    jax.block_until_ready((red(x), cp(x)))
    t_red = statistics.median([_t(red, x) for _ in range(10)])
    t_cp = statistics.median([_t(cp, x) for _ in range(5)])
    del x
    nm = 8192 if not SMALL else 512
    a = jax.random.normal(jax.random.key(2), (nm, nm), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(3), (nm, nm), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    jax.block_until_ready(mm(a, b))
    t_mm = statistics.median([_t(mm, a, b) for _ in range(10)])
    roof = 2 * n / t_red
    RES["roof"] = {"read_TBps": roof / 1e12, "copy_TBps_rw": 4 * n / t_cp / 1e12,
                   "bf16_matmul_TFLOPs": 2 * nm ** 3 / t_mm / 1e12,
                   "how": "sum of a 4.29 GB bf16 array (f32 accumulate); x*2 copy of it; 8192^3 bf16 matmul"}
    log(f"roof: read {roof / 1e12:.3f} TB/s, copy {4 * n / t_cp / 1e12:.3f} TB/s (r+w), "
        f"matmul {2 * nm ** 3 / t_mm / 1e12:.0f} TFLOP/s")
    save()
    return roof, 2 * nm ** 3 / t_mm


def _t(f, *a):
    t = time.perf_counter()
    jax.block_until_ready(f(*a))
    return time.perf_counter() - t


# ------------------------------------------------------------------------------------------------
# MoE
# ------------------------------------------------------------------------------------------------

E, F, D, TOPK = (384, 2048, 7168, 8) if not SMALL else (24, 256, 512, 4)
BYTES_INT4 = 3 * F * D // 2 + 3 * F * (D // 32) * 2  # packed + scales per expert
BYTES_BF16 = 3 * F * D * 2


MOE_REF = jax.jit(mi.moe_ref)


def make_int4_experts():
    ks = jax.random.split(jax.random.key(10), 6)
    bits = lambda k, shape: jax.lax.bitcast_convert_type(jax.random.bits(k, shape, jnp.uint32), jnp.int32)
    scl = lambda k, shape: jax.random.uniform(k, shape, jnp.float32, 0.004, 0.02).astype(jnp.bfloat16)
    ckpt = {"gate_packed": bits(ks[0], (E, F, D // 8)), "gate_scale": scl(ks[1], (E, F, D // 32)),
            "up_packed": bits(ks[2], (E, F, D // 8)), "up_scale": scl(ks[3], (E, F, D // 32)),
            "down_packed": bits(ks[4], (E, D, F // 8)), "down_scale": scl(ks[5], (E, D, F // 32))}
    jax.block_until_ready(ckpt)
    t = time.perf_counter()
    kern = jax.block_until_ready(jax.jit(mi.relayout_for_kernel)(ckpt))
    log(f"INT4 experts ready; relayout_for_kernel of one layer took {time.perf_counter() - t:.2f} s")
    return ckpt, kern


def make_bf16_experts():
    ks = jax.random.split(jax.random.key(11), 3)
    def nrm(k, shape, fan):
        return (jax.random.normal(k, shape, jnp.bfloat16) * (1.0 / math.sqrt(fan))).astype(jnp.bfloat16)

    ex = {"gate": nrm(ks[0], (E, F, D), D), "up": nrm(ks[1], (E, F, D), D), "down": nrm(ks[2], (E, D, F), F)}
    return jax.block_until_ready(ex)


def routings(T, R, seed, pool=None):
    """R routings, uniform over all E experts, or over a random `pool` of them (a tree's tokens share experts)."""
    out = []
    for r in range(R):
        k1, k2, k3 = jax.random.split(jax.random.key(seed * 1000 + r), 3)
        n = pool or E
        _, ids = jax.lax.top_k(jax.random.uniform(k1, (T, n)), TOPK)  # uniform, distinct per token
        if pool:
            ids = jax.random.permutation(k3, E)[:pool][ids]
        w = jax.random.uniform(k2, (T, TOPK), jnp.float32, 0.05, 0.5)
        out.append((ids.astype(jnp.int32), w))
    return out


def moe_inputs(T, R, seed, pool=None):
    x = jax.random.normal(jax.random.key(seed), (T, D), jnp.bfloat16)
    return [(x, ids, w) for ids, w in routings(T, R, seed, pool)]


MOE_CONFIGS = {  # left-out options = the kernel's defaults (blocks 64 / 128, 1 superblock per iteration, 3 stages)
    "default": dict(),
    "steps2": dict(steps=2),  # 2 superblocks per loop iteration
    "stages4": dict(num_stages=4),
}
# `--moe-ab` only (measured and refuted 2026-12-04, BENCHMARKS.md "INT4 MoE: variants tried"): not swept by default
MOE_AB_CONFIGS = dict(MOE_CONFIGS,
                      stages5=dict(num_stages=5),  # deeper pipelines: more bytes in flight when few programs run
                      stages6=dict(num_stages=6),
                      blocks32_s5=dict(block_f=32, block_d=64, num_stages=5),
                      # Mosaic GPU kernels (pallas_kernels/moe_int4_mgpu.py, T <= 256): TMA pipeline + wgmma
                      mgpu=dict(backend="mgpu"),  # 8 groups of 32 inputs per step, 3 steps in flight
                      mgpu_nowait=dict(backend="mgpu", wait_each_group=False),
                      mgpu_g4s4=dict(backend="mgpu", groups_per_step=4, stages=4),
                      mgpu_g16s2=dict(backend="mgpu", groups_per_step=16, stages=2),
                      mgpu_g8s5=dict(backend="mgpu", stages=5),
                      mgpu_d2=dict(backend="mgpu", down_tiles=2),
                      mgpu_vec=dict(backend="mgpu", vector_loads=True),
                      # the thread-words layout: one 8-byte load per tile and thread, dequant in inline PTX
                      mgpu_words=dict(backend="mgpu", words=True),
                      mgpu_words_d2=dict(backend="mgpu", words=True, down_tiles=2))
MGPU_LAYOUT = {}  # the experts in the Mosaic GPU layouts (int4 tiles, thread words; 8.5 GB each at full width)
# Measured out earlier (BENCHMARKS.md, 2026-12-03 runs 1-3; since removed from the kernel): transposed bf16
# scales (unpipelined 16-bit loads), scales applied to each plane's f32 dot, untiled words, 128-row blocks.


def moe_case(name, T, experts, bytes_per_expert, roof, cfg, *, ref_experts=None, R=4, reps=10,
             time_ref=True, check=True, seed=0, pool=None):
    rec = {"T": T, "cfg": cfg, "pool": pool}
    sets = moe_inputs(T, R, seed + T, pool)
    distinct = [len(np.unique(np.asarray(s[1]))) for s in sets]
    rec["distinct_experts"] = float(np.mean(distinct))
    rec["bytes"] = rec["distinct_experts"] * bytes_per_expert
    rec["floor_us"] = rec["bytes"] / roof * 1e6
    if cfg.get("backend") == "mgpu":
        words = bool(cfg.get("words"))
        if words not in MGPU_LAYOUT:
            MGPU_LAYOUT[words] = jax.block_until_ready(
                jax.jit(functools.partial(mg.to_mgpu_layout, words=words))(ref_experts))
        experts = MGPU_LAYOUT[words]
        mcfg = mg.Config(**{k: v for k, v in cfg.items() if k not in ("backend", "words")})
        kern = functools.partial(mg.moe_mgpu, cfg=mcfg, interpret=INTERPRET)
    else:
        kern = functools.partial(mi.moe_pallas, interpret=INTERPRET, **cfg)
    if check:
        x, ids, w = sets[0]
        y = jax.jit(kern)(x, ids, w, experts)
        y_ref = MOE_REF(x, ids, w, ref_experts if ref_experts is not None else experts)
        rec["rel_err"] = rel_err(y, y_ref)
        rec["finite"] = bool(np.all(np.isfinite(np.asarray(y, np.float32))))
        rec["ok"] = rec["finite"] and rec["rel_err"] < 2e-2
    t, tc = time_calls(kern, [(*st, experts) for st in sets], reps, rec)
    rec["kernel_us"], rec["kernel_compile_s"] = t * 1e6, tc
    rec["pct_of_floor"] = 100 * rec["floor_us"] / rec["kernel_us"]
    if "kernel_dev_us" in rec:
        rec["pct_of_floor_dev"] = 100 * rec["floor_us"] / rec["kernel_dev_us"]
    if time_ref:
        rex = ref_experts if ref_experts is not None else experts
        tr, trc = time_calls(mi.moe_ref, [(*sets[0], rex)], 3, rec, "xla")
        rec["xla_us"], rec["xla_compile_s"] = tr * 1e6, trc
    log(f"{name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()
                                if k != "cfg"))
    return rec


# ------------------------------------------------------------------------------------------------
# attention
# ------------------------------------------------------------------------------------------------

H, C, KR = (64, 576, 512) if not SMALL else (4, 80, 64)
SCALE = 1.0 / math.sqrt(192)
ATT_CASES = [(1, 4096, 9), (1, 32768, 9), (1, 32768, 33), (1, 131072, 17), (32, 4096, 9), (128, 2048, 9)]
if SMALL:
    ATT_CASES = [(1, 300, 9), (3, 200, 5)]
ATT_CONFIGS = {  # the kernel's defaults; earlier sweeps (BENCHMARKS.md) measured transposed / value-split variants
    "m64k32w8s2": dict(transposed=False, block_m=64, block_k=32, num_warps=8, num_stages=2),
}


# --attn-ab: kernel configurations (and "xla", the reference) against each other at --attn-cases, with --attn-heads
# query heads per device: 64 on one GPU or under expert parallelism, 8 under tensor parallelism over 8 GPUs, where
# T=9 gives 72 query rows per request, ~136 FLOP per cache byte, below the ridge (memory-bound; 64 heads: ~1088).
# Offline (scripts/triton_sass.py mla --heads 8, sm_90): the default 64-row blocks spill (255 registers + 424 B of
# stack) and pad 72 rows to 128; 32-row blocks at 8 warps need 177 registers, 16-row blocks 128 (both mma.sync).
ATT_AB_CONFIGS = {"default": dict(), "xla": "xla",
                  "m32w8": dict(block_m=32, num_warps=8), "m32w4": dict(block_m=32, num_warps=4),
                  "m16": dict(block_m=16), "m16k64": dict(block_m=16, block_k=64),
                  "m16_split64": dict(block_m=16, min_split=64), "vs2": dict(value_splits=2),
                  # the splits merged by one kernel instead of XLA's three launches (combine_splits_pallas)
                  "default_cmb": dict(combine="pallas"), "m32w8_cmb": dict(block_m=32, num_warps=8, combine="pallas")}
ATT_AB_CASES = ("1:4096:9,1:32768:9,1:32768:33,1:131072:17,32:4096:9,128:2048:9,1:4096:1,32:4096:1" if not SMALL
                else "1:300:9,2:200:5")


def attn_ab(roof, peak, names, cases, heads):
    """Attention configurations against each other, interleaved per shape (same inputs, same run)."""
    ab = RES.setdefault("attn_ab", {})
    for (B, L, T) in cases:
        for n in names:
            guarded(f"{n}|H{heads}_B{B}_L{L}_T{T}", lambda: att_case(
                f"attn {n} H={heads} B={B} L={L} T={T}", B, L, T, roof, peak, ATT_AB_CONFIGS[n], reps=5,
                time_ref=False, heads=heads), ab)
    RES["total_s"] = elapsed()
    save()
    print(f"\nMLA tree attention A/B, H={heads} heads per device, read roof {roof / 1e12:.2f} TB/s, matmul "
          f"{peak / 1e12:.0f} TFLOP/s: kernel time per call (profiler), % of the HBM floor; compute floor")
    print("| B | L | T | HBM floor us | compute floor us | " + " | ".join(names) + " |")
    print("|---|---|---|---|---|" + "---|" * len(names))
    for (B, L, T) in cases:
        recs = [ab.get(f"{n}|H{heads}_B{B}_L{L}_T{T}", {}) for n in names]
        cells = [(f"{r['kernel_dev_us']:.1f} us ({r['pct_of_floor_dev']:.1f} %)"
                  + ("" if r.get("ok", True) else " WRONG")) if "kernel_dev_us" in r
                 else (f"{r['kernel_us']:.1f} us wall" if "kernel_us" in r else "error") for r in recs]
        r0 = next((r for r in recs if "floor_us" in r), {})
        print(f"| {B} | {L} | {T} | {r0.get('floor_us', float('nan')):.1f} | "
              f"{r0.get('compute_floor_us', float('nan')):.1f} | " + " | ".join(cells) + " |")


# --attn-crossover: kernel variants vs the XLA reference over decode/verify shapes (B, L, T), to choose per shape
CROSS_CASES = [(1, 4096, 1), (1, 4096, 9), (1, 32768, 9), (8, 4096, 9), (32, 4096, 9), (128, 2048, 9),
               (1, 32768, 1), (1, 4096, 17), (32, 4096, 1), (128, 4096, 1)]  # Engine-like shapes first
CROSS_CONFIGS = {"default": dict(), "split128": dict(min_split=128), "vs2_split128": dict(value_splits=2, min_split=128)}
if SMALL:
    CROSS_CASES = [(1, 300, 1), (2, 200, 5)]


def attn_crossover(roof, peak, budget):
    out = RES.setdefault("attn_crossover", {})
    for (B, L, T) in CROSS_CASES:
        for j, (cname, cfg) in enumerate(CROSS_CONFIGS.items()):
            if elapsed() > budget:
                log(f"attn crossover: time budget reached before B={B} L={L} T={T} {cname}")
                return
            guarded(f"B{B}_L{L}_T{T}|{cname}", lambda: att_case(f"cross {cname} B={B} L={L} T={T}", B, L, T, roof,
                                                                peak, cfg, reps=5, time_ref=(j == 0),
                                                                check=(j == 0 or "vs2" in cname)), out)


def random_trees(B, T, rng):
    out = np.zeros((B, T, T), bool)
    for b in range(B):
        anc = np.eye(T, dtype=bool)
        for i in range(1, T):
            anc[i] |= anc[rng.integers(0, i)]
        out[b] = anc
    return jnp.asarray(out)


def att_inputs(B, L, T, R, seed, heads=H):
    rng = np.random.default_rng(seed)
    q = jax.random.normal(jax.random.key(seed), (B, T, heads, C), jnp.bfloat16)
    lengths = jnp.full((B,), L - T, jnp.int32)
    tree = random_trees(B, T, rng)
    sets = []
    for r in range(R):
        cache = jax.random.normal(jax.random.key(seed * 100 + r + 1), (B, L, C), jnp.bfloat16)
        sets.append((q, cache, lengths, tree))
    return sets


def att_case(name, B, L, T, roof, peak, cfg, *, reps=10, time_ref=True, check=True, seed=0, heads=H):
    """One attention shape: the kernel with options `cfg` (cfg "xla": the XLA reference as the timed call)."""
    cache_bytes = B * L * C * 2
    R = int(min(16, max(2, math.ceil(240e6 / cache_bytes))))
    rec = {"B": B, "L": L, "T": T, "H": heads, "cfg": cfg, "R": R, "bytes": cache_bytes}
    rec["floor_us"] = cache_bytes / roof * 1e6
    flops = 2 * B * T * heads * L * (C + KR)
    rec["flops"] = flops
    rec["compute_floor_us"] = flops / peak * 1e6
    sets = att_inputs(B, L, T, R, seed + B + L + T, heads)
    if cfg == "xla":
        kern = functools.partial(ta.tree_attention_ref, scale=SCALE, kv_rank=KR)
        check = time_ref = False
    else:
        kern = functools.partial(ta.tree_attention_pallas, scale=SCALE, kv_rank=KR, interpret=INTERPRET, **cfg)
    if check:
        o, lse = jax.jit(kern)(*sets[0])
        o_r, lse_r = jax.jit(functools.partial(ta.tree_attention_ref, scale=SCALE, kv_rank=KR))(*sets[0])
        rec["rel_err"] = rel_err(o, o_r)
        rec["lse_max_abs_err"] = float(jnp.max(jnp.abs(lse - lse_r)))
        rec["finite"] = bool(np.all(np.isfinite(np.asarray(o, np.float32))))
        rec["ok"] = rec["finite"] and rec["rel_err"] < 2e-2 and rec["lse_max_abs_err"] < 5e-2
    t, tc = time_calls(kern, sets, reps, rec)
    rec["kernel_us"], rec["kernel_compile_s"] = t * 1e6, tc
    rec["pct_of_floor"] = 100 * rec["floor_us"] / rec["kernel_us"]
    if "kernel_dev_us" in rec:
        rec["pct_of_floor_dev"] = 100 * rec["floor_us"] / rec["kernel_dev_us"]
    rec["pct_of_compute_floor"] = 100 * rec["compute_floor_us"] / rec["kernel_us"]
    rec["kernel_TFLOPs"] = flops / t / 1e12
    if time_ref:
        ref = functools.partial(ta.tree_attention_ref, scale=SCALE, kv_rank=KR)
        tr, trc = time_calls(ref, sets[:2], 3, rec, "xla")
        rec["xla_us"], rec["xla_compile_s"] = tr * 1e6, trc
    log(f"{name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()
                                if k != "cfg"))
    return rec


# ------------------------------------------------------------------------------------------------


def guarded(key, fn, store):
    try:
        store[key] = fn()
    except Exception as e:  # keep going: one failing case must not cost the rest of the run
        msg = f"{key}: {type(e).__name__}: {str(e)[:1500]}"
        log("ERROR", msg)
        traceback.print_exc(limit=3)
        RES["errors"].append(msg)
        store[key] = {"error": msg[:400]}
    save()
    return store[key]


def best_config(sweep: dict) -> str | None:
    score = {}
    for key, rec in sweep.items():
        cfg = key.split("|")[0]
        if "error" in rec or not rec.get("ok", False):
            score[cfg] = math.inf
            continue
        score[cfg] = score.get(cfg, 0.0) + rec["kernel_us"] / rec["floor_us"]
    good = {k: v for k, v in score.items() if v < math.inf}
    return min(good, key=good.get) if good else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; later optional parts are skipped")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--only", choices=["moe", "attn", "attn-crossover"], default=None)
    ap.add_argument("--moe-ab", default=None, help="CONFIG,CONFIG,...: only time these MOE_AB_CONFIGS against each other "
                                                   "at --moe-tokens (kernel time), print a table, stop")
    ap.add_argument("--moe-tokens", default="1,9,17,33")
    ap.add_argument("--attn-ab", default=None, help="CONFIG,CONFIG,...: only time these ATT_AB_CONFIGS (\"xla\": the "
                                                    "reference) against each other at --attn-cases, print a table, stop")
    ap.add_argument("--attn-heads", type=int, default=H, help="query heads per device for --attn-ab (TP-8: 8)")
    ap.add_argument("--attn-cases", default=ATT_AB_CASES, help="B:L:T,... for --attn-ab")
    args = ap.parse_args()
    if args.attn_ab:
        unknown = sorted(set(args.attn_ab.split(",")) - set(ATT_AB_CONFIGS))
        if unknown:
            ap.error(f"--attn-ab: unknown configurations {unknown}; choose from {sorted(ATT_AB_CONFIGS)}")
    dev = jax.devices()[0]
    RES.update(date=time.strftime("%Y-%m-%d %H:%M:%S"), device=dev.device_kind, platform=dev.platform,
               jax=jax.__version__, argv=sys.argv)
    log(f"device {dev.device_kind}, jax {jax.__version__}")
    roof, peak = measure_roofs()
    if args.moe_ab:
        moe_ab(roof, args.moe_ab.split(","), [int(t) for t in args.moe_tokens.split(",")])
        return
    if args.attn_ab:
        cases = [tuple(int(v) for v in c.split(":")) for c in args.attn_cases.split(",")]
        attn_ab(roof, peak, args.attn_ab.split(","), cases, args.attn_heads)
        return
    if args.only == "attn-crossover":
        attn_crossover(roof, peak, args.budget)
        RES["total_s"] = elapsed()
        save()
        print_crossover()
        return

    if args.only in (None, "moe"):
        ckpt, kern = make_int4_experts()
        sweep = RES["sweeps"].setdefault("moe_int4", {})
        if not args.no_sweep:
            for cname, cfg in (MOE_CONFIGS.items() if not SMALL else list(MOE_CONFIGS.items())[:2]):
                for T in ((9, 65) if not SMALL else (3, 20)):
                    if elapsed() > 0.35 * args.budget:
                        break
                    guarded(f"{cname}|T{T}", lambda: moe_case(f"sweep moe {cname} T={T}", T, kern, BYTES_INT4,
                                                              roof, cfg, ref_experts=ckpt, time_ref=False),
                            sweep)
        best = best_config(sweep) or "default"
        RES["moe_best_config"] = best
        log(f"MoE config: {best}")
        cfg = MOE_CONFIGS[best]
        cases = RES["cases"].setdefault("moe_int4", {})
        for bf, bd in ((32, 64),):  # T = 1 with smaller blocks (more programs)
            if "block_f" not in cfg and elapsed() < 0.4 * args.budget:
                guarded(f"T1_blocks{bf}_{bd}", lambda: moe_case(f"moe int4 T=1 blocks {bf}/{bd}", 1, kern, BYTES_INT4,
                                                                roof, dict(cfg, block_f=bf, block_d=bd),
                                                                ref_experts=ckpt, time_ref=False),
                        RES["cases"].setdefault("moe_int4", {}))
        for T in ((1, 9, 17, 33, 65, 129) if not SMALL else (1, 17)):
            guarded(f"T{T}", lambda: moe_case(f"moe int4 T={T}", T, kern, BYTES_INT4, roof, cfg,
                                              ref_experts=ckpt, time_ref=elapsed() < 0.45 * args.budget), cases)
        if elapsed() < 0.5 * args.budget:  # a b8 tree's 9 tokens share experts (~25 in the Kimi slice run)
            guarded("T9_pool24", lambda: moe_case("moe int4 T=9 on a pool of 24 experts", 9, kern, BYTES_INT4, roof, cfg,
                                                  ref_experts=ckpt, time_ref=False, pool=24), cases)
        extra_moe = (kern, ckpt, cfg)
        del ckpt, kern

    if args.only in (None, "attn"):
        sweep = RES["sweeps"].setdefault("attention", {})
        if not args.no_sweep and len(ATT_CONFIGS) > 1:
            for cname, cfg in (ATT_CONFIGS.items() if not SMALL else list(ATT_CONFIGS.items())[:2]):
                for (B, L, T) in (((32, 4096, 9), (1, 32768, 9)) if not SMALL else ATT_CASES):
                    if elapsed() > 0.55 * args.budget:
                        break
                    guarded(f"{cname}|B{B}L{L}T{T}", lambda: att_case(f"sweep attn {cname} B={B} L={L} T={T}", B, L,
                                                                      T, roof, peak, cfg, time_ref=False), sweep)
        best = best_config(sweep) or "m64k32w8s2"
        RES["attn_best_config"] = best
        log(f"attention config: {best}")
        cfg = ATT_CONFIGS[best]
        cases = RES["cases"].setdefault("attention", {})
        for (B, L, T) in ATT_CASES:
            guarded(f"B{B}_L{L}_T{T}", lambda: att_case(f"attn B={B} L={L} T={T}", B, L, T, roof, peak, cfg,
                                                        time_ref=elapsed() < 0.75 * args.budget), cases)
    if args.only in (None, "moe"):
        kern, ckpt, cfg = extra_moe
        if elapsed() < 0.85 * args.budget:  # dense (T <= 16) vs sorted routing at T = 9
            guarded("T9_sorted_path", lambda: moe_case("moe int4 T=9 sorted path", 9, kern, BYTES_INT4, roof,
                                                       dict(cfg, dense_max_tokens=0), ref_experts=ckpt,
                                                       time_ref=False), RES["cases"]["moe_int4"])
        del ckpt, kern, extra_moe
        if elapsed() < 0.8 * args.budget:
            exb = make_bf16_experts()
            cases_b = RES["cases"].setdefault("moe_bf16", {})
            cfg_b = {}  # kernel defaults for bf16 weights (one 128-input slice per loop iteration)
            for T in ((1, 9, 33, 129) if not SMALL else (9,)):
                if elapsed() > 0.9 * args.budget:
                    break
                guarded(f"T{T}", lambda: moe_case(f"moe bf16 T={T}", T, exb, BYTES_BF16, roof, cfg_b,
                                                  time_ref=(T == 9), check=(T in (1, 33)), R=2), cases_b)
            del exb

    RES["total_s"] = elapsed()
    save()
    print_table(roof, peak)


def moe_ab(roof, names, tokens):
    """Kernel configurations against each other, interleaved per T (same inputs, same run)."""
    ckpt, kern = make_int4_experts()
    ab = RES.setdefault("moe_ab", {})
    for T in tokens:
        for n in names:
            guarded(f"{n}|T{T}", lambda: moe_case(f"moe int4 {n} T={T}", T, kern, BYTES_INT4, roof, MOE_AB_CONFIGS[n],
                                                  ref_experts=ckpt, time_ref=False), ab)
    RES["total_s"] = elapsed()
    save()
    print(f"\nINT4 MoE A/B, read roof {roof / 1e12:.2f} TB/s: kernel time per call (profiler), % of the HBM floor")
    print("| T | experts | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for T in tokens:
        recs = [ab.get(f"{n}|T{T}", {}) for n in names]
        cells = [f"{r['kernel_dev_us']:.1f} us ({r['pct_of_floor_dev']:.1f} %)" if "kernel_dev_us" in r
                 else (f"{r['kernel_us']:.1f} us wall" if "kernel_us" in r else "error") for r in recs]
        dist = next((r["distinct_experts"] for r in recs if "distinct_experts" in r), float("nan"))
        print(f"| {T} | {dist:.1f} | " + " | ".join(cells) + " |")


def print_crossover():
    rows = {}
    for key, r in RES.get("attn_crossover", {}).items():
        shape, cname = key.split("|")
        rows.setdefault(shape, {})[cname] = r
    lines = [f"{'B_L_T':18s} {'xla us':>8s} " + " ".join(f"{c:>13s}" for c in CROSS_CONFIGS) + "  (kernel us; ! = check failed)"]
    for shape, recs in rows.items():
        xla = next((r["xla_us"] for r in recs.values() if "xla_us" in r), float("nan"))
        cells = []
        for c in CROSS_CONFIGS:
            r = recs.get(c, {})
            cells.append(f"{'ERR' if 'error' in r else ('%.1f' % r['kernel_us']) if 'kernel_us' in r else '-':>12s}"
                         + ("!" if r.get("ok") is False else " "))
        lines.append(f"{shape:18s} {xla:8.1f} " + " ".join(cells))
    txt = "\n".join(lines)
    with open(os.path.join(OUT, "attn_crossover.txt"), "w") as f:
        f.write(txt + "\n")
    print(txt, flush=True)


def print_table(roof, peak):
    lines = [f"roof: read {roof / 1e12:.2f} TB/s (4.29 GB bf16 sum), bf16 matmul {peak / 1e12:.0f} TFLOP/s; "
             f"device {RES.get('device')}; MoE cfg {RES.get('moe_best_config')}, "
             f"attn cfg {RES.get('attn_best_config')}"]
    lines.append(f"{'case':34s} {'MB':>8s} {'floor us':>9s} {'kern us':>9s} {'% roof':>7s} {'TB/s':>5s} "
                 f"{'dev us':>8s} {'% roof':>7s} {'xla us':>9s} {'xla dev':>8s} {'err':>8s} extra  "
                 f"(kern/xla us: wall time per call; dev: the profiler's kernel time per call)")
    for kind, cases in RES["cases"].items():
        for key, r in cases.items():
            name = f"{kind} {key}"
            if "error" in r:
                lines.append(f"{name:34s} ERROR {r['error'][:80]}")
                continue
            xla = r.get("xla_us")
            extra = ""
            if "distinct_experts" in r:
                extra = f"distinct {r['distinct_experts']:.1f}"
            if "compute_floor_us" in r:
                extra = (f"compute floor {r['compute_floor_us']:.1f} us ({r['pct_of_compute_floor']:.0f} %), "
                         f"{r['kernel_TFLOPs']:.0f} TFLOP/s")
            lines.append(f"{name:34s} {r['bytes'] / 1e6:8.1f} {r['floor_us']:9.1f} {r['kernel_us']:9.1f} "
                         f"{r['pct_of_floor']:6.1f}% {r['bytes'] / r['kernel_us'] / 1e6:5.2f} "
                         f"{r.get('kernel_dev_us', float('nan')):8.1f} {r.get('pct_of_floor_dev', float('nan')):6.1f}% "
                         f"{xla if xla else float('nan'):9.1f} {r.get('xla_dev_us', float('nan')):8.1f} "
                         f"{r.get('rel_err', float('nan')):8.1e} "
                         f"{extra}")
    if RES["errors"]:
        lines.append(f"{len(RES['errors'])} errors (see json)")
    txt = "\n".join(lines)
    with open(os.path.join(OUT, "bench_kernels_table.txt"), "w") as f:
        f.write(txt + "\n")
    print(txt, flush=True)


if __name__ == "__main__":
    main()
