"""SwiGLU MLP of a few rows (a decode step or a small tree verify) as two Pallas kernels.

y = (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T for x [M, D] with M <= 256 (SmolLM2: D = 576, F = 1536);
more than 64 rows (a verify at concurrency 8-32) run as row blocks of 64, each reading the weights again.

Why a kernel (an experiment, opt-in: LlamaTarget(mlp_impl=...)): at one request a SmolLM2 round is launch-bound and
its 17-token verify costs about two AR steps (2.2-2.5 ms against 1.1 ms on an H100, BENCHMARKS.md 2026-12-07).
XLA runs this MLP as gate GEMM, up GEMM, silu*mul fusion and down GEMM; at 17 rows the f32 GEMMs are cuBLAS
SIMT kernels with 32x32 tiles, ~48 CTAs for 132 SMs, 5-6 us each against 2-4 us for the one-row GEMVs. Here:

  gate_up  grid (F / block_f, row blocks): program j reads its rows of x and rows j*block_f.. of w_gate and
           w_up, walks D in block_k chunks, and writes h[:, j-block] = silu(g) * u. One kernel for two GEMMs
           and the fusion.
  down     grid (D / block_d, splits, row blocks): program (i, s) sums h[:, f] w_down[i-block, f] over its
           1/splits share of F; the splits' f32 partials are added by XLA in split order (deterministic).
           `linear_pallas` is this kernel alone, for any projection of a few rows (the Llama target's q/k/v/o
           with `proj_impl`).

Measured (NVIDIA H100, 2026-12-08, `python3 -m pallas_kernels.skinny_mlp`; BENCHMARKS.md "Eighth session"):
every variant is 1.7-3.6x slower than XLA's MLP at 1, 9, 17 and 32 rows (e.g. 17 rows: XLA 34.5 us per call,
the best kernel 60.1 us, TF32x3). So the models keep XLA; the kernels stay as an opt-in record of the attempt.

Every output row depends on its own input row only, with a fixed order of additions, so one row gives the same
bits whether it runs alone (an AR step) or among 17 (a verify) - unlike cuBLAS, whose kernel choice depends on M.
Dots are IEEE f32 for f32 operands (precision HIGHEST, as the reference); "interpret" runs the same kernels on
the CPU. Sizes that are not multiples of the blocks are masked on the GPU and zero-padded in interpret mode
(the interpreter cannot slice past an array's end).

Implementations: "xla" `swiglu_ref`; "pallas" the kernels (GPU); "interpret" the kernels with interpret=True.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.tree_attention import kernel_dot, next_pow2

MAX_ROWS = 256  # more rows than this are not "a few" (prefill chunks): XLA's GEMMs are the better tool there
BLOCK_M = 64  # rows per program: a pass of more rows is split into row blocks of this many
_C11 = (((1,), (1,)), ((), ()))  # a @ b.T


def row_blocks(M: int) -> tuple[int, int]:
    """(rows per program Mp, row blocks): one block of max(16, next_pow2(M)) rows up to BLOCK_M rows (a Triton
    dot tile is >= 16 rows), else blocks of BLOCK_M. Every block sums over K in the same order, so a row's bits
    still do not depend on how many other rows the pass has."""
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"{M} rows: this kernel is for 1..{MAX_ROWS} rows (use the XLA path)")
    if M <= BLOCK_M:
        return max(16, next_pow2(M)), 1
    return BLOCK_M, -(-M // BLOCK_M)


def swiglu_ref(x_MD, w_gate_FD, w_up_FD, w_down_DF, precision=lax.Precision.HIGHEST):
    """XLA reference: [M, D] -> [M, D] f32 (the Llama MLP of kimijax.models.common.swiglu)."""
    g = jnp.einsum("md,fd->mf", x_MD, w_gate_FD, precision=precision, preferred_element_type=jnp.float32)
    u = jnp.einsum("md,fd->mf", x_MD, w_up_FD, precision=precision, preferred_element_type=jnp.float32)
    return jnp.einsum("mf,df->md", jax.nn.silu(g) * u, w_down_DF.astype(jnp.float32), precision=precision,
                      preferred_element_type=jnp.float32)


def _load(ref, rows, cols, n_rows, n_cols, masked):
    """A [len(rows), len(cols)] tile at pl.ds offsets; masked at the array's edges when sizes are ragged."""
    if not masked:
        return ref[rows, cols]
    r = rows.start + lax.broadcasted_iota(jnp.int32, (rows.size,), 0)
    c = cols.start + lax.broadcasted_iota(jnp.int32, (cols.size,), 0)
    return pltriton.load(ref.at[rows, cols], mask=(r < n_rows)[:, None] & (c < n_cols)[None, :], other=0.0)


