"""Full-width Kimi K2.6 slice on one GPU: AR step and DDTree round through the real Engine, per-layer split
against the HBM floor, XLA command-buffer check, and a labelled projection to 61 layers on 8x H200.

  python3 scripts/bench_kimi.py --time-limit 390 --out $OUT/bench_kimi.json     # H200, ~7 min
  python3 scripts/bench_kimi.py --smoke --out /tmp/bench_kimi.json               # CPU check of this script
  python3 scripts/bench_kimi.py --project-from bench_kimi.json                   # recompute without a GPU
  python3 scripts/bench_kimi.py --layers 3 ... --out l3.json; python3 scripts/bench_kimi.py ... --calibrate-with l3.json

`--engine-batches 1,8` sends batch 8 through the Engine before any component case (default: batch 1 only,
then components at batches 1, 128, 8, then the Engine at batch 8); `--engine-cases` / `--component-cases`
pin exact lists (METHOD:B:CTX, e.g. b8:8:4k).

The slice: dense layer 0 + `--layers - 1` MoE layers at full width (hidden 7168, 64 MLA heads, 384 INT4
experts with bf16 group scales, 163840-row embedding and lm_head) and a full-width random DFlash drafter
(6 layers, 7168 wide, 64/8 heads, 18432 MLP, block 8), all random. MoE layers 2.. are permuted copies of
layer 1 (same distribution, different function, separate buffers). The target converts the routed experts
to the kernel's layout once when it is built (what load_target does for a checkpoint; `--expert-layout
checkpoint` keeps the checkpoint layout instead, which makes the kernel re-lay the experts out inside every
call; see the report). Random weights give meaningless acceptance.

Fixed tree shape. The Engine cannot force a particular tree, and it does not need to: every shape in a
DDTree round is static (budget N -> N+1 verify slots, block_size-1 drafted depths, block_size commit
slots), so a round's kernels and bytes do not depend on what is accepted. What acceptance changes is the
committed length (reset before every timed call here, so the context stays at S) and which experts the
tree's tokens route to (measured, and reported next to the uniform-routing estimate). So the round time at
a fixed budget is the acceptance-independent round cost.

What runs (the parent never touches the GPU; it starts one child process per GPU phase and merges their JSON):
  main child   builds the slice, then works through a priority list (`plan_cases`) until its deadline,
               skipping what does not fit in memory or time (recorded with the reason):
               * Engine cases (method, batch B, context S): the decode state is built by Engine.start with
                 its prefill replaced (a naive-MLA prompt pass over S tokens does not fit at long contexts):
                 the target and drafter caches are filled with random rows and the committed length set to
                 S (reset before every timed call). The Engine's compiled chunk program (`--rounds` rounds in
                 one device while loop) is timed per call; round = call / rounds. One more call runs under
                 jax.profiler (XLA then runs command buffers op by op, so every kernel is annotated): each
                 kernel is attributed through its HLO op's named scope (layer_i / self_attn | router |
                 experts | shared_expert | dense_mlp; draft, tree, accept, commit, lm_head). The wall time
                 of the timed calls not covered by kernels (launch gaps, the while loop's host syncs) is
                 spread over the kernels by count ("gap"). The compiled HLO is scanned for command buffers.
               * Component cases: standalone jitted pieces at real width on one layer (MLA attention over a
                 cache of S rows, the MoE block, the router, the dense MLP, lm_head, the acceptance argmax,
                 the drafter pass, the tree build, the drafter context step of the commit), timed as
                 back-to-back calls. They cover the grid where Engine programs would cost too much compile
                 time (tens of seconds each); both are reported where both ran.
  xla children one small case (`--xla-case`, default DDTree b8, batch 1, first context) on a `--xla-layers`
               slice, once per `--xla-variants` value of XLA_FLAGS (XLA's defaults; command buffers off;
               +WHILE,+CONDITIONAL), each in its own process since XLA_FLAGS is read when jax starts. They
               build and compile concurrently, then time one at a time (TimingGate).

Per case the report gives: round time, per-layer time and split (attention, MoE routed + shared, router,
other + gap; drafter, tree build, accept, commit, lm_head per round), the HBM floor of one MoE layer
(attention weights + router + shared expert + distinct experts x 24.8 MB + the KV rows read) at the read
roof measured in the same run (a 4 GiB bf16 reduction), the ratio, and the distinct experts per layer
(measured vs uniform routing). Memory: the default 9 layers (8 MoE) are 84 GB of target weights + 7 GB of
drafter, which leaves ~50 GB of the H200 for caches: batch 128 x 4k fits through the Engine (5 GB of latent
cache + 13 GB of drafter context cache), batch 128 x 32k does not (43 GB + 103 GB), so it runs as
components only (its drafter piece is skipped). Cases that do not fit are recorded with the numbers.

Projection (labelled PROJECTION everywhere; `project()` in scripts/kimi_report.py, with the report): per-token
time of the full 61-layer model (1 dense + 60 MoE layers) on 8x H200 in kimijax's tp8 and ep8 layouts
(sharding/rules.py; sharding/moe_ep.py psum dispatch) = each part's measured kernel time x that device's share
of the bytes the part reads (byte model; ep8 routed experts: the expected busiest device under uniform routing)
+ the measured launch gaps, unscaled + a collective cost model: NVLink ~900 GB/s or PCIe Gen5 ~50 GB/s, plus a
fixed latency per collective of 10 us (NVLink) / 30 us (PCIe) (`--coll-latency-us-*`). Tokens/s at C=1 and C=128
for AR and DDTree b8/b16 with acceptance lengths 4.48 and 5.3 (`--acceptance`), from the slice's batch-C cases
at the first context. Collectives per round (static counts of kimijax's own layouts, checked against the HLO of
the tiny8 model on 8 simulated CPU devices with sharding.experiments): tp8 = 2 all-reduces of [B*T, D] per layer
(attention out, MLP/MoE out) + 1 (embedding) + 2 per drafter layer + 1 draft embedding + 1 for the drafter's
context projection (fc split over "tensor", sharding/drafter_fc.py) + 3 for the vocab-parallel tree top-K + 2
for the acceptance argmax; ep8 = 1 all-reduce per MoE layer (attention, dense MLP and drafter replicated) + 1 +
1 + 3 + 2 (AR: no drafter/tree terms).

Engine-calibrated projection (`--calibrate-with SHALLOW.json`, a run of this script on a slice with fewer MoE
layers, same kernels, ideally the same device session): components pay a dispatch each and route a tree's
tokens as random hidden states, so they overstate the Engine round. What one MoE layer adds to the real
round is measured by difference, (round of this slice - round of the shallow slice) / (difference in MoE
layers), per case both ran through the Engine; each case's parts are rescaled to it (f_layer = Engine layer /
components layer, the same factor for the dense layer; f_round = the round's remainder / the components'
per-round parts) and projected as above. The split between parts (which sets each part's device share)
still comes from the components. Reported next to the components-only projection, not instead of it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_slice import kimi_bytes  # noqa: E402  (imports jax, does not start a backend)
from kimi_report import case_key, drafter_slots, finalize, report, write_json  # noqa: E402  (no jax)
from timing import op_names, profile_events  # noqa: E402,F401  (op_names: re-exported for the tests)

CMD_BUFFER_FLAGS = {"default": "", "off": "--xla_gpu_enable_command_buffer=",
                    "while_cond": "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"}


# ---------------------------------------------------------------- cases
def method_budget(method: str) -> int:
    """'ar' -> 0, 'b8' -> 8."""
    return 0 if method == "ar" else int(method[1:])


def parse_ctx(s: str) -> int:
    s = s.strip().lower()
    return int(s[:-1]) * 1024 if s.endswith("k") else int(s)


def parse_cases(spec: str) -> list[tuple[str, int, int]]:
    """'ar:1:4k,b8:8:32k' -> [('ar', 1, 4096), ('b8', 8, 32768)]."""
    out = []
    for part in [p for p in spec.split(",") if p.strip()]:
        m, b, c = part.strip().split(":")
        out.append((m, int(b), parse_ctx(c)))
    return out


def plan_cases(args) -> tuple[list, list, list]:
    """(first Engine cases, component cases, remaining Engine cases), each in priority order.

    AR and DDTree b8/b16 at the first context come first: through the Engine at `--engine-batches` (default
    batch 1: the bars and the C=1 projection), then as components at batch 1 (validation against the
    Engine), the largest batch (the C=128 projection) and batch 8. Then the Engine at the other first-two
    batches (8), then the rest of the grid as components, then the rest through the Engine. An Engine
    program of the slice costs tens of seconds of compile time; a component program a few."""
    methods = ["ar"] + [f"b{b}" for b in args.budgets]
    grid = [(m, B, c) for c in args.contexts for B in args.batches for m in methods]
    c0 = args.contexts[0]
    key3 = ("ar", "b8", "b16")
    first_b = [B for B in args.engine_batches if B in args.batches]
    head_b = list(dict.fromkeys(args.batches[:1] + args.batches[-1:] + args.batches[1:2]))
    first = [(m, B, c0) for B in first_b for m in key3 if (m, B, c0) in grid]
    second = [(m, B, c0) for B in args.batches[:2] for m in key3 if (m, B, c0) in grid and B not in first_b]
    if args.engine_cases is not None:
        first, rest = parse_cases(args.engine_cases), []
    else:
        rest = second + [g for g in grid if g not in first and g not in second]
    if args.component_cases is not None:
        comps = parse_cases(args.component_cases)
    else:
        head = [(m, B, c0) for B in head_b for m in key3 if (m, B, c0) in grid]
        comps = head + [g for g in grid if g not in head]
    return first, comps, rest


# ---------------------------------------------------------------- slice
def _permuted_copy(key, tree, scale_dtype):
    """A layer with the same value distribution but a different function: every leaf permuted along its
    first axis (and its last, for matrices); INT4 group scales cast to `scale_dtype` (the checkpoint's bf16:
    the random init makes them float32)."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    keys = jax.random.split(key, 2 * len(leaves))
    out = []
    for i, (path, x) in enumerate(leaves):
        name = str(getattr(path[-1], "key", path[-1]))
        if x.ndim >= 1:
            x = jnp.take(x, jax.random.permutation(keys[2 * i], x.shape[0]), axis=0)
        if x.ndim >= 2:
            x = jnp.take(x, jax.random.permutation(keys[2 * i + 1], x.shape[-1]), axis=x.ndim - 1)
        if name.endswith("_scale"):
            x = x.astype(scale_dtype)
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)


