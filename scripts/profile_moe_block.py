#!/usr/bin/env python3
"""Where the time of one Kimi K2.6 MoE block goes, per kernel (GPU): the block as the target runs it (router,
routed experts through `moe`, shared expert) at full width with random INT4 experts in the kernel layout, for
N tokens routed by the real router code (random weights: distinct experts depend on the random router, as in
scripts/bench_kimi.py's components). Prints, per N: back-to-back time per call (scripts/bench_kimi.py's
loop_ms), the profiler's kernel time per call, the HBM floor of the bytes it reads at the read roof measured in
the same run (GPU), and the kernels by name with their named scope.

  python3 scripts/profile_moe_block.py [--tokens 1,9,17] [--impl pallas|xla]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_kimi import build_target_params, loop_ms  # noqa: E402
from kimijax.config import KIMI_K26, TINY  # noqa: E402
from kimijax.models.moe import MoE, route  # noqa: E402
from kimijax.target import convert_expert_layout  # noqa: E402
from timing import op_names, profile_events  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,9,17")
    ap.add_argument("--impl", default=None, help="pallas | xla | interpret (default: pallas on GPU, interpret on CPU)")
    ap.add_argument("--top", type=int, default=8, help="kernels listed per case")
    args = ap.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    impl = args.impl or ("pallas" if gpu else "interpret")
    small = dataclasses.replace(TINY, hidden_size=128, moe_intermediate_size=128, intermediate_size=256)
    cfg = dataclasses.replace(KIMI_K26 if gpu else small, num_hidden_layers=2)
    layout = "checkpoint" if impl == "xla" else "kernel"
    params = convert_expert_layout(build_target_params(cfg, 2, 0), layout, donate=True)
    p = params["layers_1"]["mlp"]
    m = MoE(cfg, jnp.bfloat16, impl, None, layout)
    roof = None
    if gpu:  # the HBM read roof in this run, for each case's floor
        from bench_slice import measure_roof
        roof = measure_roof()
    # bytes a call must read: router + shared expert, plus each distinct routed expert's share of the stacked arrays
    E = cfg.n_routed_experts
    expert_keys = {k for k in p if k.endswith(("_planar", "_scale_t", "_packed", "_scale"))}
    per_expert = sum(int(p[k].nbytes) for k in expert_keys) / E
    fixed = sum(int(x.nbytes) for k, v in p.items() if k not in expert_keys for x in jax.tree_util.tree_leaves(v))
    print(f"device {jax.devices()[0].device_kind}; MoE impl {impl}, experts in the {layout} layout"
          + (f"; read roof {roof / 1e12:.2f} TB/s" if roof else ""), flush=True)
    for N in (int(t) for t in args.tokens.split(",")):
        x = jax.random.normal(jax.random.PRNGKey(N), (1, N, cfg.hidden_size), jnp.bfloat16)
        ids, _ = jax.jit(lambda p, x: route(x[0], p["gate"], p["e_score_correction_bias"], cfg))(p, x)
        distinct = len(np.unique(np.asarray(ids)))
        f = jax.jit(lambda p, x: m.apply({"params": p}, x))
        ms = loop_ms(lambda _: f(p, x), None)
        names = op_names(f.lower(p, x).compile().as_text())
        reps = 5
        dev, _ = profile_events(lambda: [jax.block_until_ready(f(p, x)) for _ in range(reps)])
        per, count = collections.defaultdict(float), collections.Counter()
        for op, _mod, ns, ev in dev:
            per[(ev, names.get(op, names.get(ev, "")))] += ns / 1e3 / reps
            count[(ev, names.get(op, names.get(ev, "")))] += 1
        total = sum(per.values())
        floor = f"; HBM floor {(fixed + distinct * per_expert) / roof * 1e6:.1f} us" if roof else ""
        print(f"\nN={N} tokens, {distinct} distinct experts: {ms * 1e3:.1f} us per call back to back, "
              f"{total:.1f} us of kernels per call ({sum(count.values()) / reps:.0f} kernels){floor}", flush=True)
        for (ev, scope), us in sorted(per.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {us:8.1f} us  x{count[(ev, scope)] // reps:<3d} {ev[:48]:48s} {scope[-70:]}", flush=True)


if __name__ == "__main__":
    main()
