"""How much of a static batch's work is spent on rows that already finished, and what shrinking the batch (or
refilling rows for free) could buy: device-independent counts plus an estimate from measured round times.

A static batch of C requests runs until its longest request ends, so at C=32 a DDTree b4 batch computes many
rounds for rows that are done. The counts here (rounds per request, greedy, float32 target) do not depend on the
device, so this runs on a CPU. The estimate prices each batch round with a round time interpolated over C from a
bench_e2e JSON measured on a GPU (--costs), for three schedules:
  static     every round at C rows (what Engine.generate does without max_batch)
  shrinking  the live rows move to a batch of the next smaller power of two once they fit (a host return of
             --return-ms per halving); a program per batch size, so up to log2(C) more compiles. The Engine does
             this since 2026-12-07 (`generate(..., shrink=True)`), moving several halvings at once in one return
  refill     finished rows take the next request at no cost (the bound continuous batching approaches)
It is an estimate (label it so), not a measurement: round time vs C is interpolated linearly between measured C.

  python scripts/batch_occupancy.py --costs benchmarks/2026-12-04_bench_e2e_smollm2.json --methods ar,ddtree:4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def round_costs(bench: dict, method: str, temperature: float = 0.0) -> dict[int, float]:
    """ms per batch round by concurrency for one method, from a bench_e2e JSON (static rows only)."""
    return {r["concurrency"]: r["ms_per_round"] for r in bench["rows"]  # empty: counted, not priced
            if r["method"] == method and r["temperature"] == temperature and not r.get("continuous")}


def schedule_ms(rounds_per_batch: list[list[int]], cost, C: int, return_ms: float) -> dict:
    """Total round time of static, shrinking and free-refill schedules for these batches (rounds per request)."""
    static = shrink = 0.0
    n_returns = live = total = 0
    for rs in rounds_per_batch:
        rs = np.asarray(rs)
        T = int(rs.max())
        static += T * cost(C)
        bucket = C
        for t in range(T):
            n_live = int((rs > t).sum())
            while bucket > 1 and bucket // 2 >= n_live:
                bucket //= 2
                n_returns += 1
            shrink += cost(bucket)
        live += int(rs.sum())
        total += C * T
    all_rounds = [r for rs in rounds_per_batch for r in rs]  # requests in order
    # free refill: C rows, each takes the next request the round its last one ends (greedy list scheduling)
    rows = np.zeros(C, np.int64)
    for r in all_rounds:
        rows[np.argmin(rows)] += r
    refill_rounds = int(rows.max())
    return dict(batch_rounds=sum(int(max(rs)) for rs in rounds_per_batch), live_row_rounds=live, row_rounds=total,
                occupancy=live / total, static_ms=static, shrinking_ms=shrink + n_returns * return_ms,
                shrink_returns=n_returns, refill_rounds=refill_rounds, refill_ms=refill_rounds * cost(C),
                median_rounds=float(np.median(all_rounds)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--costs", required=True, help="bench_e2e JSON whose static rows give ms per round vs C")
    ap.add_argument("--methods", default="ar,ddtree:4")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--return-ms", type=float, default=2.0, help="cost of one host return + row gather (shrinking)")
    ap.add_argument("--rounds-json", default=None, help="reuse the per-request rounds saved by an earlier run")
    ap.add_argument("--out", default=None, help="write counts and estimates here (JSON)")
    args = ap.parse_args(argv)
    C, methods = args.concurrency, [m for m in args.methods.split(",") if m]
    bench = json.loads(Path(args.costs).read_text())
    unpriced = [m for m in methods if not round_costs(bench, m)]
    if unpriced:  # said before the slow counting, not after it
        print(f"no static T=0 rows of {', '.join(unpriced)} in {args.costs}: counted, not priced", flush=True)

    if args.rounds_json:
        rounds = json.loads(Path(args.rounds_json).read_text())["rounds"]
    else:
        import kimijax
        from bench_e2e import heldout_chats  # the same requests as bench_e2e's rows
        from kimijax.defaults import smollm2_drafter_dir
        from kimijax.gguf_loading import load_llama_gguf

        target = load_llama_gguf(None, dtype="float32")
        drafter = kimijax.load_drafter(smollm2_drafter_dir(), target)
        chats = heldout_chats(target, smollm2_drafter_dir() / "heldout_prompts.json", 384)[: C * args.batches]
        rounds = {}
        for m in methods:
            name, _, b = m.partition(":")
            eng = kimijax.Engine(target, None if name == "ar" else drafter, method=name, budget=int(b or 8))
            rounds[m] = []
            for j in range(args.batches):
                res = eng.generate(chats[j * C:(j + 1) * C], max_new_tokens=args.max_new, temperature=0.0, seed=j)
                rounds[m].append([r.rounds for r in res])
                print(f"{m} batch {j}: longest request {max(rounds[m][-1])} rounds", flush=True)

    res = dict(script="scripts/batch_occupancy.py", argv=sys.argv[1:], costs_from=args.costs,
               costs_device=bench.get("device"), concurrency=C, return_ms=args.return_ms, rounds=rounds, methods={})
    print(f"\nESTIMATE (round times interpolated from {args.costs}, {bench.get('device')}; counts measured)")
    print("| method | batch rounds | live row-rounds | static ms | shrinking ms (returns) | free-refill rounds | ms |")
    print("|---|---|---|---|---|---|---|")
    for m in methods:
        pts = round_costs(bench, m)
        if not pts:  # counts only: the costs JSON has no static row of this method
            s = schedule_ms(rounds[m], lambda c: float("nan"), C, args.return_ms)
            res["methods"][m] = s
            print(f"| {m} | {s['batch_rounds']} | {s['occupancy']:.0%} | no costs | | {s['refill_rounds']} | |")
            continue
        xs = sorted(pts)
        cost = lambda c, xs=xs, pts=pts: float(np.interp(c, xs, [pts[x] for x in xs]))
        s = schedule_ms(rounds[m], cost, C, args.return_ms)
        s["ms_per_round_by_c"] = pts
        res["methods"][m] = s
        print(f"| {m} | {s['batch_rounds']} | {s['occupancy']:.0%} | {s['static_ms']:.0f} | {s['shrinking_ms']:.0f} "
              f"({s['shrink_returns']}) | {s['refill_rounds']} | {s['refill_ms']:.0f} |")
    if len(methods) == 2 and all(res["methods"][m]["static_ms"] == res["methods"][m]["static_ms"] for m in methods):
        a, b = (res["methods"][m] for m in methods)
        for k in ("static_ms", "shrinking_ms", "refill_ms"):
            print(f"{methods[1]} / {methods[0]}, both {k[:-3]}: {a[k] / b[k]:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
