"""Compile for an H200 on a CPU-only host: XLA's deviceless GPU compilation, for the questions that need the
GPU compiler but not the GPU (how many kernels a compiled round launches, what a Mosaic GPU kernel's SASS
looks like). Timings still come from the device scripts.

Set-up (a separate venv: the CUDA plugin must not be in the one the tests use), once:

  cp -a .venv /tmp/gvenv     # or any py3.12 venv with kimijax's requirements
  /tmp/gvenv/bin/python -m pip install "jax-cuda13-plugin[with-cuda]==0.11.2" nvidia-cuda-nvdisasm

This script skips the plugin's version checks (they need a driver); the plugin then fails to make a GPU
client (no driver), jax falls back to the CPU backend, and XLA's GPU compiler still runs for a topology
built from a target description (`h200_target.txtpb`, written from the
H200's public specifications; the compiler reads its compute capability, SM count, shared memory and
bandwidth). Without a device XLA does not autotune, so GEMM algorithm choices can differ from the device's;
fusion decisions and kernel counts do not depend on autotuning except for GEMM fusions.

  python scripts/offline_gpu.py kernels --what moe --tokens 1            # a compiled program's launches
  python scripts/offline_gpu.py kernels --what attn --tokens 1 --list     # the MLA block, launch by launch
  python scripts/offline_gpu.py kernels --what layer --tokens 1            # a whole Kimi MoE layer
  python scripts/offline_gpu.py sass --words [--config vector_loads=1]    # Mosaic GPU MoE: SASS + main loop
  python scripts/offline_gpu.py kernels --what round --method ddtree:16 [--commit-impl pallas] [--tree-impl pallas]
  python scripts/offline_gpu.py mesh --layout tp8 --tokens 9   # the MLA kernel on 8 GPUs: GSPMD vs shard_map

(PYTHONPATH=. and the side venv's python.) Measured this way (2026-12-07): the MLA block at T=1 over a 4k
cache (donated, as in the model) was 19 launches, as the GPU profile of 2026-12-04 counted, and is 17 since
one request's cache write is a plain update-slice (pallas_kernels/row_move.write_rows) and the attention's
split merge sums its weights as an output column; one gate/up pipeline
step of the Mosaic GPU MoE is 928 instructions per warp with int4 tiles, 848 with vector loads, 654 with
thread words.
"""

from __future__ import annotations

import collections
import functools
import os
import re
from pathlib import Path

import kernel_switches

TARGET = Path(__file__).resolve().parent / "h200_target.txtpb"
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # before jax picks its backends

# Ops of a scheduled HLO computation that launch nothing (or are folded into their users).
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
         "replica-id", "opt-barrier", "add-dependency", "domain"}


@functools.cache
def device():
    """A pretend H200 (XLA GPU topology from TARGET): the device to put ShapeDtypeStructs on."""
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc("h200", "cuda", target_config=TARGET.read_text(), topology="1x1x1")
    except NotImplementedError as e:
        raise SystemExit("no CUDA plugin in this Python: see scripts/offline_gpu.py for the set-up") from e
    return topo.devices[0]


@functools.cache
def devices(n: int):
    """n pretend H200s of one host (the topology of an 8-GPU box for n = 8)."""
    from jax.experimental import topologies

    return topologies.get_topology_desc("h200", "cuda", target_config=TARGET.read_text(),
                                        topology=f"1x1x{n}").devices


def abstract(tree):
    """Arrays / ShapeDtypeStructs -> ShapeDtypeStructs on the pretend H200."""
    import jax
    from jax.sharding import SingleDeviceSharding

    s = SingleDeviceSharding(device())
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree)


def compile_for_gpu(fn, *args, static_argnums=(), donate_argnums=()):
    """-> the compiled executable of jit(fn) for the pretend H200 (args: arrays or ShapeDtypeStructs). Pallas
    Triton kernels lower with the H200's GPU info (their lowering asks the local GPU otherwise). Donate what
    the real program donates (caches): an undonated buffer updated in place costs a copy launch."""
    import jax
    from jax._src.pallas.triton import gpu_info, pallas_call_registration as reg

    keep = lambda a: getattr(a, "sharding", None) is not None and not hasattr(a, "devices")  # placed structs
    dyn = tuple(a if i in static_argnums or keep(a) else abstract(a) for i, a in enumerate(args))
    info = reg.gpu_info_lib.get_gpu_info
    reg.gpu_info_lib.get_gpu_info = lambda: gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
    try:
        lowered = jax.jit(fn, static_argnums=static_argnums, donate_argnums=donate_argnums).trace(*dyn).lower(
            lowering_platforms=("cuda",))
    finally:
        reg.gpu_info_lib.get_gpu_info = info
    return lowered.compile()


