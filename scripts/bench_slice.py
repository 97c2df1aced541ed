"""Time a full-width Kimi K2.6 slice through the real Engine on one GPU: prefill, AR step, DDTree round.

The slice keeps every full-size shape (hidden 7168, 64 MLA heads, 384 INT4 experts in the real packed
layout, 163840-row embedding and lm_head) but only `--layers` decoder layers (layer 0 dense, the rest MoE),
with random weights; the drafter has the real Kimi-K2.5-DFlash width (7168, 64/8 heads, 18432 MLP).
Random weights give meaningless acceptance, so DDTree rows report the time per round, not tokens/s.

It measures the HBM read roof in the same run (a large bf16 reduction) and reports each AR step against
the HBM floor of the bytes it must move.

  python scripts/bench_slice.py --layers 2 --batch 1,8 --prompt-len 1024 --steps 64 \
      --budgets 4,8,16,32 --tree-batch 1,8,32 --out $OUT/bench_slice.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import jax
import jax.numpy as jnp
import numpy as np


def measure_roof(gib: float = 4.0, reps: int = 20) -> float:
    """HBM read roof in bytes/s: a large bf16 reduction (read once, nothing written)."""
    n = int(gib * (1 << 30)) // 2
    x = jax.random.normal(jax.random.PRNGKey(0), (n,), jnp.bfloat16)
    f = jax.jit(lambda x: jnp.sum(x.astype(jnp.float32)))
    f(x).block_until_ready()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t)
    del x
    return 2 * n / float(np.median(ts))


def kimi_bytes(cfg) -> dict:
    """Bytes each weight group of a Kimi config streams at decode: bf16 weights, INT4 routed experts with bf16
    group scales. Per layer: attn (all MLA weights), attn_heads (the part split by head under tensor
    parallelism: q_b, kv_b, o_proj), dense_mlp, shared (shared experts), router (gate), expert (one routed
    expert); head (lm_head); kv_row (one token's latent cache row in one layer)."""
    D, H, Q, K, R = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    N, V, F, E = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.moe_intermediate_size, cfg.n_routed_experts
    heads = 2 * (H * (N + R) * Q + H * (N + V) * K + D * H * V)
    return dict(attn=heads + 2 * (Q * D + (K + R) * D), attn_heads=heads, dense_mlp=2 * 3 * D * cfg.intermediate_size,
                shared=2 * 3 * D * F * cfg.n_shared_experts, router=2 * E * D,
                expert=3 * F * D // 2 + 3 * F * (D // cfg.quant_group_size) * 2,
                head=2 * cfg.vocab_size * D, kv_row=2 * (K + R))


def uniform_distinct(n_experts: int, k: int, tokens: int) -> float:
    """Expected distinct experts used by `tokens` tokens routed uniformly (k of n_experts each)."""
    return n_experts * (1 - (1 - k / n_experts) ** tokens)


def step_floor_bytes(cfg, B: int, ctx: int, T: int = 1) -> dict:
    """Bytes one target pass over T tokens per request must read (weights once, KV per request)."""
    kb = kimi_bytes(cfg)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    n_dense = cfg.num_hidden_layers - n_moe
    distinct = uniform_distinct(cfg.n_routed_experts, cfg.num_experts_per_tok, B * T)
    kv = B * ctx * kb["kv_row"] * cfg.num_hidden_layers
    moe = n_moe * (kb["shared"] + kb["router"] + distinct * kb["expert"])
    total = cfg.num_hidden_layers * kb["attn"] + n_dense * kb["dense_mlp"] + moe + kv + kb["head"]
    return dict(total=total, attn=cfg.num_hidden_layers * kb["attn"], dense=n_dense * kb["dense_mlp"],
                moe=moe, kv=kv, head=kb["head"], distinct_experts_est=distinct)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--budgets", default="4,8,16,32")
    ap.add_argument("--tree-batch", default="1,8,32")
    ap.add_argument("--tree-prompt-len", type=int, default=1024)
    ap.add_argument("--drafter-layers", type=int, default=1)
    ap.add_argument("--kernels", default=None, help="xla | pallas (default: the engine's default)")
    ap.add_argument("--time-limit", type=float, default=480, help="skip remaining cases after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, for a CPU check of this script")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t_start = time.perf_counter()

    from kimijax.config import KIMI_K26, TINY
    from kimijax.engine import Engine
    from kimijax.loading import default_kernel_impl
    from kimijax.target import KimiTarget, random_kimi_params
    from timing import round_split

    dev = jax.devices()[0]
    print(f"device: {dev.platform} {dev.device_kind}; jax {jax.__version__}", flush=True)
    roof = measure_roof(0.05 if args.smoke else 4.0)
    print(f"HBM read roof: {roof / 1e12:.2f} TB/s", flush=True)

    cfg = dataclasses.replace(TINY if args.smoke else KIMI_K26, num_hidden_layers=args.layers)
    attn_impl = args.kernels or default_kernel_impl("tree_attention")
    moe_impl = args.kernels or default_kernel_impl("moe_int4")
    t = time.perf_counter()
    params = random_kimi_params(cfg, seed=0)
    jax.block_until_ready(params)
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    print(f"slice: {args.layers} layers, {nbytes / 1e9:.2f} GB of weights, init {time.perf_counter() - t:.1f}s; "
          f"kernels attn={attn_impl} moe={moe_impl}", flush=True)
    target = KimiTarget(cfg, params, attn_impl, moe_impl, random_weights=True)
    rng = np.random.default_rng(0)
    rows = []

    def over_time():
        return time.perf_counter() - t_start > args.time_limit

    # ---- AR: prefill + decode steps
    for B in [int(b) for b in args.batch.split(",") if b]:
        if over_time():
            print(f"time limit: skipping AR B={B}")
            continue
        prompts = [rng.integers(0, cfg.vocab_size - 2, size=args.prompt_len).tolist() for _ in range(B)]
        eng = Engine(target, chunk_rounds=args.steps)
        eng.generate(prompts, max_new_tokens=args.steps + 1, stop_ids=[])  # compile + warm
        eng.generate(prompts, max_new_tokens=args.steps + 1, stop_ids=[])
        st = eng.last_stats
        step_s = st["decode_s"] / max(st["rounds"], 1)
        fb = step_floor_bytes(cfg, B, args.prompt_len + args.steps // 2)
        floor_s = fb["total"] / roof
        row = dict(kind="ar", batch=B, prompt_len=args.prompt_len, steps=st["rounds"], prefill_ms=st["prefill_s"] * 1e3,
                   step_ms=step_s * 1e3, floor_ms=floor_s * 1e3, floor_ratio=step_s / floor_s,
                   compile_s=st["compile_s"], floor_bytes=fb)
        rows.append(row)
        print(f"AR  B={B:3d}: prefill {row['prefill_ms']:.1f} ms ({args.prompt_len} tok), step {row['step_ms']:.3f} ms, "
              f"floor {row['floor_ms']:.3f} ms ({row['floor_ratio']:.1f}x)", flush=True)
        del eng

    # ---- DDTree rounds with a full-width random drafter
    budgets = [int(b) for b in args.budgets.split(",") if b]
    tree_batches = [int(b) for b in args.tree_batch.split(",") if b]
    if budgets and tree_batches:
        from kimijax.models.drafter import DrafterConfig, random_drafter

        ids = tuple(i % args.layers for i in range(6))
        dcfg = DrafterConfig(num_hidden_layers=args.drafter_layers, target_layer_ids=ids, num_target_layers=args.layers)
        if args.smoke:
            dcfg = dataclasses.replace(dcfg, hidden_size=cfg.hidden_size, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=16, intermediate_size=96, mask_token_id=cfg.vocab_size - 1,
                                       vocab_size=cfg.vocab_size)
        drafter = random_drafter(dcfg, target, seed=1)
        ar_step = {}
        for B in tree_batches:
            prompts = [rng.integers(0, cfg.vocab_size - 2, size=args.tree_prompt_len).tolist() for _ in range(B)]
            if not over_time():
                eng = Engine(target, chunk_rounds=16)
                eng.generate(prompts, max_new_tokens=17, stop_ids=[])
                eng.generate(prompts, max_new_tokens=17, stop_ids=[])
                ar_step[B] = eng.last_stats["decode_s"] / max(eng.last_stats["rounds"], 1)
            for b in budgets:
                if over_time():
                    print(f"time limit: skipping DDTree B={B} budget={b}")
                    continue
                eng = Engine(target, drafter, method="ddtree", budget=b, chunk_rounds=16)
                eng.generate(prompts, max_new_tokens=17, stop_ids=[])
                eng.generate(prompts, max_new_tokens=17, stop_ids=[])
                st = eng.last_stats
                round_s = st["decode_s"] / max(st["rounds"], 1)
                split = round_split(eng, prompts, round_s)
                row = dict(kind="ddtree", batch=B, budget=b, prompt_len=args.tree_prompt_len, rounds=st["rounds"],
                           round_ms=round_s * 1e3, ar_step_ms=ar_step.get(B, float("nan")) * 1e3,
                           round_over_ar=round_s / ar_step.get(B, float("nan")), compile_s=st["compile_s"],
                           distinct_experts=float(np.mean(st.get("distinct_experts_per_layer", [[float("nan")]]))),
                           **split)
                rows.append(row)
                print(f"DDTree B={B:3d} budget={b:3d}: round {row['round_ms']:.3f} ms vs AR step "
                      f"{row['ar_step_ms']:.3f} ms ({row['round_over_ar']:.2f}x), distinct experts/layer "
                      f"{row['distinct_experts']:.1f}; split draft {split['draft_ms']:.2f} tree {split['tree_ms']:.2f} "
                      f"verify {split['verify_ms']:.2f} accept+commit {split['accept_commit_ms']:.2f} ms", flush=True)
                del eng

    result = dict(date=time.strftime("%Y-%m-%d"), device=f"{dev.platform} {dev.device_kind}", jax=jax.__version__,
                  roof_bytes_per_s=roof, layers=args.layers, kernels=dict(attn=attn_impl, moe=moe_impl),
                  command=" ".join(sys.argv), rows=rows)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print("\n| case | batch | budget | time/step or round (ms) | HBM floor (ms) | ratio | draft / tree / verify / accept+commit (ms) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "ar":
            print(f"| AR step (prefill {r['prefill_ms']:.0f} ms) | {r['batch']} | - | {r['step_ms']:.3f} | "
                  f"{r['floor_ms']:.3f} | {r['floor_ratio']:.1f}x floor | - |")
        else:
            print(f"| DDTree round | {r['batch']} | {r['budget']} | {r['round_ms']:.3f} | - | "
                  f"{r['round_over_ar']:.2f}x AR step | {r['draft_ms']:.2f} / {r['tree_ms']:.2f} / {r['verify_ms']:.2f} / "
                  f"{r['accept_commit_ms']:.2f} |")
    print(f"roof {roof / 1e12:.2f} TB/s; total {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
