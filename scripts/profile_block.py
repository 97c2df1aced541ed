#!/usr/bin/env python3
"""Where the time of one full-width Kimi K2.6 block goes, per kernel (GPU), as the target runs it:
  --block moe   router, routed experts through `moe` (random INT4 experts in the kernel layout), shared expert,
                for N tokens routed by the real router code (random weights: distinct experts depend on the
                random router, as in scripts/bench_kimi.py's components);
  --block attn  the absorbed MLA attention block (projections, rope, cache write, tree attention, output
                projection) for T tokens over a committed context of L - T slots (--cases T:L,...).
Prints, per case: back-to-back time per call (scripts/bench_kimi.py's loop_ms), the profiler's kernel time per
call, the HBM floor of the bytes it must read at the read roof measured in the same run (GPU), and the kernels
by name with their named scope.

  python3 scripts/profile_block.py --block moe [--tokens 1,9,17] [--impl pallas|xla]
  python3 scripts/profile_block.py --block attn [--cases 1:4096,9:4096] [--attn-impl auto,xla]
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
from kimijax.models.common import causal_tree_mask  # noqa: E402
from kimijax.models.mla import MLA  # noqa: E402
from kimijax.models.moe import MoE, route  # noqa: E402
from kimijax.target import convert_expert_layout  # noqa: E402
from timing import op_names, profile_events  # noqa: E402


def nbytes(tree) -> int:
    return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(tree))


def report(f, args_, label: str, floor_bytes: float, roof, top: int, carry=None):
    """Time f(*args_) back to back (carry: index of an argument the call returns updated, e.g. a donated
    cache), profile 5 calls and print the kernels by time."""
    state = list(args_)

    def call(_=None):
        out = f(*state)
        if carry is not None:
            state[carry] = out[1]
        return out

    ms = loop_ms(call, None)
    names = op_names(f.lower(*state).compile().as_text())
    reps = 5

    def run():
        for _ in range(reps):
            jax.block_until_ready(call())

    dev, _ = profile_events(run)
    per, count = collections.defaultdict(float), collections.Counter()
    for op, _mod, ns, ev in dev:
        key = (ev, names.get(op, names.get(ev, "")))
        per[key] += ns / 1e3 / reps
        count[key] += 1
    total = sum(per.values())
    floor = f"; HBM floor {floor_bytes / roof * 1e6:.1f} us" if roof else ""
    print(f"\n{label}: {ms * 1e3:.1f} us per call back to back, {total:.1f} us of kernels per call "
          f"({sum(count.values()) / reps:.0f} kernels){floor}", flush=True)
    for (ev, scope), us in sorted(per.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {us:8.1f} us  x{count[(ev, scope)] // reps:<3d} {ev[:48]:48s} {scope[-70:]}", flush=True)


def moe_block(cfg, p_layer, args, roof):
    impl = args.impl or ("pallas" if jax.default_backend() == "gpu" else "interpret")
    layout = "checkpoint" if impl == "xla" else "kernel"
    p = convert_expert_layout({"l": p_layer}, layout, donate=True)["l"]["mlp"]
    m = MoE(cfg, jnp.bfloat16, impl, None, layout)
    # bytes a call must read: router + shared expert, plus each distinct routed expert's share of the stacked arrays
    E = cfg.n_routed_experts
    expert_keys = {k for k in p if k.endswith(("_planar", "_scale_t", "_packed", "_scale"))}
    per_expert = sum(int(p[k].nbytes) for k in expert_keys) / E
    fixed = sum(nbytes(v) for k, v in p.items() if k not in expert_keys)
    print(f"MoE impl {impl}, experts in the {layout} layout", flush=True)
    f = jax.jit(lambda p, x: m.apply({"params": p}, x))
    for N in (int(t) for t in args.tokens.split(",")):
        x = jax.random.normal(jax.random.PRNGKey(N), (1, N, cfg.hidden_size), jnp.bfloat16)
        ids, _ = jax.jit(lambda p, x: route(x[0], p["gate"], p["e_score_correction_bias"], cfg))(p, x)
        distinct = len(np.unique(np.asarray(ids)))
        report(f, (p, x), f"N={N} tokens, {distinct} distinct experts", fixed + distinct * per_expert, roof,
               args.top)


def attn_block(cfg, p_layer, args, roof):
    from pallas_kernels.tree_attention import default_impl
    p = p_layer["self_attn"]
    print(f"{nbytes(p) / 1e6:.1f} MB of attention weights", flush=True)
    for impl in (args.attn_impl or default_impl()).split(","):
        mla = MLA(cfg, jnp.bfloat16, impl)
        f = jax.jit(lambda p, x, pos, cache, lens, mask: mla.apply({"params": p}, x, pos, cache, lens, mask,
                                                                   absorbed=True), donate_argnums=(3,))
        for case in args.cases.split(","):
            T, L = (int(v) for v in case.split(":"))
            S = L - T
            if S < 0:
                raise SystemExit(f"case {case}: T={T} tokens do not fit a context of L={L}")
            k = jax.random.split(jax.random.PRNGKey(T * 7919 + L), 2)
            x = jax.random.normal(k[0], (1, T, cfg.hidden_size), jnp.bfloat16)
            cache = jax.random.normal(k[1], (1, L, cfg.kv_lora_rank + cfg.qk_rope_head_dim), jnp.bfloat16)
            pos = (S + jnp.arange(T, dtype=jnp.int32))[None]
            lens = jnp.full((1,), S, jnp.int32)
            kv_bytes = L * cache.shape[-1] * cache.dtype.itemsize
            report(f, (p, x, pos, cache, lens, causal_tree_mask(1, T)), f"attention impl {impl}, T={T} tokens "
                   f"over L={L}", nbytes(p) + kv_bytes, roof, args.top, carry=3)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--block", choices=("moe", "attn"), default="moe")
    ap.add_argument("--tokens", default="1,9,17", help="moe: tokens per case")
    ap.add_argument("--impl", default=None, help="moe: pallas | xla | interpret (default: pallas on GPU, "
                                                 "interpret on CPU)")
    ap.add_argument("--cases", default="1:4096,9:4096", help="attn: T:L per case (L = cache slots)")
    ap.add_argument("--attn-impl", default=None, help="attn: auto | pallas | xla | interpret, or several joined by "
                                                      "',' (default: the kernel module's default)")
    ap.add_argument("--top", type=int, default=8, help="kernels listed per case")
    args = ap.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    small = dataclasses.replace(TINY, hidden_size=128, moe_intermediate_size=128, intermediate_size=256)
    cfg = dataclasses.replace(KIMI_K26 if gpu else small, num_hidden_layers=2)
    p_layer = build_target_params(cfg, 2, 0)["layers_1"]
    roof = None
    if gpu:  # the HBM read roof in this run, for each case's floor
        from bench_slice import measure_roof
        roof = measure_roof()
    print(f"device {jax.devices()[0].device_kind}" + (f"; read roof {roof / 1e12:.2f} TB/s" if roof else ""),
          flush=True)
    (moe_block if args.block == "moe" else attn_block)(cfg, p_layer, args, roof)


if __name__ == "__main__":
    main()