def build_target_params(cfg, n_layers: int, seed: int):
    """Random params for `n_layers` layers: one jit init of a 2-layer model (dense + MoE; its INT4 scales cast
    to bf16), then permuted copies of that MoE layer for layers 2.. (compiled once)."""
    import jax
    import jax.numpy as jnp
    from kimijax.target import random_kimi_params

    base = random_kimi_params(dataclasses.replace(cfg, num_hidden_layers=min(2, n_layers)), seed)
    params = {k: v for k, v in base.items() if not k.startswith("layers_")}
    params["layers_0"] = base["layers_0"]
    if n_layers > 1:
        cast = lambda path, x: x.astype(jnp.bfloat16) if str(getattr(path[-1], "key", "")).endswith("_scale") else x
        params["layers_1"] = jax.tree_util.tree_map_with_path(cast, base.pop("layers_1"))
        del base
        copy = jax.jit(functools.partial(_permuted_copy, scale_dtype=jnp.bfloat16))
        for i in range(2, n_layers):
            params[f"layers_{i}"] = copy(jax.random.PRNGKey(seed * 1009 + i), params["layers_1"])
            jax.block_until_ready(params[f"layers_{i}"])
    return params


@dataclasses.dataclass
class Slice:
    cfg: object
    dcfg: object
    target: object
    drafter: object
    info: dict


def build_slice(args) -> Slice:
    import jax
    from kimijax.config import KIMI_K26, TINY
    from kimijax.loading import default_kernel_impl
    from kimijax.models.drafter import DrafterConfig, default_target_layer_ids, random_drafter
    from kimijax.target import KimiTarget, convert_expert_layout, resolve_expert_layout

    n = args.layers
    # smoke: TINY with D and F multiples of 128, so the planar expert path runs on CPU too
    small = dataclasses.replace(TINY, hidden_size=128, moe_intermediate_size=128, intermediate_size=256)
    cfg = dataclasses.replace(small if args.smoke else KIMI_K26, num_hidden_layers=n)
    attn_impl = args.attn_impl or args.kernels or default_kernel_impl("tree_attention")
    moe_impl = args.moe_impl or args.kernels or default_kernel_impl("moe_int4")
    norm_impl = args.norm_impl or default_kernel_impl("rms_norm")  # opt-in: not switched by --kernels
    t = time.perf_counter()
    params = build_target_params(cfg, n, args.seed)
    layout = resolve_expert_layout(cfg, moe_impl, want=args.expert_layout)
    # converted here with donation, as load_target does (the target would copy: 2x the experts' memory)
    params = convert_expert_layout(params, layout, donate=True)
    target = KimiTarget(cfg, params, attn_impl, moe_impl, random_weights=True, expert_layout=layout,
                        norm_impl=norm_impl)
    jax.block_until_ready(target.params)
    t_init = time.perf_counter() - t
    if args.smoke:
        from sharding.experiments import small_drafter_config
        dcfg = small_drafter_config(cfg, block_size=args.block_size or 4)
    else:
        # the real drafter's 6 context layers, clipped into a short slice (ids may repeat when n < 7)
        ids = tuple(min(i, n - 1) for i in default_target_layer_ids(max(n, 7), 6))
        dcfg = DrafterConfig(target_layer_ids=ids, num_target_layers=n,
                             **({"block_size": args.block_size} if args.block_size else {}))
    t = time.perf_counter()
    drafter = random_drafter(dcfg, target, seed=args.seed + 1)
    jax.block_until_ready(drafter.params)
    t_dinit = time.perf_counter() - t
    nbytes = lambda tree: sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(tree))
    dp = drafter.params
    fc = int(dp["fc"].nbytes) if "fc" in dp else 0
    info = dict(layers=n, moe_layers=sum(cfg.is_moe_layer(i) for i in range(n)), attn_impl=attn_impl,
                moe_impl=moe_impl, norm_impl=norm_impl, expert_layout=layout, weights_bytes=nbytes(params),
                drafter_bytes=nbytes(dp), drafter_fc_bytes=fc,
                drafter_layer_bytes=nbytes(dp["layers_0"]) if "layers_0" in dp else 0,
                drafter_layers=dcfg.num_hidden_layers, block_size=dcfg.block_size,
                drafter_kv_row=2 * 2 * dcfg.num_key_value_heads * dcfg.head_dim, draft_window=args.draft_window,
                init_s=t_init, drafter_init_s=t_dinit,
                cfg={k: v for k, v in dataclasses.asdict(cfg).items() if not isinstance(v, dict)},
                dcfg={k: v for k, v in dataclasses.asdict(dcfg).items() if not isinstance(v, dict)})
    print(f"slice: {n} layers ({info['moe_layers']} MoE), {info['weights_bytes'] / 1e9:.1f} GB target + "
          f"{info['drafter_bytes'] / 1e9:.1f} GB drafter, init {t_init:.1f}s + {t_dinit:.1f}s; kernels "
          f"attn={attn_impl} moe={moe_impl} norm={norm_impl}, experts in the {layout} layout", flush=True)
    return Slice(cfg, dcfg, target, drafter, info)


