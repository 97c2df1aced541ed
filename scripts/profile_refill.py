"""What a refilled row costs: continuous batching (`Engine.generate(..., max_batch=C)`) gives a finished
request's row to the next prompt, which costs a prefill written into the batch state and a host round trip.
This script times those pieces separately on the embedded default's shapes (random SmolLM2 weights: no piece
depends on them) after a warm-up, next to one batch round:

  python3 scripts/profile_refill.py --out $OUT/refill.json

  start(1)    a one-request batch state (Engine.start: what a refill cost, plus a row copy, until 2026-12-06)
  init_cache  allocating the one-request cache eagerly (one dispatch per layer; what start did before)
  zero_cache  the same as one program (what start does since)
  prefill(1)  the one-request prefill program alone (with its zero cache), inputs already on the device
  refill(K)   Engine._refill: K prompts prefilled into K rows of the C-row state (zero cache + one program)
  host_rows   fetching the per-row outputs to the host (done at every chunk end)
  round       one batch round at C rows (a chunk of --rounds rounds / --rounds)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE))


def timed(fn, n: int) -> float:
    """Median wall time of fn() (which must block on its result) over n calls, in ms."""
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * sorted(ts)[len(ts) // 2]


def run(method: str, C: int, args, target, drafter) -> dict:
    import jax
    import numpy as np

    import kimijax
    from kimijax.engine import _bucket, _host_rows

    budget = int(method.split(":")[1]) if ":" in method else 1
    eng = kimijax.Engine(target, drafter if method != "ar" else None, method=method.split(":")[0], budget=budget,
                         chunk_rounds=args.rounds)
    rng = np.random.default_rng(args.seed)
    prompt = lambda: rng.integers(3, target.vocab_size, size=args.prompt_len).tolist()
    kw = dict(max_new_tokens=args.max_new, stop_ids=[],
              cache_len=1 << (eng.cache_need(args.prompt_len, args.max_new) - 1).bit_length())
    _, state = eng.start([prompt() for _ in range(C)], **kw)
    dparams = None if drafter is None or method == "ar" else eng.drafter.params
    chunk = eng._chunk_program(state, dparams)
    box = {"state": state}
    L = kw["cache_len"]

    def start_one():
        jax.block_until_ready(eng.start([prompt()], **kw)[1])

    def refill(K):
        rows = list(range(K))
        box["state"] = jax.block_until_ready(eng._refill(
            box["state"], rows, [prompt() for _ in rows], rows, np.zeros(K), np.zeros(K, int), np.ones(K),
            jax.random.PRNGKey(0), np.full(K, args.max_new), L))

    def chunk_once():
        s = dict(box["state"])
        s["done"] = s["done"] & False  # keep every row live, so the chunk runs all its rounds
        box["state"] = jax.block_until_ready(chunk(target.params, type(box["state"])(s), dparams, np.int32(1)))

    start_one(), chunk_once(), refill(1), refill(4)  # warm
    # the one-request prefill program alone (compiled by start_one), on device-resident inputs: how much of
    # a refill is the prompt pass itself rather than the keys, output rows, row copies and host bookkeeping
    prefill = [v for k, v in eng._compiled.items() if k[0] == "prefill"][-1]
    toks = np.zeros((1, _bucket(args.prompt_len)), np.int32)
    toks[0, :args.prompt_len] = prompt()
    pre_args = jax.device_put((toks, np.full(1, args.prompt_len, np.int32), jax.random.split(jax.random.PRNGKey(1), 1),
                               np.zeros(1, np.float32), np.zeros(1, np.int32), np.ones(1, np.float32)))
    prefill_one = lambda: jax.block_until_ready(prefill(target.params, eng._zero_cache(1, L), *pre_args, dparams))
    prefill_one()
    row = dict(method=method, concurrency=C, prompt_len=args.prompt_len, rounds_per_chunk=args.rounds,
               start_one_ms=timed(start_one, args.calls),
               init_cache_ms=timed(lambda: jax.block_until_ready(target.init_cache(1, kw["cache_len"])), args.calls),
               zero_cache_ms=timed(lambda: jax.block_until_ready(eng._zero_cache(1, kw["cache_len"])), args.calls),
               prefill1_ms=timed(prefill_one, args.calls),
               refill1_ms=timed(lambda: refill(1), args.calls),
               refill4_ms=timed(lambda: refill(4), args.calls),
               host_rows_ms=timed(lambda: _host_rows(box["state"]), args.calls),
               round_ms=timed(chunk_once, args.calls) / args.rounds)
    row["refill_in_rounds"] = row["refill1_ms"] / row["round_ms"]
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="ar,ddtree:4")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=100, help="one prompt's tokens (held-out chats: ~40-200)")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8, help="rounds per timed chunk")
    ap.add_argument("--calls", type=int, default=9)
    ap.add_argument("--drafter", default=None, help="drafter directory (default: the committed SmolLM2 drafter)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax

    import kimijax
    from kimijax.defaults import smollm2_drafter_dir
    from kimijax.models.llama import SMOLLM2_135M, random_llama_target

    target = random_llama_target(dataclasses.replace(SMOLLM2_135M, dtype="float32"), seed=args.seed)
    drafter = kimijax.load_drafter(args.drafter or str(smollm2_drafter_dir()), target)
    dev = jax.devices()[0]
    roof = None
    if dev.platform == "gpu":  # for the record: a round's floor is the weights read once at this roof
        from bench_slice import measure_roof
        roof = measure_roof()
    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(target.params))
    print(f"device {dev.platform}:{dev.device_kind}" + ("" if roof is None else f", HBM read roof "
          f"{roof / 1e12:.2f} TB/s, weights {weights / 1e6:.0f} MB -> {weights / roof * 1e3:.3f} ms per round"),
          flush=True)
    rows = [run(m, args.concurrency, args, target, drafter) for m in args.methods.split(",")]
    print("| method | C | start(1) ms | init_cache ms | zero_cache ms | prefill(1) ms | refill(1) ms | refill(4) ms "
          "| host_rows ms | round ms | refill(1) / round |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['concurrency']} | {r['start_one_ms']:.2f} | {r['init_cache_ms']:.2f} | "
              f"{r['zero_cache_ms']:.2f} | {r.get('prefill1_ms', float('nan')):.2f} | {r['refill1_ms']:.2f} | "
              f"{r['refill4_ms']:.2f} | "
              f"{r['host_rows_ms']:.2f} | {r['round_ms']:.2f} | {r['refill_in_rounds']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(script="scripts/profile_refill.py", argv=sys.argv[1:],
                                                  device=f"{dev.platform}:{dev.device_kind}", jax=jax.__version__,
                                                  date=time.strftime("%Y-%m-%d"), roof_bytes_per_s=roof,
                                                  weights_bytes=weights, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