_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?:\([^()]*\)|\S+)\s+([a-z][\w\-]*)\(")
_CALLS = re.compile(r"(?:body|condition|to_apply|calls|branch_computations|true_computation|"
                    r"false_computation)=(\{[^}]*\}|%?[\w.\-]+)")


def launches(hlo: str, in_loop: bool = False) -> list[tuple[str, str, str]]:
    """The launches of a compiled (scheduled) HLO module in order, as (kind, instruction name, op_name
    metadata), walking the entry computation and the computations it runs through while / conditional /
    call (command-buffer calls included; a fusion is one launch, its body is not entered). A while body is
    walked once (one iteration); every branch of a conditional is walked, so counts under a conditional
    (e.g. the sampler's greedy / sampling branches) are an upper bound. in_loop: only the launches inside
    while loops (per iteration)."""
    comps, cur = {}, None
    entry = None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            cur = m.group(1)
            comps[cur] = []
            if line.startswith("ENTRY"):
                entry = cur
            continue
        if cur is not None and line.strip() == "}":
            cur = None
            continue
        if cur is not None:
            comps[cur].append(re.sub(r"/\*.*?\*/", "", line))
    out: list[tuple[str, str, str]] = []
    seen = set()

    def walk(name, loop=False):
        if name in seen or name not in comps:
            return
        seen.add(name)
        for line in comps[name]:
            m = _INSTR.match(line)
            if not m:
                continue
            op = m.group(1)
            if op in ("while", "conditional", "call"):
                for grp in _CALLS.findall(line):
                    for callee in grp.strip("{}").replace("%", "").split(","):
                        walk(callee.strip(), loop or op == "while")
                continue
            if in_loop and not loop:
                continue
            if op in _FREE:
                continue
            if op == "custom-call":
                tgt = re.search(r'custom_call_target="([^"]+)"', line)
                op = f"custom-call:{tgt.group(1) if tgt else '?'}"
            elif op == "fusion":
                kind = re.search(r"kind=(\w+)", line)
                op = f"fusion:{kind.group(1) if kind else '?'}"
            name = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)", line).group(1)
            meta = re.search(r'op_name="([^"]*)"', line)
            out.append((op, name, meta.group(1) if meta else ""))

    if entry is not None:
        walk(entry)
    return out


def count_kernels(hlo: str, in_loop: bool = False) -> dict:
    """Launches per kind (see `launches`)."""
    return dict(collections.Counter(k for k, _, _ in launches(hlo, in_loop)).most_common())


def mosaic_sass(compile_fn, workdir: str) -> dict[str, dict]:
    """Compile (compile_fn()) with Mosaic GPU's PTX dumps on, assemble each kernel's PTX with the plugin's
    ptxas for sm_90a and disassemble it: {kernel: {ptxas info, instruction counts of its main loop}}. The
    main loop is taken to be the longest branch-free run of instructions (a pipeline step, unrolled)."""
    import glob
    import subprocess

    import nvidia

    bin_dir = Path(nvidia.__path__[0]) / "cu13" / "bin"
    os.makedirs(workdir, exist_ok=True)
    for f in glob.glob(os.path.join(workdir, "*")):
        os.remove(f)
    os.environ.update(MOSAIC_GPU_DUMP_TO=workdir, MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1")
    try:
        compile_fn()
    finally:
        for k in ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_PTXAS"):
            os.environ.pop(k, None)
    out = {}
    for ptx in sorted(glob.glob(os.path.join(workdir, "*.ptx"))):
        base = ptx[:-4]
        subprocess.run([str(bin_dir / "ptxas"), "-arch=sm_90a", "-O3", ptx, "-o", base + ".cubin"], check=True)
        sass = subprocess.run([str(bin_dir / "nvdisasm"), "-c", base + ".cubin"], check=True, capture_output=True,
                              text=True).stdout
        Path(base + ".sass").write_text(sass)
        ins = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)]
        loop, start = [], 0
        for i, op in enumerate(ins):
            if op.startswith("BRA"):
                if i - start > len(loop):
                    loop = ins[start:i]
                start = i + 1
        info = Path(base + ".ptxas").read_text() if os.path.exists(base + ".ptxas") else ""
        regs = re.search(r"Used (\d+) registers", info)
        spill = re.search(r"(\d+) bytes spill stores", info)
        out[os.path.basename(base)] = dict(
            registers=int(regs.group(1)) if regs else None, spill_bytes=int(spill.group(1)) if spill else None,
            loop_len=len(loop), loop_ops=dict(collections.Counter(op.split(".")[0] for op in loop).most_common()))
    return out


