"""CLI: python -m kimijax.decode --model PATH|preset --prompt "..." [--chat] [--method ddtree ...]

Prints the answer, then tokens/s, mean acceptance length and the device used. Bad input (missing or
corrupt checkpoint, unsupported config, over-long prompt, invalid sampling or tree parameters) prints one
line `error: ...` and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kimijax.decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Kimi checkpoint directory, orbax save, .gguf file, or preset (tiny, smollm2); "
                                   "default: SmolLM2-135M-Instruct + its DFlash drafter")
    p.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.", help="prompt text")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the model's chat template (default: on for the default model)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--method", choices=("ar", "dflash", "ddtree"), default=None,
                   help="decoding method (default: ddtree when a drafter is available, else ar)")
    p.add_argument("--drafter", help="DFlash drafter directory (z-lab format)")
    p.add_argument("--budget", type=int, default=None,
                   help="DDTree node budget (1..128; default 8 for SmolLM2 + its drafter, the fastest at one request "
                        "on the GPU runs in BENCHMARKS.md; 16 otherwise)")
    p.add_argument("--topk-cap", type=int, default=None, help="DDTree: at most this many children per depth")
    p.add_argument("--draft-window", type=int, default=None, help="drafter sees only the last W context tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--compile-cache", default=None, metavar="DIR|off",
                   help="XLA's persistent compilation cache, so a later run with the same shapes skips compiling "
                        "(default: $KIMIJAX_COMPILE_CACHE, else $KIMIJAX_CACHE/xla, i.e. ~/.cache/kimijax/xla; "
                        "'off' disables it)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, OSError) as e:  # our errors subclass ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    import jax

    import kimijax
    from kimijax import defaults
    from kimijax.sampling import check_sampling_params

    # cheap checks before loading anything
    check_sampling_params(args.temperature, args.top_k, args.top_p)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.budget is not None and not 1 <= args.budget <= 128:
        raise ValueError(f"--budget must be in 1..128, got {args.budget}")

    defaults.enable_compile_cache(args.compile_cache)  # before the first compile
    note, default_drafter = None, None
    model = args.model
    if model is None:
        model, default_drafter, note = defaults.default_model()
    target = kimijax.load_target(model, progress=not args.json)
    if note is None and getattr(target, "random_weights", False):
        note = f"note: preset {model!r} has RANDOM weights (its output is meaningless)"
    drafter_path = args.drafter
    if drafter_path is None and args.model is None and args.method != "ar":
        drafter_path = default_drafter
    if args.method in ("dflash", "ddtree") and drafter_path is None:
        raise ValueError(f"--method {args.method} needs a drafter (--drafter PATH)")
    drafter = kimijax.load_drafter(drafter_path, target) if drafter_path else None
    method = args.method or ("ddtree" if drafter is not None else "ar")
    budget = args.budget
    if budget is None:
        committed = drafter_path is not None and Path(drafter_path).resolve() == defaults.SMOLLM2_DRAFTER.resolve()
        budget = defaults.SMOLLM2_BUDGET if committed else defaults.DEFAULT_BUDGET
    engine = kimijax.Engine(target, drafter, method=method, budget=budget, topk_cap=args.topk_cap,
                            draft_window=args.draft_window)
    tok = target.tokenizer
    if tok is None:
        raise ValueError(f"model {model!r} has no tokenizer (tiktoken.model + tokenizer_config.json for Kimi "
                         "checkpoints); the CLI needs one for text prompts")
    chat = args.chat if args.chat is not None else args.model is None  # the default model is a chat model
    prompt = tok.encode_chat([{"role": "user", "content": args.prompt}]) if chat else tok.encode(args.prompt)
    res = engine.generate([prompt], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed)[0]
    st = engine.last_stats
    dev = jax.devices()[0]
    info = {
        "model": model, "method": method, "budget": budget if method == "ddtree" else None,
        "device": f"{dev.platform}:{dev.device_kind}",
        "text": res.text, "tokens": res.tokens, "finish_reason": res.finish_reason,
        "prompt_tokens": res.prompt_tokens, "new_tokens": len(res.tokens),
        "decode_tokens_per_s": round(st["decode_tokens_per_s"], 2),
        "mean_acceptance_length": None if st["mean_acceptance"] != st["mean_acceptance"] else round(st["mean_acceptance"], 3),
        "prefill_s": round(st["prefill_s"], 3), "compile_s": round(st["compile_s"], 3),
        "decode_s": round(st["decode_s"], 3),
        "random_weights": bool(getattr(target, "random_weights", False)) or model.endswith(defaults.EMBEDDED_NAME),
    }
    if args.json:
        print(json.dumps(info))
        return 0
    if note:
        print(note, file=sys.stderr)
    print(res.text)
    print(f"\n[{method}] {len(res.tokens)} tokens ({res.finish_reason}) | {info['decode_tokens_per_s']} tok/s decode "
          f"| mean acceptance length {info['mean_acceptance_length']} | device {info['device']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
