#!/usr/bin/env python3
"""Offline look at the Pallas Triton kernels' GPU code, no GPU needed: lowers a kernel at full Kimi width for a
pretend H200, compiles each pallas_call's Triton IR with pip Triton for sm_90 and prints what decides its speed:
registers, spills, shared memory, asynchronous (LDGSTS) vs synchronous (LDG) global loads, tensor-core ops
(HGMMA) and waits on them.  This is how the INT4 MoE's synchronous scale loads were found (BENCHMARKS.md,
"Kernels"); timings still come from scripts/bench_kernels.py on the GPU.

  pip install triton==3.6.0          # any venv with jax; Triton bundles ptxas and cuobjdump
  python scripts/triton_sass.py moe [--tokens 9] [--kwargs "block_f=32,steps=2"] [--keep DIR]
  python scripts/triton_sass.py mla [--tokens 9] [--heads 8] [--kwargs "block_m=32,block_k=64"]

`mla` is the MLA tree attention (pallas_kernels/tree_attention.py) with `--heads` query heads per device
(64 on one GPU or under expert parallelism, 8 under tensor parallelism over 8 GPUs).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import moe_int4 as mi  # noqa: E402
from pallas_kernels import tree_attention as ta  # noqa: E402
from pallas_kernels.gpu_lowering import triton_ir  # noqa: E402

E, F, D, K = 384, 2048, 7168, 8  # Kimi K2.6 routed experts
MLA_C, MLA_K = 576, 512  # latent cache row: [c_kv (512) | k_pe (64)]


def lower_kernels(T: int, kwargs: dict) -> dict[str, str]:
    """-> {pallas_call name: Triton IR text} of moe_pallas at T tokens (kernel layout, full width)."""
    S = jax.ShapeDtypeStruct
    words = S((E, F * D // 128, 16), jnp.int32)
    experts = {"gate_planar": words, "up_planar": words, "down_planar": words,
               "gate_scale_t": S((E, D // 64, F), jnp.int32), "up_scale_t": S((E, D // 64, F), jnp.int32),
               "down_scale_t": S((E, F // 64, D), jnp.int32)}
    return triton_ir(functools.partial(mi.moe_pallas, **kwargs), S((T, D), jnp.bfloat16), S((T, K), jnp.int32),
                     S((T, K), jnp.float32), experts)


def lower_mla(T: int, heads: int, L: int, B: int, kwargs: dict) -> dict[str, str]:
    """-> {pallas_call name: Triton IR text} of the MLA tree attention kernel at T query tokens x `heads`."""
    S = jax.ShapeDtypeStruct
    fn = functools.partial(ta.tree_attention_pallas, scale=1.0 / 192 ** 0.5, kv_rank=MLA_K, **kwargs)
    return triton_ir(fn, S((B, T, heads, MLA_C), jnp.bfloat16), S((B, L, MLA_C), jnp.bfloat16),
                     S((B,), jnp.int32), S((B, T, T), jnp.bool_))


def mla_launch(T: int, heads: int, kwargs: dict) -> tuple[int, int]:
    """(num_warps, num_stages) the MLA kernel launches with (its defaults when not given)."""
    bm = kwargs.get("block_m") or min(64, max(16, ta.next_pow2(T * heads)))
    return kwargs.get("num_warps") or (8 if bm >= 64 else 4), kwargs.get("num_stages") or 2


def compile_report(name: str, ttir: str, workdir: str, num_warps: int, num_stages: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget

    path = os.path.join(workdir, f"{name}.ttir")
    with open(path, "w") as fh:
        fh.write(ttir)
    k = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                            num_stages=num_stages))
    cubin = os.path.join(workdir, f"{name}.cubin")
    with open(cubin, "wb") as fh:
        fh.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    with open(os.path.join(workdir, f"{name}.sass"), "w") as fh:
        fh.write(sass)
    ops = collections.Counter(m.group(1).split(".")[0] for m in
                              re.finditer(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M))
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    regs, stack, _, local = usage.groups() if usage else ("?",) * 4
    return (f"{name:14s} regs {regs:>4s} stack {stack} local {local} shared {k.metadata.shared:>6d} B | "
            f"LDGSTS {ops['LDGSTS']:3d} LDG {ops['LDG']:3d} HGMMA {ops['HGMMA']:3d} HMMA {ops['HMMA']:3d} "
            f"wgmma waits {sass.count('WARPGROUP.DEPBAR'):3d} FADD {ops['FADD']:3d} HFMA2 {ops['HFMA2']:3d} "
            f"HMUL2 {ops['HMUL2']:3d} LOP3 {ops['LOP3']:3d} | {sass.count(chr(10))} SASS lines")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", choices=("moe", "mla"), help="INT4 MoE or MLA tree attention")
    ap.add_argument("--tokens", type=int, default=9, help="T (MoE: <= 16 takes the dense routing path, else sorted)")
    ap.add_argument("--heads", type=int, default=64, help="mla: query heads on the device (8 under TP-8)")
    ap.add_argument("--context", type=int, default=4096, help="mla: cache length L")
    ap.add_argument("--kwargs", default="", help='kernel options, e.g. "block_f=32,steps=2" or "block_m=32"')
    ap.add_argument("--keep", default=None, help="write .ttir/.cubin/.sass here (default: a temporary dir)")
    args = ap.parse_args()
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("needs pip Triton for the offline compile: pip install triton==3.6.0")
    kwargs = eval(f"dict({args.kwargs})")  # a developer's command line, not user input
    if args.kernel == "moe":
        kernels = lower_kernels(args.tokens, kwargs)
        warps, stages = kwargs.get("num_warps", 4), kwargs.get("num_stages", 3)
    else:
        kernels = lower_mla(args.tokens, args.heads, args.context, 1, kwargs)
        warps, stages = mla_launch(args.tokens, args.heads, kwargs)
    workdir = args.keep or tempfile.mkdtemp(prefix="triton_sass_")
    os.makedirs(workdir, exist_ok=True)
    what = f"T={args.tokens}" + (f" H={args.heads} L={args.context}" if args.kernel == "mla" else "")
    print(f"{args.kernel} {what} {kwargs or 'defaults'}: sm_90, {warps} warps, {stages} stages; files in {workdir}")
    for name, ttir in kernels.items():
        print(compile_report(name, ttir, workdir, warps, stages))


if __name__ == "__main__":
    main()