def _moe(T: int, backend: str, cfg=None, words: bool = False):
    import jax
    import jax.numpy as jnp

    E, D, F, K = 384, 7168, 2048, 8
    S = jax.ShapeDtypeStruct
    x, ids, w = S((T, D), jnp.bfloat16), S((T, K), jnp.int32), S((T, K), jnp.float32)
    from pallas_kernels.moe_int4_mgpu import Config, layout_shapes, moe_mgpu
    if backend == "mgpu":
        return compile_for_gpu(functools.partial(moe_mgpu, cfg=cfg or Config()), x, ids, w,
                               layout_shapes(E, D, F, words))
    from pallas_kernels.moe_int4 import moe
    from pallas_kernels.moe_layout import checkpoint_shapes, relayout_for_kernel
    ex = jax.eval_shape(relayout_for_kernel, checkpoint_shapes(E, D, F))
    return compile_for_gpu(lambda *a: moe(*a, impl="pallas"), x, ids, w, ex)


def _kimi_block(module, T: int, L: int):
    """Compile `module` (called as (x, positions, cache, lengths, tree mask, absorbed=True)) at full Kimi K2.6 width
    for B = 1, T tokens over an L-slot latent cache, donated as in the model."""
    import jax
    import jax.numpy as jnp
    from flax.core import meta

    from kimijax.config import KIMI_K26 as cfg
    from kimijax.models.common import causal_tree_mask

    S = jax.ShapeDtypeStruct
    args = (S((1, T, cfg.hidden_size), jnp.bfloat16), S((1, T), jnp.int32),
            S((1, L, cfg.kv_lora_rank + cfg.qk_rope_head_dim), jnp.bfloat16), S((1,), jnp.int32))
    mask = causal_tree_mask(1, T)
    p = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *(jnp.zeros(a.shape, a.dtype) for a in args), mask,
                                           absorbed=True))["params"]
    return compile_for_gpu(lambda p, *a: module.apply({"params": meta.unbox(p)}, *a, absorbed=True),
                           p, *args, mask, donate_argnums=(3,))


def _attn(T: int, L: int, impl: str):
    """The absorbed MLA block of one full-width Kimi K2.6 layer (scripts/profile_block.py --block attn)."""
    import jax.numpy as jnp

    from kimijax.config import KIMI_K26 as cfg
    from kimijax.models.mla import MLA

    return _kimi_block(MLA(cfg, jnp.bfloat16, impl), T, L)


def _layer(T: int, L: int, impl: str, moe_impl: str = "pallas", norm_impl: str = "xla"):
    """One full-width Kimi K2.6 MoE decoder layer (norms, absorbed MLA, router, INT4 experts in the layout of
    the MoE kernel that runs: "pallas" the Triton kernel, "mgpu" the Mosaic GPU one; shared expert)."""
    import jax.numpy as jnp

    from kimijax.config import KIMI_K26 as cfg
    from kimijax.models.kimi import DecoderLayer
    from kimijax.target import LAYOUT_OF_IMPL

    return _kimi_block(DecoderLayer(cfg, True, jnp.bfloat16, impl, moe_impl, None, LAYOUT_OF_IMPL[moe_impl],
                                    norm_impl=norm_impl), T, L)


