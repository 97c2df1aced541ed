"""Shared timing helpers for the benchmark scripts (GPU runs): median wall time of jitted calls and the
per-stage split of one speculative round (draft, tree, verify, accept+commit); kernel events from
jax.profiler and the HLO op names (named-scope paths) that attribute them."""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np


def median_time(fn, *args, reps: int = 20, warmup: int = 2) -> float:
    """Median seconds of fn(*args) (block_until_ready each call; includes one dispatch per call)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def time_jit_sets(fn, arg_sets, reps: int = 10, profile_runs: int = 3) -> dict:
    """fn(*args) for each args in arg_sets inside one jit, timed back to back. -> wall_s (median seconds per
    call), compile_s, and on the GPU (profile_runs > 0) kernel_us (the profiler's device time per call) and
    kernels_us (the six largest kernels by name, us per call)."""
    multi = jax.jit(lambda sets: [fn(*s) for s in sets])
    t = time.perf_counter()
    jax.block_until_ready(multi(arg_sets))
    out = {"compile_s": time.perf_counter() - t}
    jax.block_until_ready(multi(arg_sets))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(multi(arg_sets))
        ts.append(time.perf_counter() - t)
    out["wall_s"] = float(np.median(ts)) / len(arg_sets)
    if jax.default_backend() == "gpu" and profile_runs:
        dev, _ = profile_events(lambda: [jax.block_until_ready(multi(arg_sets)) for _ in range(profile_runs)])
        per = {}
        for _op, _mod, ns, ev in dev:
            per[ev] = per.get(ev, 0.0) + ns / 1e3 / (profile_runs * len(arg_sets))
        out["kernel_us"] = sum(per.values())
        out["kernels_us"] = dict(sorted(per.items(), key=lambda kv: -kv[1])[:6])
    return out


def round_split(engine, prompts, round_s: float, reps: int = 20) -> dict:
    """Time each stage of a round standalone on the state after prefill; accept+commit is the remainder of
    the measured in-loop round time. Returns milliseconds."""
    r = engine.round
    _, st = engine.start(prompts, max_new_tokens=8, stop_ids=[])
    tp, dp = engine.target.params, engine.drafter.params
    S, bonus = st["lengths"], st["bonus"]
    f_draft = jax.jit(r.draft)
    dl = f_draft(dp, tp, st["dcache"], S, bonus)
    f_tree = jax.jit(r.build_tree)
    tree = f_tree(dl)
    tokens = jnp.where(jnp.arange(r.width)[None] == 0, bonus[:, None], jnp.maximum(tree.tokens, 0))
    pos = S[:, None] + tree.depths
    f_verify = jax.jit(lambda p, c, tok, pos, S, m: r.target.verify(p, c, tok, pos, S, m, r.capture_layers)[0])
    out = dict(draft_ms=median_time(f_draft, dp, tp, st["dcache"], S, bonus, reps=reps) * 1e3,
               tree_ms=median_time(f_tree, dl, reps=reps) * 1e3,
               verify_ms=median_time(f_verify, tp, st["caches"], tokens, pos, S, tree.ancestor_mask, reps=reps) * 1e3)
    # Each standalone stage also pays one dispatch + sync that the in-loop round does not, so this remainder
    # underestimates accept+commit and can go negative; it is reported as measured, not clipped.
    out["accept_commit_ms"] = round_s * 1e3 - out["draft_ms"] - out["tree_ms"] - out["verify_ms"]
    return out


# ---------------------------------------------------------------- profiler events -> named scopes
_OPNAME_META = re.compile(r'^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=.*?op_name="([^"]*)"')


def op_names(hlo_text: str) -> dict:
    """HLO instruction name -> its op_name metadata (the jax named-scope path); also under the kernel-name
    spelling ('.' and '-' -> '_'), since XLA:GPU names a fusion's kernel after the fusion."""
    out = {}
    for line in hlo_text.splitlines():
        m = _OPNAME_META.match(line)
        if m:
            out[m.group(1)] = m.group(2)
            out.setdefault(m.group(1).replace(".", "_").replace("-", "_"), m.group(2))
    return out


def profile_events(call):
    """Run `call()` under jax.profiler. -> (device events, host events), each a list of
    (hlo op, hlo module, duration ns, event name). Device events are the stream lines' kernels and copies
    (a command buffer that XLA kept shows up as one event without an HLO op); host events are XLA:CPU's thunks."""
    from jax.profiler import ProfileData

    d = tempfile.mkdtemp(prefix="kimijax_prof_")
    dev, host = [], []
    try:
        jax.profiler.start_trace(d)
        try:
            call()
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not files:
            raise RuntimeError("the profiler wrote no xplane.pb")
        pdata = ProfileData.from_file(files[0])
        warnings.filterwarnings("ignore", message=".*event_stats.*", category=DeprecationWarning)
        for plane in pdata.planes:
            is_dev = plane.name.startswith("/device:")
            lines = list(plane.lines)
            if is_dev:  # kernel and memcpy activity lives on the stream lines; skip derived summary lines
                lines = [l for l in lines if l.name.lower().startswith("stream")] or lines
            for line in lines:
                for ev in line.events:
                    st = dict(ev.stats)
                    op = st.get("hlo_op") or (ev.name if is_dev else None)
                    if op:
                        (dev if is_dev else host).append((str(op), str(st.get("hlo_module", "")),
                                                          float(ev.duration_ns), ev.name))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return dev, host