# ---------------------------------------------------------------- memory
def device_memory():
    """(bytes limit, bytes in use) of device 0, or (None, None) where the backend does not say (CPU)."""
    import jax
    try:
        st = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001
        st = {}
    return st.get("bytes_limit"), st.get("bytes_in_use")


def case_memory(sl: Slice, method: str, B: int, ctx: int, engine: bool) -> dict:
    """Bytes a case needs beyond the weights already resident: caches and the largest temporaries."""
    cfg, info = sl.cfg, sl.info
    T = method_budget(method) + 1
    L = ctx
    kv = B * L * kimi_bytes(cfg)["kv_row"] * (info["layers"] if engine else 1)
    dc = 0 if method == "ar" or not engine else B * drafter_slots(info, L) * info["drafter_kv_row"] * info["drafter_layers"]
    logits = 4 * B * max(T, info["block_size"]) * cfg.vocab_size * 3
    attn_tmp = 4 * B * cfg.num_attention_heads * T * L * 3 if info["attn_impl"] == "xla" else 0
    # the drafter cache is counted twice: Engine.start's (eager) context append copies it once
    return dict(kv=kv, drafter_cache=dc, temporaries=logits + attn_tmp, total=kv + 2 * dc + logits + attn_tmp)


def fits(need: int) -> tuple[bool, str]:
    limit, used = device_memory()
    if limit is None:
        return True, ""
    free = limit - used
    if need > 0.92 * free:
        return False, (f"needs ~{need / 1e9:.1f} GB (caches + temporaries) but {free / 1e9:.1f} GB of "
                       f"{limit / 1e9:.1f} GB is free next to the resident weights")
    return True, ""


# ---------------------------------------------------------------- timing helpers
def loop_ms(step, state, min_s: float = 0.3, max_n: int = 20, warm: int = 2) -> float:
    """Mean ms per call of `state = step(state)` run back to back (one block at the end), so host dispatch
    overlaps the device work of the previous call."""
    import jax
    for _ in range(warm):
        state = step(state)
    jax.block_until_ready(state)
    t = time.perf_counter()
    state = step(state)
    jax.block_until_ready(state)
    one = time.perf_counter() - t
    n = int(max(3, min(max_n, min_s / max(one, 1e-6))))
    t = time.perf_counter()
    for _ in range(n):
        state = step(state)
    jax.block_until_ready(state)
    return (time.perf_counter() - t) / n * 1e3


# ---------------------------------------------------------------- profile attribution
_LAYER = re.compile(r"/layer_(\d+)/")


def scope_category(op_name: str) -> tuple[str, int | None]:
    """(category, layer index or None) of an op from its named-scope path (see the module docstring)."""
    s = op_name
    for cat, key in (("drafter", "/draft/"), ("tree", "/tree/"), ("accept", "/accept/"), ("commit", "/commit/")):
        if key in s:
            return cat, None
    m = _LAYER.search(s)
    if m:
        i = int(m.group(1))
        for cat, keys in (("attention", ("self_attn", "/mla")), ("router", ("/router",)),
                          ("moe_shared", ("shared_expert",)), ("moe_routed", ("/experts",)),
                          ("dense_mlp", ("dense_mlp",))):
            if any(k in s for k in keys):
                return cat, i
        return "other", i
    if "logits" in s or "lm_head" in s:
        return "lm_head", None
    if "embed" in s:
        return "embed", None
    if "sample" in s:
        return "accept", None
    return "other", None


def profile_call(call, hlo_text: str, module_hint: str = "chunk") -> dict:
    """Run `call()` under jax.profiler and attribute its kernels (device planes; host thunks on CPU) to
    categories through their HLO op names. -> ms and kernel counts per category and per layer."""
    import jax

    names = op_names(hlo_text)
    dev, host = profile_events(call)
    if not dev and jax.default_backend() == "gpu":
        raise RuntimeError("the profile has no device kernel events (CUPTI unavailable?)")
    evs = dev or host
    evs = [e for e in evs if module_hint in e[1] or not e[1]]
    cat_ms, cat_n, layer_ms, layer_n, by_op = {}, {}, {}, {}, {}
    unattributed = 0.0
    for op, _, dur, kname in evs:
        on = names.get(op) or names.get(kname)
        if on is None:
            cat, li = "unattributed", None
            unattributed += dur
        else:
            cat, li = scope_category(on)
        ms = dur / 1e6
        k = (op if on is None else re.sub(r"/layer_\d+/layers_\d+/", "/layer_*/", on.split("/while/body/", 1)[-1]), cat)
        by_op[k] = by_op.get(k, 0.0) + ms
        if li is None:
            cat_ms[cat] = cat_ms.get(cat, 0.0) + ms
            cat_n[cat] = cat_n.get(cat, 0) + 1
        else:
            lm = layer_ms.setdefault(str(li), {})
            lm[cat] = lm.get(cat, 0.0) + ms
            layer_n[str(li)] = layer_n.get(str(li), 0) + 1
    total = sum(cat_ms.values()) + sum(sum(v.values()) for v in layer_ms.values())
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:20]
    return dict(source="device" if dev else "host", events=len(evs), kernel_ms=total, cat_ms=cat_ms,
                cat_n=cat_n, layer_ms=layer_ms, layer_n=layer_n, unattributed_ms=unattributed / 1e6,
                top_ops=[dict(op=k[0][-160:], category=k[1], ms=v) for k, v in top])