def _attn_on_mesh(layout: str, T: int, L: int, B: int, shard: bool):
    """The MLA tree attention kernel at Kimi width (64 heads) on pretend H200s in `layout`, q split by heads over
    "tensor" as the model's projections leave it: under sharding.attention_tp (shard=True) or left to GSPMD."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from pallas_kernels.tree_attention import tree_attention
    from sharding.attention_tp import make_attention_fn
    from sharding.mesh import layout_devices, make_mesh
    from sharding.rules import batch_axis

    mesh = make_mesh(layout, devices(layout_devices(layout)))
    b = batch_axis(mesh, B)
    S = lambda shape, dt, *spec: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P(*spec)))
    args = (S((B, T, 64, 576), jnp.bfloat16, b, None, "tensor", None), S((B, L, 576), jnp.bfloat16, b),
            S((B,), jnp.int32, b), S((B, T, T), jnp.bool_, b))
    attend = make_attention_fn(mesh) if shard else tree_attention
    return compile_for_gpu(lambda *a: attend(*a, 0.07, 512, impl="pallas"), *args)


def _mesh_report(hlo: str) -> str:
    """All-gathers and the kernel's query rows per device in a compiled mesh program."""
    gathers = len(re.findall(r"= [^=]*\ball-gather(?:-start)?\(", hlo))
    kernel_out = r"= \(f32\[\d+,\d+,(\d+),\d+\][^=]*custom-call\(.*__gpu\$xla\.gpu\.triton"  # o [B, S, rows, K]
    rows = [m.group(1) for m in re.finditer(kernel_out, hlo)]
    return f"{gathers} all-gathers; the kernel's query rows per device (padded to its blocks): {', '.join(rows) or '?'}"


def _round(method: str, budget: int, C: int, prompt_len: int = 256, rounds: int = 16, mlp_impl: str = "xla",
           proj_impl: str = "xla", commit_impl: str = "xla", tree_impl: str = "xla"):
    """The Engine's chunk program (`rounds` decode rounds in the device loop) for the embedded default's shapes
    (SmolLM2-135M in float32 + a drafter with the committed drafter's config, random weights), with the GPU's
    attention kernel, as scripts/profile_round.py runs it. The start state is made on the CPU (reference
    attention); the compiled program gets an identical target except for the kernel choice."""
    import dataclasses
    import json

    import numpy as np

    import kimijax
    from kimijax.defaults import smollm2_drafter_dir
    from kimijax.models.drafter import DrafterConfig, random_drafter
    from kimijax.models.llama import SMOLLM2_135M, random_llama_target

    target = random_llama_target(dataclasses.replace(SMOLLM2_135M, dtype="float32"), attn_impl="xla")
    hf = json.loads((smollm2_drafter_dir() / "config.json").read_text())
    drafter = random_drafter(DrafterConfig.from_hf(hf, dtype="float32"), target) if method != "ar" else None

    def engine(t, kernels=kimijax.RoundKernels()):
        return kimijax.Engine(t, drafter, method=method, budget=max(budget, 1), chunk_rounds=rounds,
                              round_kernels=kernels)

    eng = engine(target)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, target.vocab_size, prompt_len).tolist() for _ in range(C)]
    _, st = eng.start(prompts, max_new_tokens=rounds * eng.tokens_per_round + 1, stop_ids=[])
    gpu = engine(dataclasses.replace(target, attn_impl="pallas", mlp_impl=mlp_impl, proj_impl=proj_impl),
                 kimijax.RoundKernels(tree=tree_impl, commit=commit_impl))
    dparams = None if drafter is None else drafter.params
    return compile_for_gpu(gpu._chunk_fn, target.params, st, dparams, np.int32(1), rounds, False,
                           static_argnums=(4, 5), donate_argnums=(1,))


