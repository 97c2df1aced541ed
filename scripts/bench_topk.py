#!/usr/bin/env python3
"""The DDTree per-depth top-K over the vocabulary (kimijax/spec/ddtree.py `topk_logprobs`): one lax.top_k over
each whole row vs `chunked_top_k` at several slice widths, on the GPU, at the round's shapes (B requests x L
draft depths x V vocabulary, K = the tree width). Checks every variant against lax.top_k (values and ids
exactly), then times R calls on R different inputs inside one jit: wall time per call and kernel time per call
from the profiler. No HBM roof: [L, V] f32 rows are at most a few MB (L2-resident), so these are latency-bound.

  python3 scripts/bench_topk.py [--shapes 1x7x163840,1x15x49152] [--k 8,16] [--chunks 0,1024,2048,4096]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kimijax.spec.ddtree import topk_logprobs  # noqa: E402
from timing import time_jit_sets  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x7x163840,1x15x163840,1x7x49152,1x15x49152,8x7x163840",
                    help="BxLxV: Kimi K2.6 (V 163840, block 8 -> 7 depths) and SmolLM2 (V 49152, block 16)")
    ap.add_argument("--k", default="8,16")
    ap.add_argument("--chunks", default="0,512,1024,2048,4096,8192", help="slice widths (0: one lax.top_k per row)")
    ap.add_argument("--sets", type=int, default=8, help="different inputs per timed jit")
    args = ap.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",")]
    print(f"device {jax.devices()[0].device_kind}; us per call: wall / kernels", flush=True)
    print("| B x L x V | K | " + " | ".join("lax.top_k" if c == 0 else f"chunk {c}" for c in chunks) + " |")
    print("|---|---|" + "---|" * len(chunks))
    for shp in args.shapes.split(","):
        B, L, V = (int(v) for v in shp.split("x"))
        keys = jax.random.split(jax.random.PRNGKey(B * 31 + L * 7 + V), args.sets)
        sets = [jax.random.normal(k, (B, L, V), jnp.float32) * 3 for k in keys]
        # ties across slice boundaries, to check the index order of equal values
        sets[0] = sets[0].at[..., :: max(V // 64, 1)].set(9.0)
        for K in (int(k) for k in args.k.split(",")):
            ref_v, ref_i = jax.jit(lambda x: topk_logprobs(x, K, chunk=0))(sets[0])
            cells = []
            for c in chunks:
                fn = lambda x, c=c: topk_logprobs(x, K, chunk=c)
                v, i = jax.jit(fn)(sets[0])
                if not (np.array_equal(np.asarray(v), np.asarray(ref_v)) and np.array_equal(np.asarray(i), np.asarray(ref_i))):
                    cells.append("MISMATCH")
                    continue
                t = time_jit_sets(fn, [(x,) for x in sets], reps=20)
                cells.append(f"{t['wall_s'] * 1e6:.1f}" + (f" / {t['kernel_us']:.1f}" if "kernel_us" in t else ""))
            print(f"| {B}x{L}x{V} | {K} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