def scale_profile(p: dict, k: float) -> dict:
    """A profile of R rounds -> per round (k = 1/R)."""
    return dict(p, kernel_ms=p["kernel_ms"] * k, unattributed_ms=p["unattributed_ms"] * k,
                top_ops=[dict(o, ms=o["ms"] * k) for o in p.get("top_ops", [])],
                cat_ms={c: v * k for c, v in p["cat_ms"].items()}, cat_n={c: v * k for c, v in p["cat_n"].items()},
                layer_ms={l: {c: v * k for c, v in d.items()} for l, d in p["layer_ms"].items()},
                layer_n={l: v * k for l, v in p["layer_n"].items()})


# ---------------------------------------------------------------- command buffers in the HLO
_SKIP_OPS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
             "replica-id", "opt-barrier", "add-dependency", "domain"}


def command_buffer_stats(hlo_text: str) -> dict:
    """How much of a compiled XLA:GPU program runs inside command buffers (CUDA graphs), from its optimized
    HLO: XLA outlines each graph into a `command_buffer` computation called from the thunk sequence.
    Counts the ops that launch work (fusions, custom calls, copies, ...; not tuples/bitcasts/parameters) in
    the executed computations (entry, while bodies/conditions, conditional branches, called command
    buffers), overall and in the decode loop's round body (the body of the outermost while)."""
    from sharding.hlo import _CALLS, _COMP, _DEF, _OPNAME

    comps: dict[str, list] = {}
    cur, entry = None, None
    for line in hlo_text.splitlines():
        mc = _COMP.match(line)
        if mc:
            cur = mc.group(2)
            comps[cur] = []
            if mc.group(1):
                entry = cur
            continue
        md = _DEF.match(line)
        if not md or cur is None:
            continue
        mo = _OPNAME.match(md.group(2))
        if mo:
            comps[cur].append((mo.group(2), mo.group(3)))
    is_cb = lambda c: c.lstrip("%").startswith("command_buffer")

    def callees(op, rest):
        for kind, tgt in _CALLS.findall(rest):
            if kind == "calls" or (kind == "to_apply" and op != "call"):
                continue  # fusion bodies and reducers are not thunk sequences
            for c in re.findall(r"%[\w.\-]+", tgt):
                yield kind, c

    def walk(root, inside0):
        stats = dict(ops=0, ops_in_cb=0, cb_calls=0, whiles=0, conditionals=0, whiles_in_cb=0,
                     conditionals_in_cb=0)
        seen = set()
        stack = [(root, inside0)]
        while stack:
            c, inside = stack.pop()
            if (c, inside) in seen or c not in comps:
                continue
            seen.add((c, inside))
            inside_here = inside or is_cb(c)
            for op, rest in comps[c]:
                calls = list(callees(op, rest))
                if op == "call" and any(is_cb(t) for _, t in calls):
                    stats["cb_calls"] += 1
                elif op == "while":
                    stats["whiles_in_cb" if inside_here else "whiles"] += 1
                elif op == "conditional":
                    stats["conditionals_in_cb" if inside_here else "conditionals"] += 1
                elif op not in _SKIP_OPS:
                    stats["ops"] += 1
                    stats["ops_in_cb"] += int(inside_here)
                for _, t in calls:
                    stack.append((t, inside_here))
        stats["fraction_in_cb"] = stats["ops_in_cb"] / max(stats["ops"], 1)
        return stats

    out = dict(total=walk(entry, False) if entry else {}, command_buffer_computations=sum(map(is_cb, comps)))
    # The decode loop: the first while reached from the entry through plain calls (with WHILE command buffers
    # the loop itself sits inside a graph); its body is one round.
    todo, seen = [(entry, False)], set()
    while todo:
        c, inside = todo.pop(0)
        if c in seen or c not in comps:
            continue
        seen.add(c)
        hit = next((rest for op, rest in comps[c] if op == "while"), None)
        if hit is not None:
            body = re.search(r"body=(%[\w.\-]+)", hit)
            if body:
                out["round_body"] = walk(body.group(1), inside or is_cb(c))
                out["round_loop_in_command_buffer"] = inside or is_cb(c)
            break
        todo += [(t, inside or is_cb(c)) for op, rest in comps[c] if op == "call" for _, t in callees(op, rest)]
    return out


# ---------------------------------------------------------------- Engine cases
def engine_for(sl: Slice, method: str, args):
    from kimijax.engine import Engine
    if method == "ar":
        return Engine(sl.target, chunk_rounds=args.rounds)
    return Engine(sl.target, sl.drafter, method="ddtree", budget=method_budget(method), chunk_rounds=args.rounds,
                  draft_window=args.draft_window)


def decode_state(eng, B: int, L: int, S: int, seed: int = 0):
    """The Engine's decode state for B requests with L cache slots and committed length S, built by
    Engine.start with the prefill pass replaced: target and drafter caches hold random rows (the values do
    not change the cost), lengths = S."""
    import jax
    import jax.numpy as jnp

    tgt = eng.target
    max_new = L - 1 - eng.verify_width - eng.tokens_per_round  # Engine.start then picks exactly L slots

    def no_prefill(params, caches, tokens_BT, lens_B, keys_B, temp_B, topk_B, topp_B, dparams):
        extra = {}
        if eng.round is not None:
            cap = jnp.zeros((len(eng.round.capture_layers), tokens_BT.shape[0], 1, tgt.hidden_size), tgt.dtype)
            extra = eng.round.init_state(dparams, cap, lens_B, caches[0].shape[1])
        return tokens_BT[:, 0], caches, extra

    prefill = eng._prefill
    eng._prefill = jax.jit(no_prefill)
    try:
        _, st = eng.start([[1]] * B, max_new_tokens=max_new, stop_ids=[])
    finally:
        eng._prefill = prefill
    if st["caches"][0].shape[1] != L:
        raise RuntimeError(f"cache has {st['caches'][0].shape[1]} slots, wanted {L}")
    fill = _random_fill()
    key = jax.random.PRNGKey(seed)
    for name in ("caches", "dcache"):
        if name in st:
            rows = st[name]
            for i in range(len(rows)):
                key, k = jax.random.split(key)
                rows[i] = fill(k, rows[i])
    st["lengths"] = jnp.full((B,), S, jnp.int32)
    return st


@functools.lru_cache(maxsize=1)
def _random_fill():
    import jax
    return jax.jit(lambda k, x: jax.random.normal(k, x.shape, x.dtype), donate_argnums=(1,))