def main(argv=None) -> int:
    import argparse
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["kernels", "sass", "mesh"])
    ap.add_argument("--layout", default="tp8", help="mesh: the sharding layout (sharding.make_mesh)")
    ap.add_argument("--batch", type=int, default=1, help="mesh: requests")
    ap.add_argument("--what", default="moe", choices=["moe", "attn", "layer", "round"])
    ap.add_argument("--method", default="ddtree:16", help="round: ar, dflash or ddtree:N")
    ap.add_argument("--concurrency", type=int, default=1, help="round: batch rows")
    kernel_switches.add_args(ap)  # round: the opt-in kernels
    ap.add_argument("--impl", default="pallas", help="attn: tree attention impl (pallas, xla, auto)")
    ap.add_argument("--context", type=int, default=4096, help="attn: cache slots L")
    ap.add_argument("--list", action="store_true", help="print every launch with its op_name")
    ap.add_argument("--config", default="", help="sass: moe_int4_mgpu.Config fields, e.g. vector_loads=1,stages=4")
    ap.add_argument("--keep", default="/tmp/kimijax_sass", help="sass: where the PTX / SASS files go")
    ap.add_argument("--words", action="store_true", help="moe mgpu: experts in the thread-words layout")
    ap.add_argument("--backend", default="mgpu", choices=["mgpu", "triton"])
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--moe-impl", default="pallas", choices=["pallas", "mgpu"], help="layer: the MoE kernel")
    ap.add_argument("--norm-impl", default="xla", choices=["xla", "pallas"],
                    help="layer: the one-row norms (the model's default: xla)")
    ap.add_argument("--attn-combine", default="xla", choices=["xla", "pallas"],
                    help="attn / layer: how the attention kernel's key splits merge (XLA's or one kernel)")
    args = ap.parse_args(argv)
    if args.cmd == "sass":
        from pallas_kernels.moe_int4_mgpu import Config
        kw = {k: int(v) for k, v in (kv.split("=") for kv in args.config.split(",") if kv)}
        cfg = Config(**{k: (bool(v) if isinstance(getattr(Config(), k), bool) else v) for k, v in kw.items()})
        rep = mosaic_sass(lambda: _moe(args.tokens, "mgpu", cfg, args.words), args.keep)
        for name, r in rep.items():
            print(f"{name}: {r['registers']} registers, {r['spill_bytes']} B spilled; main loop "
                  f"{r['loop_len']} instructions: " + " ".join(f"{k} {v}" for k, v in r["loop_ops"].items()))
        return 0
    if args.attn_combine != "xla":  # an experiment switch, not a model field: set the kernel's default here
        from pallas_kernels import tree_attention as ta
        ta.tree_attention_pallas = functools.partial(ta.tree_attention_pallas, combine=args.attn_combine)
    if args.cmd == "mesh":  # the tree attention on a mesh: left to GSPMD vs sharding.attention_tp
        for shard in (False, True):
            c = _attn_on_mesh(args.layout, args.tokens, args.context, args.batch, shard)
            print(f"{args.layout}, B={args.batch} T={args.tokens} L={args.context}, "
                  f"{'shard_map (sharding.attention_tp)' if shard else 'left to GSPMD'}: {_mesh_report(c.as_text())}")
        return 0
    if args.what == "moe":
        c = _moe(args.tokens, args.backend, words=args.words)
    elif args.what == "attn":
        c = _attn(args.tokens, args.context, args.impl)
    elif args.what == "layer":
        c = _layer(args.tokens, args.context, args.impl, args.moe_impl, args.norm_impl)
    else:
        name, _, b = args.method.partition(":")
        c = _round(name, int(b or 0), args.concurrency, mlp_impl=args.mlp_impl, proj_impl=args.proj_impl,
                   commit_impl=args.commit_impl, tree_impl=args.tree_impl)
    hlo = c.as_text()
    if os.environ.get("OFFLINE_HLO"):  # the optimized HLO text, for reading what a launch is
        Path(os.environ["OFFLINE_HLO"]).write_text(hlo)
    if args.what == "round":  # per stage of the round, as scripts/profile_round.py groups them
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from profile_round import scope_key
        per = launches(hlo, in_loop=True)
        by = collections.Counter(scope_key(meta, 2)[0] if meta else "(no op_name)" for _, _, meta in per)
        print(f"{len(per)} launches per round (the device loop's body, one round); per stage: "
              + ", ".join(f"{k} {v}" for k, v in by.most_common()))
    if args.list:
        for kind, name, meta in launches(hlo):
            print(f"{kind:32s} {name:40s} {meta[-110:]}")
    n = count_kernels(hlo)
    print(f"{sum(n.values())} launches: " + ", ".join(f"{k} {v}" for k, v in n.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
