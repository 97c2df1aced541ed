"""Does a temperature on the drafter's logits, applied only where DDTree ranks candidates, raise acceptance?

The tree keeps the `budget` most probable prefixes under the drafter's per-depth distributions; if the drafter
were over- or under-confident, scaling its logits by 1/tau before the per-depth top-K would move nodes between
depth and breadth. Verification is unchanged (the output stays exactly the target's), so only acceptance can
move, and acceptance does not depend on the device: this runs on a CPU too (float32 target, greedy).

  python scripts/tree_calibration.py --taus 0.6,1.0,1.5,2.2 --prompts 160:192 --max-new 96 --budget 16

Prompts are a slice of the drafter's held-out set (default 160:192, rows the bench_e2e C=1 and C=32 rows do
not use).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--taus", default="0.6,1.0,1.5,2.2")
    ap.add_argument("--prompts", default="160:192", help="slice START:END of the held-out prompts")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--budget", type=int, default=16)
    args = ap.parse_args(argv)

    import jax.numpy as jnp

    import kimijax
    from kimijax.defaults import smollm2_drafter_dir
    from kimijax.gguf_loading import load_llama_gguf
    from kimijax.spec import ddtree

    target = load_llama_gguf(None, dtype="float32")
    drafter = kimijax.load_drafter(smollm2_drafter_dir(), target)
    held = json.loads((Path(smollm2_drafter_dir()) / "heldout_prompts.json").read_text())["prompts"]
    lo, hi = (int(x) for x in args.prompts.split(":"))
    chats = [target.tokenizer.encode_chat([{"role": "user", "content": r["prompt"]}]) for r in held[lo:hi]]
    plain = ddtree.topk_logprobs
    for tau in (float(t) for t in args.taus.split(",")):
        ddtree.topk_logprobs = lambda x, K, chunk=None, tau=tau: plain(x.astype(jnp.float32) / tau, K, chunk)
        target.__dict__.pop("_kimijax_engine_programs", None)  # programs traced with the previous tau
        eng = kimijax.Engine(target, drafter, method="ddtree", budget=args.budget)
        t = time.time()
        res = eng.generate(chats, max_new_tokens=args.max_new)
        acc = [a for r in res for a in r.acceptance_lengths]
        print(f"tau {tau:g}: mean acceptance {sum(acc) / len(acc):.3f} over {len(acc)} rounds, "
              f"{sum(len(r.tokens) for r in res)} tokens, {time.time() - t:.0f} s", flush=True)
    ddtree.topk_logprobs = plain
    return 0


if __name__ == "__main__":
    sys.exit(main())