def run_engine_case(sl: Slice, method: str, B: int, ctx: int, args, deadline: float, hlo_out: str | None,
                    gate=None) -> dict:
    """Compile the Engine's chunk program for this case, warm it up, then (inside `gate`, if given) time
    `args.calls` calls and profile one more."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from kimijax.engine import DecodeState

    eng = engine_for(sl, method, args)
    L = ctx
    slack = args.rounds * eng.tokens_per_round + eng.verify_width + 8
    S = L - slack
    rec = dict(method=method, budget=method_budget(method), batch=B, ctx=ctx, S=S, L=L, width=eng.verify_width,
               rounds_per_call=args.rounds)
    st = decode_state(eng, B, L, S, seed=args.seed)
    dparams = None if eng.drafter is None else eng.drafter.params
    params = eng.target.params
    t = time.perf_counter()
    run = eng._chunk_program(st, dparams)
    rec["compile_s"] = time.perf_counter() - t
    hlo = run.as_text()
    rec["hlo"] = command_buffer_stats(hlo)
    if hlo_out:
        with gzip.open(hlo_out, "wt") as f:
            f.write(hlo)
        rec["hlo_file"] = os.path.basename(hlo_out)

    def reset(st):
        st = DecodeState(st)
        st["lengths"] = jnp.full((B,), S, jnp.int32)
        st["n_out"] = jnp.ones((B,), jnp.int32)
        return st

    def call(st):
        st = run(params, st, dparams, np.int32(1))
        jax.block_until_ready(st["lengths"])
        return st

    st = call(reset(st))  # warm-up (the first run of a command buffer also records it)
    times = []
    with gate or contextlib.nullcontext():
        for i in range(args.calls):
            if i >= 2 and (time.time() > deadline or sum(times) > 3.0):
                break
            st = reset(st)
            t = time.perf_counter()
            st = call(st)
            times.append(time.perf_counter() - t)
        rec["call_ms"] = [x * 1e3 for x in times]
        rec["round_ms"] = float(np.median(times)) * 1e3 / args.rounds
        if not args.no_profile:
            try:
                box = [reset(st)]

                def prof():
                    box[0] = call(box[0])

                p = profile_call(prof, hlo, "chunk")
                st = box[0]
                rec["profile"] = scale_profile(p, 1.0 / args.rounds)
            except Exception as e:  # noqa: BLE001
                rec["profile_error"] = f"{type(e).__name__}: {e}"[:400]
    if "experts" in st:
        per = np.asarray(st["experts"]) / np.maximum(np.asarray(st["n_rounds"]), 1)[:, None]
        rec["distinct_experts_per_layer"] = per.mean(axis=0).tolist()  # mean over requests, per MoE layer
    acc = np.asarray(st["acc_hist"])
    rec["mean_committed_per_round"] = float(acc[acc > 0].mean()) if (acc > 0).any() else float("nan")
    del st
    return rec


# ---------------------------------------------------------------- components
class Components:
    """Standalone jitted pieces at real width on one layer, each timed once per shape (cached)."""

    def __init__(self, sl: Slice, args):
        import jax
        self.sl, self.args = sl, args
        self.cfg = sl.cfg
        self.ms: dict = {}
        self.extra: dict = {}
        self.key = jax.random.PRNGKey(args.seed + 7)
        self.p_moe = sl.target.params["layers_1"] if sl.info["layers"] > 1 else None
        self.p_dense = sl.target.params["layers_0"]

    def _rand(self, shape, dtype):
        import jax
        self.key, k = jax.random.split(self.key)
        return jax.random.normal(k, shape, dtype)

    def _timed(self, key, build):
        if key not in self.ms:
            t = time.perf_counter()
            self.ms[key] = build()
            self.extra.setdefault("build_s", {})[str(key)] = time.perf_counter() - t
        return self.ms[key]

    def attention(self, B, T, S, L):
        import jax
        import jax.numpy as jnp
        from kimijax.models.common import causal_tree_mask
        from kimijax.models.mla import MLA

        def build():
            c, dt = self.cfg, self.sl.target.dtype
            mla = MLA(c, dt, self.sl.info["attn_impl"], norm_impl=self.sl.info["norm_impl"])
            p = (self.p_moe or self.p_dense)["self_attn"]
            # returns (attention output, updated cache): the output must be a result or XLA drops the attention
            f = jax.jit(lambda p, x, pos, cache, lens, mask: mla.apply({"params": p}, x, pos, cache, lens, mask,
                                                                       absorbed=True), donate_argnums=(3,))
            x = self._rand((B, T, c.hidden_size), dt)
            pos = jnp.broadcast_to(S + jnp.arange(T, dtype=jnp.int32), (B, T))
            lens = jnp.full((B,), S, jnp.int32)
            mask = causal_tree_mask(B, T)
            cache = self._rand((B, L, c.latent_dim), dt)
            return loop_ms(lambda st: f(p, x, pos, st[1], lens, mask), (None, cache))
        return self._timed(("attn", B, T, L), build)

    def moe(self, N, checkpoint_layout: bool = False):
        """The MoE block as the target runs it; checkpoint_layout: with the experts converted back to the
        checkpoint layout, which the kernel then re-lays out inside every call (what a target without the
        load-time conversion would do)."""
        import jax
        from kimijax.models.moe import MoE
        from kimijax.target import convert_expert_layout

        def build():
            c, dt, tg = self.cfg, self.sl.target.dtype, self.sl.target
            layout = "checkpoint" if checkpoint_layout else tg.expert_layout
            m = MoE(c, dt, self.sl.info["moe_impl"], tg.expert_fn, layout)
            f = jax.jit(lambda p, x: m.apply({"params": p}, x))
            x = self._rand((1, N, c.hidden_size), dt)
            p = self.p_moe["mlp"]
            if layout != tg.expert_layout:
                p = convert_expert_layout({"l": {"mlp": p}}, layout)["l"]["mlp"]
            return loop_ms(lambda _: f(p, x), None)
        return self._timed(("moe_ckpt" if checkpoint_layout else "moe", N), build)

    def router(self, N):
        import jax
        import numpy as np
        from kimijax.models.moe import route

        def build():
            c, dt = self.cfg, self.sl.target.dtype
            p = self.p_moe["mlp"]
            f = jax.jit(lambda g, b, x: route(x, g, b, c)[0])
            x = self._rand((N, c.hidden_size), dt)
            ids = np.asarray(f(p["gate"], p["e_score_correction_bias"], x))
            self.extra.setdefault("distinct", {})[N] = int(np.unique(ids).size)
            return loop_ms(lambda _: f(p["gate"], p["e_score_correction_bias"], x), None)
        return self._timed(("router", N), build)

    def distinct(self, N):
        self.router(N)
        return self.extra["distinct"][N]

    def dense_mlp(self, N):
        import jax
        from kimijax.models.common import MLP

        def build():
            c, dt = self.cfg, self.sl.target.dtype
            m = MLP(c.hidden_size, c.intermediate_size, dt)
            f = jax.jit(lambda p, x: m.apply({"params": p}, x))
            x = self._rand((1, N, c.hidden_size), dt)
            return loop_ms(lambda _: f(self.p_dense["mlp"], x), None)
        return self._timed(("dense_mlp", N), build)

    def head(self, N):
        import jax

        def build():
            tgt = self.sl.target
            f = jax.jit(tgt.head)
            h = self._rand((1, N, self.cfg.hidden_size), tgt.dtype)
            return loop_ms(lambda _: f(tgt.params, h), None)
        return self._timed(("head", N), build)

    def accept(self, B, T):
        import jax
        import jax.numpy as jnp
        from kimijax.spec import accept

        def build():
            f = jax.jit(accept.node_choices_batched)
            keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(B))
            lg = self._rand((B, T, self.cfg.vocab_size), jnp.float32)
            temp, top_k, top_p = jnp.zeros((B,), jnp.float32), jnp.zeros((B,), jnp.int32), jnp.ones((B,), jnp.float32)
            return loop_ms(lambda _: f(keys, lg, temp, top_k, top_p), None)
        return self._timed(("accept", B, T), build)

    def drafter(self, B, S, L, budget):
        import jax
        import jax.numpy as jnp

        def build():
            dr, tgt = self.sl.drafter, self.sl.target
            n = min(dr.cfg.block_size - 1, budget)  # the rows a budget-b tree uses, as in SpecRound.draft
            f = jax.jit(lambda dp, tp, dc, s, b: dr.draft_logits(dp, tgt, tp, dc, s, b, self.args.draft_window, n))
            Lc = drafter_slots(self.sl.info, L)  # a ring of window + block slots with --draft-window
            dc = [self._rand(x.shape, x.dtype) for x in jax.eval_shape(lambda: dr.init_cache(B, Lc))]
            s = jnp.full((B,), S, jnp.int32)
            b = jnp.ones((B,), jnp.int32)
            return loop_ms(lambda _: f(dr.params, tgt.params, dc, s, b), None)
        return self._timed(("drafter", B, L, budget), build)

    def tree(self, B, budget):
        import jax
        import jax.numpy as jnp
        from kimijax.spec.round import SpecRound

        def build():
            r = SpecRound(self.sl.target, self.sl.drafter, "ddtree", budget, None, self.args.draft_window)
            f = jax.jit(r.build_tree)
            lg = self._rand((B, r.draft_depths, self.cfg.vocab_size), jnp.float32) * 3
            return loop_ms(lambda _: f(lg), None)
        return self._timed(("tree", B, budget), build)

    def context_kv(self, B, P):
        import jax
        import jax.numpy as jnp

        def build():
            dr = self.sl.drafter
            f = jax.jit(dr.context_kv)
            feats = self._rand((dr.cfg.num_features, B, P, self.cfg.hidden_size), self.sl.target.dtype)
            pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
            return loop_ms(lambda _: f(dr.params, feats, pos), None)
        return self._timed(("ctx_kv", B, P), build)


def run_component_case(comp: Components, method: str, B: int, ctx: int, args) -> dict:
    b = method_budget(method)
    T = b + 1
    block = comp.sl.info["block_size"]
    slack = args.rounds * (1 if b == 0 else block) + T + 8
    S = ctx - slack
    N = B * T
    rec = dict(method=method, budget=b, batch=B, ctx=ctx, S=S, L=ctx, width=T)
    rec["attn_ms"] = comp.attention(B, T, S, ctx)
    if comp.p_moe is not None:
        rec["router_ms"] = comp.router(N)
        rec["moe_ms"] = comp.moe(N)
        rec["distinct_experts_batch"] = comp.distinct(N)
        if B == 1 and comp.sl.info["expert_layout"] != "checkpoint" and not any(k[0] == "moe_ckpt" for k in comp.ms):
            rec["moe_checkpoint_layout_ms"] = comp.moe(N, checkpoint_layout=True)
    rec["dense_mlp_ms"] = comp.dense_mlp(N)
    rec["head_ms"] = comp.head(N)
    rec["accept_ms"] = comp.accept(B, T)
    if b:
        dc = B * drafter_slots(comp.sl.info, ctx) * comp.sl.info["drafter_kv_row"] * comp.sl.info["drafter_layers"]
        ok, why = fits(dc + 4 * B * block * comp.cfg.vocab_size * 2)
        if ok:
            rec["drafter_ms"] = comp.drafter(B, S, ctx, b)
        else:
            rec["drafter_skipped"] = "memory: the drafter context cache " + why
        rec["tree_ms"] = comp.tree(B, b)
        rec["ctx_kv_ms"] = comp.context_kv(B, block)
    return rec


# ---------------------------------------------------------------- children
def device_header() -> dict:
    import jax
    dev = jax.devices()[0]
    return dict(device=f"{dev.platform} {dev.device_kind}", jax=jax.__version__, backend=jax.default_backend(),
                xla_flags=os.environ.get("XLA_FLAGS", ""))


def main_child(args):
    import jax
    from bench_slice import measure_roof

    deadline = args.deadline or (time.time() + args.time_limit)
    out = dict(device_header(), cases=[], components=[], skipped=[], tasks=[])
    print(f"[main] device: {out['device']}; jax {out['jax']}", flush=True)
    out["roof_bytes_per_s"] = measure_roof(0.004 if args.smoke else 4.0, reps=5 if args.smoke else 20)
    print(f"[main] HBM read roof: {out['roof_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    t = time.perf_counter()
    sl = build_slice(args)
    out["slice"] = sl.info
    out["setup_s"] = time.perf_counter() - t
    limit, used = device_memory()
    out["memory_after_setup"] = dict(limit=limit, in_use=used)
    write_json(args.child_out, out)
    engine_first, comp_cases, engine_rest = plan_cases(args)
    comp = Components(sl, args)
    est = dict(engine=args.est_engine_s, component=args.est_component_s)
    engine_s = []
    dumped = False  # the HLO of the first DDTree Engine program is saved (--hlo-dir)
    phases = [("engine", c) for c in engine_first] + [("component", c) for c in comp_cases] + \
             [("engine", c) for c in engine_rest]
    for kind, (method, B, ctx) in phases:
        key = case_key(method, B, ctx)
        left = deadline - time.time()
        if kind == "component":
            n_new = len(component_keys(comp, method, B, ctx, args) - set(comp.ms))
            need_s = n_new * est["component"]
        else:
            need_s = est["engine"]
        mem = case_memory(sl, method, B, ctx, kind == "engine")
        ok, why = fits(mem["total"])
        if not ok:
            out["skipped"].append(dict(kind=kind, case=key, reason="memory: " + why, memory=mem))
            print(f"[main] skip {kind} {key}: {why}", flush=True)
            continue
        if need_s > left:
            why = f"time limit ({left:.0f}s left, ~{need_s:.0f}s needed)"
            out["skipped"].append(dict(kind=kind, case=key, reason=why))
            print(f"[main] skip {kind} {key}: time ({left:.0f}s left, ~{need_s:.0f}s needed)", flush=True)
            continue
        t = time.perf_counter()
        try:
            if kind == "engine":
                hlo_out = None
                if method != "ar" and not dumped and args.hlo_dir:
                    hlo_out = os.path.join(args.hlo_dir, f"bench_kimi_hlo_main_{method}.txt.gz")
                    dumped = True
                rec = run_engine_case(sl, method, B, ctx, args, deadline, hlo_out)
                rec["memory"] = mem
                out["cases"].append(rec)
                msg = (f"round {rec['round_ms']:.3f} ms (compile {rec['compile_s']:.1f}s)"
                       + (f", kernels {rec['profile']['kernel_ms']:.3f} ms/round" if "profile" in rec else ""))
            else:
                n_before = len(comp.ms)
                rec = run_component_case(comp, method, B, ctx, args)
                out["components"].append(rec)
                n_new = len(comp.ms) - n_before
                msg = (f"attn {rec['attn_ms']:.3f} moe {rec.get('moe_ms', float('nan')):.3f} ms per layer "
                       f"({n_new} new programs)")
        except Exception as e:  # noqa: BLE001  (OOM, a kernel that does not compile: record and go on)
            out["skipped"].append(dict(kind=kind, case=key, reason=f"error: {type(e).__name__}: {str(e)[:300]}"))
            print(f"[main] {kind} {key} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            msg = None
        dt = time.perf_counter() - t
        out["tasks"].append(dict(kind=kind, case=key, seconds=dt))
        if msg is not None:
            if kind == "engine":
                engine_s.append(dt)
                est["engine"] = sum(engine_s) / len(engine_s)
            elif n_new:
                est["component"] = 0.5 * est["component"] + 0.5 * dt / n_new
            print(f"[main] {kind} {key}: {msg}; {dt:.1f}s", flush=True)
        out["component_build_s"] = comp.extra.get("build_s", {})
        write_json(args.child_out, out)
    jax.clear_caches()
    return out


def component_keys(comp: Components, method, B, ctx, args) -> set:
    b = method_budget(method)
    T, N = b + 1, B * (b + 1)
    keys = {("attn", B, T, ctx), ("dense_mlp", N), ("head", N), ("accept", B, T)}
    if comp.p_moe is not None:
        keys |= {("moe", N), ("router", N)}
        if B == 1 and comp.sl.info["expert_layout"] != "checkpoint" and not any(k[0] == "moe_ckpt" for k in comp.ms):
            keys.add(("moe_ckpt", N))
    if b:
        keys |= {("drafter", B, ctx), ("tree", B, b), ("ctx_kv", B, comp.sl.info["block_size"])}
    return keys


def xla_child(args):
    """One case on a small slice under this process's XLA_FLAGS (set by the parent)."""
    method, B, ctx = parse_cases(args.xla_case)[0]
    deadline = args.deadline or (time.time() + 120)
    out = dict(device_header(), variant=args.xla_variant, case=case_key(method, B, ctx))
    print(f"[xla {args.xla_variant}] XLA_FLAGS={out['xla_flags']!r}", flush=True)
    gate = TimingGate(args.sync_dir, args.xla_variant, args.sync_n, deadline)
    try:
        sargs = argparse.Namespace(**dict(vars(args), layers=args.xla_layers))
        t = time.perf_counter()
        sl = build_slice(sargs)
        out["slice"] = sl.info
        out["setup_s"] = time.perf_counter() - t
        hlo_out = os.path.join(args.hlo_dir, f"bench_kimi_hlo_{args.xla_variant}.txt.gz") \
            if args.hlo_dir and args.xla_variant in ("default", "off") else None
        rec = run_engine_case(sl, method, B, ctx, sargs, deadline, hlo_out, gate=gate)
    except Exception as e:  # noqa: BLE001
        gate.ready()  # do not keep the other children waiting
        out["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        write_json(args.child_out, out)
        raise
    out["result"] = rec
    hb = rec["hlo"].get("round_body", {})
    print(f"[xla {args.xla_variant}] {out['case']}: round {rec['round_ms']:.3f} ms; ops in command buffers "
          f"(round body) {hb.get('ops_in_cb', 0)}/{hb.get('ops', 0)}", flush=True)
    write_json(args.child_out, out)
    return out


# ---------------------------------------------------------------- parent
def start_child(argv: list[str], env: dict):
    return subprocess.Popen([sys.executable, os.path.abspath(__file__)] + argv, env=env), time.time()


def wait_child(proc, timeout: float) -> dict:
    p, t0 = proc
    try:
        rc = p.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        rc = "killed at its time limit"
    return dict(rc=rc, seconds=time.time() - t0)


class TimingGate:
    """XLA-flag children build and compile concurrently but time one at a time: each announces it is ready
    (compiled and warmed up), waits until every child is (or its deadline comes near), then times under an
    exclusive file lock, so no compile or autotuning runs on the GPU while another child is timed."""

    def __init__(self, sync_dir: str | None, name: str, n: int, deadline: float):
        self.dir, self.name, self.n, self.deadline, self.f = sync_dir, name, n, deadline, None

    def ready(self):
        if self.dir:
            open(os.path.join(self.dir, f"ready_{self.name}"), "w").close()

    def __enter__(self):
        if not self.dir:
            return self
        import fcntl
        import glob
        self.ready()
        while len(glob.glob(os.path.join(self.dir, "ready_*"))) < self.n and time.time() < self.deadline - 20:
            time.sleep(0.2)
        self.f = open(os.path.join(self.dir, "lock"), "w")
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.f is not None:
            import fcntl
            fcntl.flock(self.f, fcntl.LOCK_UN)
            self.f.close()


def child_argv(args) -> list[str]:
    """The parent's options, minus those the parent handles itself."""
    skip = {"--out", "--project-from", "--time-limit", "--calibrate-with"}
    out, it = [], iter(sys.argv[1:])
    for a in it:
        name = a.split("=", 1)[0]
        if name in skip:
            if "=" not in a:
                next(it, None)
            continue
        out.append(a)
    return out


def parent(args):
    t0 = time.time()
    deadline = t0 + args.time_limit
    work = tempfile.mkdtemp(prefix="bench_kimi_")
    hlo_dir = os.path.dirname(os.path.abspath(args.out)) if args.out else work
    os.makedirs(hlo_dir, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    if args.smoke:  # CPU check: compile fast, the numbers mean nothing anyway
        fast = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
        env["XLA_FLAGS"] = " ".join(x for x in (env.get("XLA_FLAGS", ""), fast) if x)
        os.environ["XLA_FLAGS"] = env["XLA_FLAGS"]  # the XLA-flag children start from it
    variants = [v for v in args.xla_variants.split(",") if v]
    reserve = args.xla_reserve_s if variants else 0.0
    base = child_argv(args) + ["--hlo-dir", hlo_dir]
    main_json = os.path.join(work, "main.json")
    print(f"[parent] main child until t+{args.time_limit - reserve:.0f}s, then {len(variants)} XLA-flag children",
          flush=True)
    info = wait_child(start_child(base + ["--child", "main", "--child-out", main_json, "--deadline",
                                          str(deadline - reserve)], env), deadline - reserve - time.time() + args.grace_s)
    result = json.load(open(main_json)) if os.path.exists(main_json) else dict(cases=[], components=[], skipped=[])
    result["children"] = dict(main=info)
    result.setdefault("roof_bytes_per_s", float("nan"))
    xf = dict(case=case_key(*parse_cases(args.xla_case)[0]), layers=args.xla_layers, variants=[])
    left = deadline - time.time()
    if variants and left < args.xla_min_s:
        xf["variants"] = [dict(variant=v, flags=CMD_BUFFER_FLAGS[v], error=f"skipped: {left:.0f}s left") for v in variants]
    elif variants:
        sync = os.path.join(work, "sync")
        os.makedirs(sync, exist_ok=True)
        frac = f"{min(0.95, 0.92 / len(variants)):.3f}"  # the children share the GPU's memory
        procs = {}
        for i, v in enumerate(variants):
            flags = " ".join(x for x in (os.environ.get("XLA_FLAGS", ""), CMD_BUFFER_FLAGS[v]) if x)
            extra = ["--no-profile"] if i else []  # one kernel profile serves every variant (same kernels)
            procs[v] = start_child(base + extra + [
                "--child", "xla", "--xla-variant", v, "--child-out", os.path.join(work, f"xla_{v}.json"),
                "--deadline", str(deadline), "--sync-dir", sync, "--sync-n", str(len(variants))],
                dict(env, XLA_FLAGS=flags, XLA_PYTHON_CLIENT_MEM_FRACTION=frac))
        for v in variants:
            rec = dict(variant=v, flags=CMD_BUFFER_FLAGS[v], child=wait_child(procs[v], deadline - time.time() + args.grace_s))
            out_json = os.path.join(work, f"xla_{v}.json")
            if os.path.exists(out_json):
                d = json.load(open(out_json))
                rec.update(slice_init_s=d.get("setup_s"), device=d.get("device"))
                if d.get("result"):
                    rec["result"] = d["result"]
                if d.get("error"):
                    rec["error"] = d["error"]
            else:
                rec["error"] = f"child produced nothing (rc {rec['child']['rc']})"
            xf["variants"].append(rec)
    result["xla_flags"] = xf
    result.update(command=" ".join([os.path.basename(sys.executable), "scripts/bench_kimi.py"] + sys.argv[1:]),
                  date=time.strftime("%Y-%m-%d"), total_s=time.time() - t0, args=vars(args))
    if "slice" not in result:
        print("[parent] the main child produced no slice; nothing to report")
        if args.out:
            write_json(args.out, result)
        return result
    finalize(result, args)
    report(result, args)
    return result


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=9, help="slice layers: dense layer 0 + (layers-1) MoE layers")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--budgets", default="4,8,16,32")
    ap.add_argument("--contexts", default="4k,32k", help="committed-context sizes (powers of two, e.g. 4k,32k)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds per timed Engine call (the device loop)")
    ap.add_argument("--calls", type=int, default=4, help="timed Engine calls per case (median)")
    ap.add_argument("--engine-batches", default="1", help="batches whose AR/b8/b16 cases at the first context go "
                    "through the Engine before any component (the rest follow the components)")
    ap.add_argument("--engine-cases", default=None, help="METHOD:B:CTX,... (METHOD ar|b4|b8|...): exactly these Engine "
                    "cases, first; default: the priority list (plan_cases)")
    ap.add_argument("--component-cases", default=None, help="same format; default: the whole grid, priority first")
    ap.add_argument("--kernels", default=None, help="xla | pallas (default: the engine's default)")
    ap.add_argument("--attn-impl", default=None, help="tree attention only: auto | pallas | xla (overrides --kernels)")
    ap.add_argument("--moe-impl", default=None, help="routed experts only: xla | pallas | mgpu (overrides --kernels)")
    ap.add_argument("--norm-impl", default=None, help="one-row RMSNorms: xla | pallas (opt-in kernel; default xla)")
    ap.add_argument("--expert-layout", default="auto", choices=("auto", "kernel", "mgpu", "checkpoint"),
                    help="auto: the layout of the MoE kernel that runs (checkpoint for xla)")
    ap.add_argument("--block-size", type=int, default=None, help="drafter block size (default: the config's, 8)")
    ap.add_argument("--draft-window", type=int, default=None)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=420, help="seconds for everything; cases past it are skipped")
    ap.add_argument("--est-engine-s", type=float, default=45, help="initial cost guess of an Engine case (compile+run)")
    ap.add_argument("--est-component-s", type=float, default=4, help="initial cost guess of one component program")
    ap.add_argument("--xla-variants", default="default,off,while_cond", help=f"of {sorted(CMD_BUFFER_FLAGS)}")
    ap.add_argument("--xla-case", default=None, help="METHOD:B:CTX (default b8:1:<first context>)")
    ap.add_argument("--xla-layers", type=int, default=2)
    ap.add_argument("--xla-reserve-s", type=float, default=100,
                    help="seconds kept for the XLA-flag children (they build and compile concurrently, time in turn)")
    ap.add_argument("--xla-min-s", type=float, default=15)
    ap.add_argument("--grace-s", type=float, default=30, help="a child is killed this long after its deadline")
    ap.add_argument("--full-layers", type=int, default=61)
    ap.add_argument("--acceptance", default="b8=4.48,b16=5.3",
                    help="acceptance lengths (tokens per round) of the DDTree budgets to project; AR is 1")
    ap.add_argument("--nvlink-gbs", type=float, default=900)
    ap.add_argument("--pcie-gbs", type=float, default=50)
    ap.add_argument("--coll-latency-us-nvlink", type=float, default=10)
    ap.add_argument("--coll-latency-us-pcie", type=float, default=30)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, for a CPU check of this script")
    ap.add_argument("--out", default=None)
    ap.add_argument("--project-from", default=None, help="recompute projection, table and plot from a saved JSON")
    ap.add_argument("--calibrate-with", default=None, help="JSON of a run of this script on a slice with fewer MoE "
                    "layers: adds the Engine-calibrated projection (per-layer Engine time by difference)")
    # internal (the parent starts the children with these)
    ap.add_argument("--child", choices=("main", "xla"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--xla-variant", default="default", help=argparse.SUPPRESS)
    ap.add_argument("--hlo-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sync-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sync-n", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        # two Engine programs in all (CPU compile time): DDTree b4 in the main child, AR in the XLA-flag child
        defaults = dict(layers=2, batches="1", budgets="4", contexts="128", rounds=2, calls=2,
                        engine_cases="b4:1:128", component_cases="b4:1:128", xla_case="ar:1:128",
                        acceptance="b4=3.0",
                        xla_variants="default", xla_layers=2, time_limit=120,
                        est_engine_s=5, est_component_s=0.5, xla_reserve_s=25, xla_min_s=5, grace_s=30)
        for k, v in defaults.items():
            if f"--{k.replace('_', '-')}" not in " ".join(sys.argv[1:] if argv is None else argv):
                setattr(args, k, v)
    args.batches = [int(b) for b in str(args.batches).split(",") if b]
    args.engine_batches = [int(b) for b in str(args.engine_batches).split(",") if b]
    args.budgets = [int(b) for b in str(args.budgets).split(",") if b]
    args.contexts = [parse_ctx(c) for c in str(args.contexts).split(",") if c]
    for c in args.contexts:
        if c & (c - 1) or c < 64:
            ap.error(f"context {c} must be a power of two >= 64 (the Engine buckets its cache to one)")
    if args.xla_case is None:
        args.xla_case = f"b8:1:{args.contexts[0]}" if 8 in args.budgets or args.smoke else f"ar:1:{args.contexts[0]}"
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.project_from:
        result = json.load(open(args.project_from))
        for k in ("contexts", "batches", "budgets"):  # the grid of the run; projection settings from this CLI
            if k in result.get("args", {}):
                setattr(args, k, result["args"][k])
        finalize(result, args)
        report(result, args)
        return result
    if args.child == "main":
        return main_child(args)
    if args.child == "xla":
        return xla_child(args)
    return parent(args)


if __name__ == "__main__":
    main()
