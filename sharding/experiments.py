"""Compare sharding layouts on one workload: step time, collective bytes per round, bytes per device.

  python -m sharding.experiments --layouts tp8,ep8,ep4 --model tiny8 --method ddtree --budget 8 \\
      --batch 4 --prompt-len 16 --steps 16 --out sharding_results.json

For each layout: build the mesh, load the target onto it (a checkpoint directory is read shard by shard by
`load_target(path, mesh=..., layout=...)`; a preset gets seeded random weights, identical in every layout),
run the same prompts through `Engine(..., method=...)` (a warm-up generate compiles, the timed generates
exclude compile), and report
  step_ms          decode wall time / rounds (one round = one AR step or one draft-tree-verify round)
  collectives      per kind: count and operand bytes per device of the compiled chunk program, read from its
                   optimized HLO (sharding/hlo.py); the while body is one round, so `coll_bytes` ~ bytes one
                   device sends into collectives per round (ops only in conditional branches, e.g. the
                   sampling path under greedy decoding, are listed but left out)
  weights / cache  bytes held per device (max over devices) of the target params, the target latent cache
                   and the drafter context cache for this batch
  same_tokens      greedy output equal to the first layout's (a correctness check across layouts)
It prints a table, writes JSON (--out) and a matplotlib plot (--plot, Agg backend).

On CPU simulate devices first: XLA_FLAGS=--xla_force_host_platform_device_count=8 (set by this module when
JAX_PLATFORMS is cpu or unset and --cpu-devices is given; default 8 when no accelerator is visible).
Models: kimijax presets (tiny, tiny-bf16), `tiny8` (defined here: heads, experts, expert hidden and vocab
divide 8 ways, so tp8/ep8/tp4ep2 all apply), or a checkpoint directory. Drafter: --drafter PATH (z-lab
DFlash format) or a small random drafter matched to the target.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time


def _early_cpu_devices(argv):
    """Simulated CPU devices must be configured before jax initializes its backends."""
    n = None
    for i, a in enumerate(argv):
        if a == "--cpu-devices" and i + 1 < len(argv):
            n = argv[i + 1]
        elif a.startswith("--cpu-devices="):
            n = a.split("=", 1)[1]
    if n is not None:  # read when the CPU backend starts (importing jax does not start it)
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count={int(n)}").strip()


def tiny8_config(dtype: str = "float32"):
    """TINY with 8 heads, 16 experts and expert hidden 256 (8 INT4 scale groups): every layout of 8 devices
    (tp8, ep8, ep4, tp4ep2, tp2ep4) divides it."""
    from kimijax.config import TINY
    return dataclasses.replace(TINY, num_attention_heads=8, n_routed_experts=16, moe_intermediate_size=256,
                               dtype=dtype)


LOCAL_PRESETS = {"tiny8": tiny8_config}
_RANDOM_PARAMS: dict = {}


def small_drafter_config(cfg, block_size: int = 4):
    from kimijax.models.drafter import DrafterConfig
    n = cfg.num_hidden_layers
    ids = tuple(sorted({0, n - 1})) if n > 1 else (0,)
    return DrafterConfig(hidden_size=cfg.hidden_size, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=96, block_size=block_size,
                         mask_token_id=cfg.vocab_size - 1, target_layer_ids=ids, num_target_layers=n,
                         vocab_size=cfg.vocab_size, dtype=cfg.dtype)


def build_target(model: str, mesh, layout: str, dtype: str | None, seed: int, dispatch: str,
                 layers: int | None = None):
    """The target on `mesh` (checkpoint read per shard, or a preset's seeded random weights).
    layers: truncate a preset to its first N layers (quick runs)."""
    from kimijax.config import PRESETS
    from kimijax.loading import load_target
    from kimijax.target import KimiTarget, random_kimi_params
    from sharding.moe_ep import make_expert_fn

    if model in LOCAL_PRESETS or (layers and model in PRESETS):
        cfg = LOCAL_PRESETS[model](dtype or "float32") if model in LOCAL_PRESETS else PRESETS[model]
        if dtype:
            cfg = dataclasses.replace(cfg, dtype=dtype)
        if layers:
            cfg = dataclasses.replace(cfg, num_hidden_layers=layers)
        key = (cfg, seed)
        if key not in _RANDOM_PARAMS:  # one init per run; every layout reshards the same weights
            _RANDOM_PARAMS.clear()
            _RANDOM_PARAMS[key] = random_kimi_params(cfg, seed)
        t = KimiTarget(cfg, _RANDOM_PARAMS[key], name=model, random_weights=True)
        return t.on_mesh(mesh, layout, dispatch)
    t = load_target(model, dtype=dtype, mesh=mesh, layout=layout, progress=False, seed=seed)
    if dispatch != "auto":
        t = dataclasses.replace(t, expert_fn=make_expert_fn(mesh, dispatch))
    return t


def build_drafter(path: str | None, target, mesh, block_size: int, seed: int):
    from kimijax.models.drafter import load_drafter, random_drafter

    if path:
        d = load_drafter(path, target)
    else:
        d = random_drafter(small_drafter_config(target.cfg, block_size), target, seed=seed + 1)
    return d.on_mesh(mesh)


def run_layout(layout: str, args, devices) -> dict:
    import jax
    import numpy as np
    from kimijax.engine import Engine
    from sharding.hlo import compiled_collectives
    from sharding.mesh import layout_devices, make_mesh, mesh_sizes, parse_layout
    from sharding.rules import bytes_per_device

    lay = parse_layout(layout)
    mesh = make_mesh(lay, devices if lay.data is None else devices[: layout_devices(lay)])
    t0 = time.perf_counter()
    target = build_target(args.model, mesh, layout, args.dtype, args.seed, args.dispatch, args.layers)
    jax.block_until_ready(target.params)
    load_s = time.perf_counter() - t0
    drafter = None
    if args.method != "ar":
        drafter = build_drafter(args.drafter, target, mesh, args.block_size, args.seed)
    eng = Engine(target, drafter, method=args.method, budget=args.budget, chunk_rounds=args.steps + 1)
    rng = np.random.default_rng(args.seed)
    lo = 3 if target.vocab_size > 8 else 0
    prompts = [rng.integers(lo, target.vocab_size - 1, size=args.prompt_len).tolist() for _ in range(args.batch)]
    gen = dict(max_new_tokens=args.steps + 1, temperature=args.temperature, stop_ids=[], seed=args.seed)
    res = eng.generate(prompts, **gen)  # warm-up: compiles prefill and the chunk program
    compile_s = eng.last_stats["compile_s"]
    best = None
    for _ in range(max(1, args.repeats)):
        res = eng.generate(prompts, **gen)
        st = eng.last_stats
        if best is None or st["decode_s"] < best["decode_s"]:
            best = dict(st)
    rounds = max(1, best["rounds"])
    comp = list(eng._compiled.values())[-1]
    coll = compiled_collectives(comp)
    _, state = eng.start(prompts, **gen)
    per_dev = lambda tree: max(bytes_per_device(tree).values() or [0])
    dcache = per_dev(state["dcache"]) if "dcache" in state else 0
    out = dict(
        layout=layout, mesh=mesh_sizes(mesh), devices=int(mesh.size), load_s=load_s, compile_s=compile_s,
        step_ms=1e3 * best["decode_s"] / rounds, rounds=best["rounds"], decode_s=best["decode_s"],
        tokens_per_s=best["decode_tokens_per_s"], mean_acceptance=best["mean_acceptance"],
        coll_bytes=coll["executed_operand_bytes"], coll_bytes_all=coll["total_operand_bytes"],
        collectives={k: v for k, v in coll["by_kind"].items()},
        collective_ops=[{k: o[k] for k in ("kind", "operand_bytes", "result_bytes", "trips", "conditional", "op_name")}
                        for o in coll["ops"]],
        weights_bytes=per_dev(target.params), drafter_weights_bytes=per_dev(drafter.params) if drafter else 0,
        cache_bytes=per_dev(state["caches"]), drafter_cache_bytes=dcache,
        tokens=[r.tokens for r in res],
    )
    _release(target)
    return out


def _release(target):
    """Drop the engine's cached programs for this target before the next layout (they reference the target in a
    cycle, which the garbage collector would free later; this frees the compiled programs now)."""
    from kimijax.engine import _PROGRAMS_ATTR
    target.__dict__.pop(_PROGRAMS_ATTR, None)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GB"


def table(results: list[dict]) -> str:
    cols = ("layout", "mesh dp/ep/tp", "dev", "step ms", "tok/s", "accept", "coll/round", "AR", "AG", "A2A",
            "other", "weights/dev", "cache/dev", "same")
    rows = []
    for r in results:
        by = r["collectives"]
        n = lambda k: str(by.get(k, {}).get("count", 0))
        other = sum(v["count"] for k, v in by.items() if k not in ("all-reduce", "all-gather", "all-to-all"))
        m = r["mesh"]
        rows.append((r["layout"], f"{m['data']}/{m['expert']}/{m['tensor']}", str(r["devices"]),
                     f"{r['step_ms']:.2f}", f"{r['tokens_per_s']:.1f}", f"{r['mean_acceptance']:.2f}",
                     _fmt_bytes(r["coll_bytes"]), n("all-reduce"), n("all-gather"), n("all-to-all"), str(other),
                     _fmt_bytes(r["weights_bytes"]), _fmt_bytes(r["cache_bytes"] + r["drafter_cache_bytes"]),
                     "yes" if r.get("same_tokens", True) else "NO"))
    w = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.rjust(w[i]) if i else v.ljust(w[i]) for i, v in enumerate(vals))
    return "\n".join([line(cols), line(["-" * x for x in w])] + [line(r) for r in rows])


def plot(results: list[dict], path: str, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["layout"] for r in results]
    fig, axs = plt.subplots(1, 4, figsize=(16, 3.6))
    panels = [("step time (ms / round)", [r["step_ms"] for r in results]),
              ("collective bytes / round / device (KB)", [r["coll_bytes"] / 1024 for r in results]),
              ("weights / device (MB)", [r["weights_bytes"] / 2 ** 20 for r in results]),
              ("caches / device (MB)", [(r["cache_bytes"] + r["drafter_cache_bytes"]) / 2 ** 20 for r in results])]
    for ax, (t, vals) in zip(axs, panels):
        ax.bar(names, vals, color="#4C72B0")
        ax.set_title(t, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    _early_cpu_devices(argv)
    p = argparse.ArgumentParser(prog="python -m sharding.experiments", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="tp8,ep8,ep4", help="comma-separated layouts (sharding/mesh.py); a layout "
                   "naming all its axes (dpN..., single) uses that many devices, others use all of them")
    p.add_argument("--model", default="tiny8", help="preset (tiny, tiny-bf16, tiny8) or checkpoint directory")
    p.add_argument("--drafter", default=None, help="DFlash drafter directory (default: small random drafter)")
    p.add_argument("--method", default="ddtree", choices=("ar", "dflash", "ddtree"))
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--block-size", type=int, default=4, help="random drafter block size")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=16, help="new tokens per request beyond the first (rounds <= steps)")
    p.add_argument("--repeats", type=int, default=2, help="timed generates per layout (best is reported)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--layers", type=int, default=None, help="truncate a preset to N layers (quick runs)")
    p.add_argument("--dtype", default=None, help="param dtype (default: the model's; tiny8: float32)")
    p.add_argument("--dispatch", default="auto", choices=("auto", "psum", "a2a", "ragged"), help="routed-expert dispatch")
    p.add_argument("--devices", type=int, default=None, help="use the first N devices (default: all)")
    p.add_argument("--cpu-devices", type=int, default=None, help="simulate N CPU devices (set before jax starts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="sharding_results.json")
    p.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    args = p.parse_args(argv)

    import jax

    devices = jax.devices()[: args.devices] if args.devices else jax.devices()
    layouts = [l.strip() for l in args.layouts.split(",") if l.strip()]
    print(f"{len(devices)} x {devices[0].device_kind} ({jax.default_backend()}); model {args.model}; "
          f"method {args.method} budget {args.budget}; batch {args.batch} x prompt {args.prompt_len}; "
          f"{args.steps} steps", flush=True)
    results = []
    for lay in layouts:
        t0 = time.perf_counter()
        r = run_layout(lay, args, devices)
        r["same_tokens"] = not results or r["tokens"] == results[0]["tokens"]
        results.append(r)
        print(f"  {lay}: {r['step_ms']:.2f} ms/round, {_fmt_bytes(r['coll_bytes'])} collectives/round "
              f"({time.perf_counter() - t0:.0f}s incl. compile)", flush=True)
    info = dict(device=f"{len(devices)} x {devices[0].device_kind}", backend=jax.default_backend(),
                jax=jax.__version__, args=vars(args), date=time.strftime("%Y-%m-%d %H:%M:%S"))
    with open(args.out, "w") as f:
        json.dump(dict(info=info, results=results), f, indent=1)
    png = args.plot or os.path.splitext(args.out)[0] + ".png"
    plot(results, png, f"{args.model} {args.method} budget {args.budget}, batch {args.batch}, {info['device']}")
    print()
    print(table(results))
    print(f"\nwrote {args.out} and {png}")
    return results


if __name__ == "__main__":
    main()