def _store(ref, rows, cols, val, n_rows, n_cols, masked):
    if not masked:
        ref[rows, cols] = val
        return
    r = rows.start + lax.broadcasted_iota(jnp.int32, (rows.size,), 0)
    c = cols.start + lax.broadcasted_iota(jnp.int32, (cols.size,), 0)
    pltriton.store(ref.at[rows, cols], val, mask=(r < n_rows)[:, None] & (c < n_cols)[None, :])


# x has M rows; the dots run on Mp = max(16, next_pow2(M)) (a Triton dot tile): on the GPU the rows past M are
# masked loads (zeros) and masked stores, so no padded copy of x is made; interpret mode pads instead (the
# interpreter cannot slice past an array's end).
def _gate_up_kernel(x_ref, wg_ref, wu_ref, h_ref, *, Mp, D, F, bf, bk, masked, f32_dots, algo):
    j, r = pl.program_id(0), pl.program_id(1)
    M = x_ref.shape[0]
    fr, mr = pl.ds(j * bf, bf), pl.ds(r * Mp, Mp)

    def step(kk, acc):  # a traced chunk index: a static one past the end would fail the slice check
        acc_g, acc_u = acc
        kr = pl.ds(kk * bk, bk)
        x = _load(x_ref, mr, kr, M, D, masked)
        return (acc_g + kernel_dot(x, _load(wg_ref, fr, kr, F, D, masked), _C11, f32_dots, algo),
                acc_u + kernel_dot(x, _load(wu_ref, fr, kr, F, D, masked), _C11, f32_dots, algo))

    zero = jnp.zeros((Mp, bf), jnp.float32)
    acc_g, acc_u = lax.fori_loop(0, -(-D // bk), step, (zero, zero))
    h = acc_g / (1.0 + jnp.exp(-acc_g)) * acc_u  # silu(g) * u
    _store(h_ref, mr, fr, h.astype(h_ref.dtype), M, F, masked)


def _down_kernel(h_ref, wd_ref, o_ref, *, Mp, D, F, bd, bk, fs, masked, f32_dots, algo):
    i, s, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    M = h_ref.shape[0]
    dr, mr = pl.ds(i * bd, bd), pl.ds(r * Mp, Mp)

    def step(kk, acc):  # this split's share of F in block_k chunks
        kr = pl.ds(s * fs + kk * bk, bk)
        return acc + kernel_dot(_load(h_ref, mr, kr, M, F, masked), _load(wd_ref, dr, kr, D, F, masked),
                                _C11, f32_dots, algo)

    acc = lax.fori_loop(0, fs // bk, step, jnp.zeros((Mp, bd), jnp.float32))
    _store(o_ref, mr, dr, acc, M, D, masked)


def swiglu_pallas(x_MD, w_gate_FD, w_up_FD, w_down_DF, *, block_f: int = 16, block_d: int = 16, block_k: int = 64,
                  splits: int = 4, num_warps: int = 4, f32_algo: str = "ieee", interpret: bool = False):
    """The two-kernel SwiGLU (module docstring); same contract as `swiglu_ref` for M <= MAX_ROWS rows."""
    M, D = x_MD.shape
    F = w_gate_FD.shape[0]
    if w_gate_FD.shape != (F, D) or w_up_FD.shape != (F, D) or w_down_DF.shape != (D, F):
        raise ValueError(f"MLP weights {w_gate_FD.shape}, {w_up_FD.shape}, {w_down_DF.shape} do not fit x {x_MD.shape}")
    Mp, n_m = row_blocks(M)
    for name, b in (("block_f", block_f), ("block_d", block_d), ("block_k", block_k)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name}={b} must be a power of two >= 16 (Triton dot tiles)")
    n_f = -(-F // block_f)
    masked = bool(D % block_k or F % block_f) or (M < n_m * Mp and not interpret)
    x, wg, wu = x_MD, w_gate_FD, w_up_FD
    if interpret:  # the interpreter cannot slice past an array's end; the GPU masks instead
        Dp, Fp = -(-D // block_k) * block_k, n_f * block_f
        x = jnp.pad(x, ((0, n_m * Mp - M), (0, Dp - D)))
        wg, wu = (jnp.pad(w, ((0, Fp - F), (0, Dp - D))) for w in (wg, wu))
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, Mp=Mp, D=D, F=F, bf=block_f, bk=block_k, masked=masked,
                          f32_dots=interpret, algo=f32_algo),
        grid=(n_f, n_m), in_specs=[full(x), full(wg), full(wu)],
        out_specs=pl.BlockSpec((x.shape[0], wg.shape[0]), lambda j, r: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((x.shape[0], wg.shape[0]), x_MD.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2), interpret=interpret,
        name="skinny_mlp_gate_up",
    )(x, wg, wu)
    if interpret:
        h = h[:M, :F]
    return linear_pallas(h, w_down_DF, block_n=block_d, block_k=block_k, splits=splits, num_warps=num_warps,
                         f32_algo=f32_algo, interpret=interpret, name="skinny_mlp_down")


def linear_pallas(x_MK, w_NK, *, block_n: int = 16, block_k: int = 64, splits: int = 1, num_warps: int = 4,
                  f32_algo: str = "ieee", interpret: bool = False, name: str = "skinny_linear"):
    """x @ w.T for x [M, K] with M <= MAX_ROWS -> [M, N] f32: the MLP's down
    kernel alone, for any projection of a few rows. Grid (N / block_n, splits, row blocks); each split sums its
    1/splits share of K in block_k chunks and the splits' partials are added in split order (fixed, so each
    row's bits do not depend on the other rows)."""
    M, K = x_MK.shape
    N = w_NK.shape[0]
    if w_NK.shape != (N, K):
        raise ValueError(f"weight {w_NK.shape} does not fit x {x_MK.shape}")
    Mp, n_m = row_blocks(M)
    for nm, b in (("block_n", block_n), ("block_k", block_k)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{nm}={b} must be a power of two >= 16 (Triton dot tiles)")
    n_n = -(-N // block_n)
    ks = -(-(-(-K // splits)) // block_k) * block_k  # each split's share of K, a multiple of block_k
    S = -(-K // ks)
    masked = bool(K % block_k or N % block_n or K % ks) or (M < n_m * Mp and not interpret)
    x, w = x_MK, w_NK
    if interpret:  # the interpreter cannot slice past an array's end; the GPU masks instead
        Kp, Np = S * ks, n_n * block_n
        x = jnp.pad(x, ((0, n_m * Mp - M), (0, Kp - K)))
        w = jnp.pad(w, ((0, Np - N), (0, Kp - K)))
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    part = pl.pallas_call(
        functools.partial(_down_kernel, Mp=Mp, D=N, F=K, bd=block_n, bk=block_k, fs=ks, masked=masked,
                          f32_dots=interpret, algo=f32_algo),
        grid=(n_n, S, n_m), in_specs=[full(x), full(w)],
        out_specs=pl.BlockSpec((None, x.shape[0], w.shape[0]), lambda i, s, r: (s, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((S, x.shape[0], w.shape[0]), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2), interpret=interpret, name=name,
    )(x, w)
    out = part[0]
    for s in range(1, S):  # split order, so the sum is the same every call
        out = out + part[s]
    return out[:M, :N]


def swiglu(x_MD, w_gate_FD, w_up_FD, w_down_DF, *, impl: str = "xla", **kw):
    """Dispatch: impl "xla" (reference), "pallas" (GPU kernels) or "interpret"."""
    if impl == "xla":
        return swiglu_ref(x_MD, w_gate_FD, w_up_FD, w_down_DF)
    if impl in ("pallas", "interpret"):
        return swiglu_pallas(x_MD, w_gate_FD, w_up_FD, w_down_DF, interpret=impl == "interpret", **kw)
    raise ValueError(f"unknown skinny MLP impl {impl!r}")


def _main():  # pragma: no cover - timing on the GPU
    """Kernel variants vs the XLA reference at SmolLM2's MLP (D=576, F=1536, f32) for M = 1..32 rows. Time per
    call = a chain of 30 dependent calls in one jit (x + 1e-3 * mlp(x) feeds the next), like 30 layers of a
    round; the HBM read roof is measured in the same run and each time is compared with its weight floor."""
    import sys
    import time
    from pathlib import Path

    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_slice import measure_roof

    on_gpu = jax.default_backend() == "gpu"
    D, F, n = 576, 1536, 30
    roof = measure_roof() if on_gpu else float("nan")
    floor_us = 3 * D * F * 4 / roof * 1e6
    print(f"backend {jax.default_backend()}; D={D} F={F} f32; HBM read roof {roof / 1e12:.2f} TB/s, "
          f"weights 10.6 MB -> floor {floor_us:.2f} us per call; us per call (chain of {n})")
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    w = [jax.random.normal(ks[i], s, jnp.float32) * 0.04 for i, s in enumerate([(F, D), (F, D), (D, F)])]

    def per_call_us(f, x, *ws):
        ws = ws or w
        g = jax.jit(lambda x, *w: functools.reduce(lambda x, _: x + 1e-3 * f(x, *w), range(n), x))
        jax.block_until_ready(g(x, *ws))
        ts = []
        for _ in range(30):
            t = time.perf_counter()
            jax.block_until_ready(g(x, *ws))
            ts.append(time.perf_counter() - t)
        return float(np.median(ts)) / n * 1e6

    variants = {"default": {}, "bf32": dict(block_f=32), "splits2": dict(splits=2), "splits8": dict(splits=8),
                "tf32x3": dict(f32_algo="tf32x3")}  # tf32x3: three TF32 tensor-core products (not IEEE f32)
    for M in (1, 9, 17, 32, 160):  # C=1: AR, b8, b16 verifies; C=32: AR, b4 verify (row blocks)
        x = jax.random.normal(ks[3], (M, D), jnp.float32)
        r = jax.jit(swiglu_ref)(x, *w)
        t_ref = per_call_us(swiglu_ref, x) if on_gpu else float("nan")
        line = [f"M={M:2d}: XLA {t_ref:6.1f} ({t_ref / floor_us:.1f}x floor)"]
        for name, kw in variants.items():
            f = functools.partial(swiglu_pallas, interpret=not on_gpu, **kw)
            out = jax.jit(f)(x, *w)
            err = float(jnp.max(jnp.abs(out - r)) / jnp.max(jnp.abs(r)))
            t = per_call_us(f, x) if on_gpu else float("nan")
            line.append(f"{name} {t:6.1f} (err {err:.0e})")
        print(" | ".join(line), flush=True)
    # The attention's projections of a SmolLM2 layer (q and o: 576 -> 576; k and v: 576 -> 192) as one kernel each
    lin_ref = lambda x, w: jnp.einsum("mk,nk->mn", x, w, precision=lax.Precision.HIGHEST)
    for N in (576, 192):
        wl = jax.random.normal(ks[0], (N, D), jnp.float32) * 0.04
        for M in (1, 17):
            x = jax.random.normal(ks[3], (M, D), jnp.float32)
            r = jax.jit(lin_ref)(x, wl)
            wide = lambda f: lambda x, w: jnp.tile(f(x, w), (1, D // N))  # the chain needs [M, D]; every column used
            t_ref = per_call_us(wide(lin_ref), x, wl) if on_gpu else float("nan")
            line = [f"linear {N}x{D} M={M:2d}: XLA {t_ref:6.1f}"]
            for name, kw in {"default": {}, "bn32": dict(block_n=32), "splits2": dict(splits=2),
                             "bk32": dict(block_k=32),
                             "tf32x3": dict(f32_algo="tf32x3")}.items():
                f = functools.partial(linear_pallas, interpret=not on_gpu, **kw)
                out = jax.jit(f)(x, wl)
                err = float(jnp.max(jnp.abs(out - r)) / jnp.max(jnp.abs(r)))
                t = per_call_us(wide(f), x, wl) if on_gpu else float("nan")
                line.append(f"{name} {t:6.1f} (err {err:.0e})")
            print(" | ".join(line), flush=True)
    # Row independence (module docstring): a verify row vs the same row alone (an AR step), bit for bit, in a
    # C=1 b16 verify (17 rows) and a C=32 b4 verify (160 rows: three row blocks)
    for M in (17, 160):
        x = jax.random.normal(ks[3], (M, D), jnp.float32)
        rows = range(M) if M <= 17 else (0, 1, 63, 64, 100, 128, 159)
        for name, f in (("XLA", swiglu_ref), ("kernel", functools.partial(swiglu_pallas, interpret=not on_gpu))):
            many = np.asarray(jax.jit(f)(x, *w))
            same = sum(bool(np.array_equal(np.asarray(jax.jit(f)(x[i:i + 1], *w))[0], many[i])) for i in rows)
            print(f"{name}: {same}/{len(rows)} rows bitwise equal alone and among {M}")


if __name__ == "__main__":  # pragma: no cover
    _main()
