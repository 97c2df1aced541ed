"""Routed-expert MoE over INT4 (compressed-tensors pack-quantized) or bf16 expert weights.

Expert weights of one layer (stacked on E; see kimijax/quant.py for the INT4 bit layout):
  INT4: gate_packed/up_packed int32 [E, F, D/8], gate_scale/up_scale bf16 [E, F, D/32],
        down_packed int32 [E, D, F/8], down_scale bf16 [E, D, F/32]
  bf16: gate/up [E, F, D], down [E, D, F]
  INT4, kernel layout (made once at load time by `relayout_for_kernel`):
        gate_planar/up_planar int32 [E, F*D/128, 16], gate_scale_t/up_scale_t int32 [E, D/64, F],
        down_planar int32 [E, D*F/128, 16], down_scale_t int32 [E, F/64, D]
y[t] = sum_k w[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]),  e = ids[t, k].

Kernel layout ("planar", made once at load time; pallas_kernels/moe_layout.py says what and why): INT4
words unpacked in registers by one shift + lop3 + bf16x2 fma per plane, scales as 32-bit words that Triton's
pipeliner can prefetch, each loop iteration's weights one contiguous tile.  Handing the checkpoint layout to
the kernel re-lays the whole layer out on every call (correct but slow: 36.5 ms vs 0.285 ms per Kimi layer at
T=1 on the H200, with the previous kernel), so `KimiTarget` stores the kernel layout (`kimijax/target.py`,
`convert_expert_layout`) and the savers convert back with `relayout_to_checkpoint`.  The kernel multiplies each
plane by its row's scale (bf16(q * s), the reference's rounding) and accumulates plane x the matching 32
activations into one f32 tile (one accumulating MMA per plane).

Implementations (`moe(..., impl=...)`): "xla" (`moe_ref`), "pallas" / "interpret" (these Triton-lowered
kernels on the GPU / on the CPU for tests), "mgpu" / "mgpu_interpret" (the Mosaic GPU kernels of
moe_int4_mgpu.py, opt-in, experts in their own layout).  `default_impl()`: "pallas" on GPU.

Kernel design (two pallas_calls + a few tiny XLA ops):
  1. gate/up: grid (U work slots, F / block_f).  A slot is one used expert; its program streams the
     expert's gate and up rows [block_f, D] once (INT4 dequantised in registers, or bf16), multiplies all
     tokens routed to that expert (chunks of NB = 16 tokens; a chunk loop only for experts with > 16
     tokens), applies SwiGLU and writes h [columns, F] in bf16 (as the reference rounds h; F-contiguous,
     so the down kernel's reads of a column's F slice are vector loads that Triton pipelines even when the
     columns are sorted pairs).
  2. down: grid (U, D / block_d): each slot streams its expert's down rows [block_d, F] once, multiplies
     the slot's h columns, scales by the routing weights and atomically adds into y [T+1, D] f32 (valid
     lanes only on the GPU; row T is the dump row padding lanes point at).  y[:T] is cast to x's dtype.
  Routing metadata:
   * T <= 16 ("dense"): no XLA glue.  Slot u = pair u = (t, k) of ids; the program exits unless pair u is
     the first occurrence of its expert, and treats all T tokens as one chunk masked by "routes to e"
     (h columns u*T .. u*T + T - 1).
   * T > 16 ("sorted"): XLA sorts the T*K pairs by expert (argsort of T*K ints) and builds U = min(T*K, E)
     slots (expert id, first sorted pair, pair count); slot u's columns are its sorted pairs.
  Every used expert's weights are read from HBM once per call (once per 16-token chunk for an expert that
  gets more than 16 tokens, i.e. only in prefill-sized batches); the y accumulation order is not fixed
  (float atomics), so results may differ in the last f32 bit between runs.
Shape limits of the kernel: INT4 and bf16 need D and F divisible by 128, and block_f / block_d must divide
F / D (defaults 64 / 128, halved until they divide).  Other shapes fall back to `moe_ref` (explicitly, in
`moe`).  Backend: the Triton lowering of Pallas (`pl.pallas_call` + `pltriton.CompilerParams`): it runs
under interpret=True on CPU for the tests; the Mosaic GPU backend is moe_int4_mgpu.py (measured since).
Measured on an H200 (BENCHMARKS.md, "Kernels", kernel time from the profiler, read roof 3.63 TB/s in that
run): INT4 streams 1.87 TB/s at T = 1 and 2.4-2.5 TB/s from T = 9 up (52 % and 65-68 % of the roof), the bf16
variant 4.1-4.5 TB/s (the roof is a loose lower bound).  So INT4 is not bandwidth-bound: the unpack + scale ALU
work (4 ops per plane and word) and one MMA wait per plane pair remain in every loop iteration.  Tried and
dropped (same page): split-K for small T (gate/up -10 % at T = 1, eaten by the extra reduction), 8 warps, 2 or
4 pipeline stages.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton  # Triton lowering (deprecated in jax 0.11, working)

from kimijax.quant import dequantize
from pallas_kernels import moe_int4_mgpu as mg
from pallas_kernels.moe_layout import SB, TILE_DN, TILE_GU, checkpoint_shapes, dequant_expert, relayout_for_kernel
from pallas_kernels.tree_attention import next_pow2

NB = 16  # token columns per chunk (tensor-core N)
BF16_STEP = 128  # inputs per step of the bf16-weight variant


def default_impl() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "xla"


# ----------------------------------------------------------------------------------------------
# XLA reference
# ----------------------------------------------------------------------------------------------


def _expert_weights(experts: dict, e, dtype):
    if "gate_packed" in experts:
        g = dequantize(experts["gate_packed"][e], experts["gate_scale"][e], dtype)
        u = dequantize(experts["up_packed"][e], experts["up_scale"][e], dtype)
        d = dequantize(experts["down_packed"][e], experts["down_scale"][e], dtype)
    elif "gate_planar" in experts:
        g, u, d = (dequant_expert(n, experts[f"{n}_planar"][e], experts[f"{n}_scale_t"][e], dtype)
                   for n in ("gate", "up", "down"))
    elif "gu_q" in experts:
        g, u, d = mg.expert_weights(experts, e, dtype)
    else:
        g, u, d = (experts[k][e].astype(dtype) for k in ("gate", "up", "down"))
    return g, u, d


def num_experts(experts: dict) -> int:
    for k in ("gate_packed", "gate_planar", "gu_q", "gate"):
        if k in experts:
            return experts[k].shape[0]
    raise KeyError("expert dict has none of gate_packed / gate_planar / gu_q / gate")


def moe_ref(x_TD, ids_TK, w_TK, experts: dict):
    """XLA reference: dequantizes only the experts in use, one at a time (never the whole layer)."""
    T, K = ids_TK.shape
    E = num_experts(experts)
    U = min(T * K, E)
    used_U = jnp.unique(ids_TK.reshape(-1), size=U, fill_value=-1)
    dtype = x_TD.dtype

    def body(acc_TD, e):
        def compute(acc_TD):
            g_FD, u_FD, d_DF = _expert_weights(experts, e, dtype)
            h_TF = jax.nn.silu(jnp.einsum("td,fd->tf", x_TD, g_FD, preferred_element_type=jnp.float32))
            h_TF = h_TF * jnp.einsum("td,fd->tf", x_TD, u_FD, preferred_element_type=jnp.float32)
            y_TD = jnp.einsum("tf,df->td", h_TF.astype(dtype), d_DF, preferred_element_type=jnp.float32)
            wt_T = jnp.sum(jnp.where(ids_TK == e, w_TK, 0.0), axis=1)
            return acc_TD + wt_T[:, None] * y_TD

        return jax.lax.cond(e >= 0, compute, lambda a: a, acc_TD), None

    acc_TD, _ = jax.lax.scan(body, jnp.zeros(x_TD.shape, jnp.float32), used_U)
    return acc_TD.astype(dtype)


# ----------------------------------------------------------------------------------------------
# Pallas kernels
# ----------------------------------------------------------------------------------------------


def _mm(a, b, f32_operands):
    """a [m, k] @ b [k, n] -> f32.  Interpret mode upcasts (XLA:CPU lacks bf16 x bf16 -> f32 in loops)."""
    if f32_operands:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _plane_asm(i: int, scaled: bool) -> str:
    # one int32 word -> the bf16 pair (q[32i + 2m], q[32i + 2m + 1]): nibbles i and i + 4, each or-ed
    # into the bf16 pattern of 128 + v (0x4300 | v), then 128 + v - 136 = v - 8 = q exactly (bf16x2 fma);
    # scaled: times the row's scale word {s, s} ($3, made once per row by `_scale_word`) in one more bf16x2
    # fma (+ -0.0), i.e. bf16(q * s) as the reference.
    shift = f"shr.b32 t, $2, {4 * i};" if i else "mov.b32 t, $2;"
    asm = ("{ .reg .b32 t, one, off, nz; mov.b32 one, 0x3F803F80; mov.b32 off, 0xC308C308; " + shift +
           " lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 t, t, one, off;")
    if scaled:
        asm += " mov.b32 nz, 0x80008000; fma.rn.bf16x2 t, t, $3, nz;"
    return asm + " mov.b32 {$0, $1}, t; }"


def _make_plane_asm_primitive():
    """Primitive (int32 words [r, n], optional scale words {s, s} [r, n]) -> bf16 [r, 2n] (plane i, static), lowered
    to one inline-asm op with two bf16 results, joined and reshaped (the Pallas elementwise_inline_asm
    wrapper cannot return two results).  GPU (Triton lowering) only; interpret mode uses `_plane`'s jnp
    formulation."""
    from jax._src import core as jax_core
    from jax._src.interpreters import mlir
    from jax._src.lib.triton import dialect as tt_dialect
    from jax._src.pallas.triton import lowering as tl

    prim = jax_core.Primitive("kimijax_int4_plane")

    @prim.def_abstract_eval
    def _abstract(words, *scale, i):
        return jax_core.ShapedArray((*words.shape[:-1], 2 * words.shape[-1]), jnp.bfloat16)

    @tl.register_lowering(prim)
    def _lower(ctx, words, *scale, i):
        half = jax_core.ShapedArray(ctx.avals_in[0].shape, jnp.bfloat16)
        ty = mlir.aval_to_ir_type(ctx.context.mlir_ctx, half)
        res = tt_dialect.elementwise_inline_asm([ty, ty], _plane_asm(i, bool(scale)),
                                               constraints="=h,=h,r" + (",r" if scale else ""), pure=True,
                                               packed_element=1, args=[words, *scale])
        lo, hi = list(res)
        joined = tt_dialect.join(tl.get_join_type(tl.ir.RankedTensorType(lo.type)), lo, hi)
        return tl._reshape(joined, ctx.avals_out[0].shape)

    return prim


_PLANE_ASM_P = None
_DOT_ACC_P = None


def _make_dot_acc_primitive():
    """Primitive (acc f32 [m, n], a [m, k], b [k, n]) -> acc + a @ b, lowered to one tt.dot with `acc` as its
    accumulator.  JAX lowers `acc + dot(a, b)` to a dot from zero plus a separate add, which Triton does not
    fuse for floats (it would reassociate), so each MMA had to finish before the add (a wgmma wait per dot).
    GPU (Triton lowering) only."""
    from jax._src import core as jax_core
    from jax._src.lib.triton import dialect as tt_dialect
    from jax._src.pallas.triton import lowering as tl

    prim = jax_core.Primitive("kimijax_dot_acc")

    @prim.def_abstract_eval
    def _abstract(acc, a, b):
        return jax_core.ShapedArray(acc.shape, acc.dtype)

    @tl.register_lowering(prim)
    def _lower(ctx, acc, a, b):
        return tt_dialect.dot(a, b, acc)

    return prim


def _mma(acc, a, b, native: bool):
    """acc + a @ b in f32: one accumulating tt.dot on the GPU (native), a dot and an add otherwise."""
    global _DOT_ACC_P
    if not native:
        return acc + _mm(a, b, True)
    if _DOT_ACC_P is None:
        _DOT_ACC_P = _make_dot_acc_primitive()
    return _DOT_ACC_P.bind(acc, a, b)


def _plane(words, i, use_asm, scale=None):
    """words int32 [rows, 16] (one superblock) -> plane i as bf16 [rows, 32]: q of inputs 32 i .. 32 i + 31,
    or bf16(q * s[row]) when scale (int32 words {s, s} [rows], `_scale_word`) is given (the reference's
    dequantisation)."""
    global _PLANE_ASM_P
    rows, n = words.shape
    if use_asm:
        if _PLANE_ASM_P is None:
            _PLANE_ASM_P = _make_plane_asm_primitive()
        sc = () if scale is None else (jnp.broadcast_to(scale[:, None], (rows, n)),)
        return _PLANE_ASM_P.bind(words, *sc, i=i)
    lo = (((words >> (4 * i)) & 0xF) - 8).astype(jnp.float32).astype(jnp.bfloat16)
    hi = (((words >> (4 * i + 16)) & 0xF) - 8).astype(jnp.float32).astype(jnp.bfloat16)
    q = jnp.stack([lo, hi], axis=-1).reshape(rows, 2 * n)
    if scale is not None:  # a {s, s} word: s in the high 16 bits
        scale = lax.bitcast_convert_type(scale & jnp.int32(-65536), jnp.float32).astype(jnp.bfloat16)
    return q if scale is None else q * scale[:, None]


def _scale_word(sv, i):
    """Paired scale words [rows] (low / high 16 bits: the bf16 scales of planes 2j / 2j + 1) -> plane i's
    scale as one bf16x2 word {s, s} per row, made once per row (not per weight word)."""
    hi = (sv & jnp.int32(-65536)) if i % 2 else (sv << 16)
    return hi | lax.shift_right_logical(hi, 16)


def _tile_row(r0, sa, n_other, tile_rows, *, sb_major):
    """First row (in the [E, rows, 16] tiled words) of the rows r0 .. of superblock sa; see `_tile`."""
    blk, off = r0 // tile_rows, r0 % tile_rows
    t = sa * n_other + blk if sb_major else blk * n_other + sa
    return t * tile_rows + off


def _slot_info(u, c, route, *, dense, T, K, Kp):
    """-> (expert e, active flag, n_chunks, cols [NB], tok [NB] (clamped), valid [NB], wt [NB] f32).

    Dense: slot u owns h columns u*T .. u*T + T - 1 (one per token; lanes j >= T use spare columns)."""
    j = lax.broadcasted_iota(jnp.int32, (NB,), 0)
    if dense:
        ids_ref, w_ref = route
        e = ids_ref[u // K, u % K]
        tt = lax.broadcasted_iota(jnp.int32, (NB, Kp), 0)
        kk = lax.broadcasted_iota(jnp.int32, (NB, Kp), 1)
        ok = (tt < T) & (kk < K)
        ids2 = jnp.where(ok, ids_ref[jnp.minimum(tt, T - 1), jnp.minimum(kk, K - 1)], -1)
        hit = ids2 == e
        dup = jnp.sum(jnp.where(hit & (tt * K + kk < u), 1, 0)) > 0
        active = (e >= 0) & jnp.logical_not(dup)
        hit_i = jnp.where(hit, 1, 0)
        valid = jnp.sum(hit_i, axis=1) > 0
        wt = None
        if w_ref is not None:
            w2 = w_ref[jnp.minimum(tt, T - 1), jnp.minimum(kk, K - 1)].astype(jnp.float32)
            wt = jnp.sum(jnp.where(hit, w2, 0.0), axis=1)
        tok = jnp.minimum(j, T - 1)
        cols = jnp.where(j < T, u * T + j, K * T * T + j)  # lanes j >= T: the NB spare columns, never written
        return e, active, 1, cols, tok, valid, wt
    sexp_ref, sstart_ref, scount_ref, stok_ref, sw_ref = route
    e = sexp_ref[u]
    start = sstart_ref[u]
    count = scount_ref[u]
    active = (e >= 0) & (count > 0)
    n_chunks = (count + NB - 1) // NB
    P = stok_ref.shape[0]
    idx = start + c * NB + j
    valid = idx < start + count
    src = jnp.minimum(idx, P - 1)
    tok = stok_ref[src]
    wt = None if sw_ref is None else jnp.where(valid, sw_ref[src], 0.0)
    cols = jnp.where(valid, idx, P + j)  # padding lanes use the NB spare columns P.., never duplicates
    return e, active, n_chunks, cols, tok, valid, wt


def _run_chunks(n_chunks, chunk, quant):
    """chunk(c, ()) for c < n_chunks.  bf16 weights: the common single-chunk case runs outside any loop
    (measured 1.8x faster on the sorted path at T = 33 / 129).  INT4: one loop for every case (a second
    copy of the large unrolled body measured slower; see BENCHMARKS.md)."""
    if quant:
        lax.fori_loop(0, n_chunks, chunk, ())
        return
    if isinstance(n_chunks, int):
        for c in range(n_chunks):
            chunk(c, ())
        return

    @pl.when(n_chunks == 1)
    def _():
        chunk(0, ())

    @pl.when(n_chunks > 1)
    def _():
        lax.fori_loop(0, n_chunks, chunk, ())


def _gate_up_kernel(*refs, dense, quant, T, K, Kp, D, BF, SPS, f32_dots, use_asm):
    nroute = 2 if dense else 5
    route = refs[:nroute]
    if dense:
        route = (route[0], None)
    else:
        route = route[:4] + (None,)
    if quant:
        x_ref, g_ref, gs_ref, u_ref, us_ref, h_ref = refs[nroute:]
    else:
        x_ref, g_ref, u_ref, h_ref = refs[nroute:]
    u = pl.program_id(0)
    f0 = pl.program_id(1) * BF
    e, active, n_chunks, *_ = _slot_info(u, 0, route, dense=dense, T=T, K=K, Kp=Kp)
    frows = f0 + lax.broadcasted_iota(jnp.int32, (BF,), 0)

    @pl.when(active)
    def _():
        def chunk(c, carry):
            _, _, _, cols, tok, valid, _ = _slot_info(u, c, route, dense=dense, T=T, K=K, Kp=Kp)
            acc0 = (jnp.zeros((BF, NB), jnp.float32), jnp.zeros((BF, NB), jnp.float32))
            if quant:
                def step(s, accs):
                    acc_g, acc_u = accs
                    for sb in range(SPS):  # SPS superblocks of 128 inputs per loop iteration
                        sa = s * SPS + sb
                        r0 = _tile_row(f0, sa, D // SB, TILE_GU, sb_major=False)  # [BF, 16] int32, contiguous
                        wg = g_ref[e, pl.ds(r0, BF), :]
                        wu = u_ref[e, pl.ds(r0, BF), :]
                        for i in range(4):
                            d = sa * SB + i * 32 + lax.broadcasted_iota(jnp.int32, (32, NB), 0)
                            xp = x_ref[jnp.broadcast_to(tok[None, :], (32, NB)), d]  # [32, NB] bf16
                            if i % 2 == 0:  # one word vector holds the [BF] scales of planes i and i + 1
                                sg = gs_ref[e, sa * 2 + i // 2, pl.ds(f0, BF)]
                                su = us_ref[e, sa * 2 + i // 2, pl.ds(f0, BF)]
                            acc_g = _mma(acc_g, _plane(wg, i, use_asm, _scale_word(sg, i)), xp, use_asm)
                            acc_u = _mma(acc_u, _plane(wu, i, use_asm, _scale_word(su, i)), xp, use_asm)
                    return acc_g, acc_u

                acc_g, acc_u = lax.fori_loop(0, D // (SB * SPS), step, acc0)
            else:
                STEP = BF16_STEP * SPS

                def step(s, accs):
                    acc_g, acc_u = accs
                    d = s * STEP + lax.broadcasted_iota(jnp.int32, (STEP, NB), 0)
                    xp = x_ref[jnp.broadcast_to(tok[None, :], (STEP, NB)), d]
                    wg = g_ref[e, pl.ds(f0, BF), pl.ds(s * STEP, STEP)]
                    wu = u_ref[e, pl.ds(f0, BF), pl.ds(s * STEP, STEP)]
                    return acc_g + _mm(wg, xp, f32_dots), acc_u + _mm(wu, xp, f32_dots)

                acc_g, acc_u = lax.fori_loop(0, D // STEP, step, acc0)
            rows2 = jnp.broadcast_to(frows[:, None], (BF, NB))
            cols2 = jnp.broadcast_to(cols[None, :], (BF, NB))
            lane = lax.broadcasted_iota(jnp.int32, (NB,), 0)
            keep = jnp.broadcast_to((lane < T if dense else valid)[None, :], (BF, NB))  # dense: the slot's T columns
            h = acc_g / (1.0 + jnp.exp(-acc_g)) * acc_u
            pltriton.store(h_ref.at[cols2, rows2], h.astype(h_ref.dtype), mask=keep)
            return carry

        _run_chunks(n_chunks, chunk, quant)


def _down_kernel(*refs, dense, quant, T, K, Kp, D, F, BD, SPS, f32_dots, use_asm, masked_atomics):
    nroute = 2 if dense else 5
    route = refs[:nroute]
    if quant:
        h_ref, d_ref, ds_ref, _, y_ref = refs[nroute:]
    else:
        h_ref, d_ref, _, y_ref = refs[nroute:]
    u = pl.program_id(0)
    d0 = pl.program_id(1) * BD
    e, active, n_chunks, *_ = _slot_info(u, 0, route, dense=dense, T=T, K=K, Kp=Kp)
    drows = d0 + lax.broadcasted_iota(jnp.int32, (BD,), 0)

    @pl.when(active)
    def _():
        def chunk(c, carry):
            _, _, _, cols, tok, valid, wt = _slot_info(u, c, route, dense=dense, T=T, K=K, Kp=Kp)
            acc0 = jnp.zeros((BD, NB), jnp.float32)
            if quant:
                def step(s, acc):
                    for sb in range(SPS):
                        sa = s * SPS + sb
                        wd = d_ref[e, pl.ds(_tile_row(d0, sa, D // TILE_DN, TILE_DN, sb_major=True), BD), :]
                        for i in range(4):
                            f = sa * SB + i * 32 + lax.broadcasted_iota(jnp.int32, (32, NB), 0)
                            hp = h_ref[jnp.broadcast_to(cols[None, :], (32, NB)), f]  # [32, NB], F-contiguous
                            if i % 2 == 0:
                                sd = ds_ref[e, sa * 2 + i // 2, pl.ds(d0, BD)]
                            acc = _mma(acc, _plane(wd, i, use_asm, _scale_word(sd, i)), hp, use_asm)
                    return acc

                acc = lax.fori_loop(0, F // (SB * SPS), step, acc0)
            else:
                STEP = BF16_STEP * SPS

                def step(s, acc):
                    f = s * STEP + lax.broadcasted_iota(jnp.int32, (STEP, NB), 0)
                    hp = h_ref[jnp.broadcast_to(cols[None, :], (STEP, NB)), f]
                    wd = d_ref[e, pl.ds(d0, BD), pl.ds(s * STEP, STEP)]
                    return acc + _mm(wd, hp, f32_dots)

                acc = lax.fori_loop(0, F // STEP, step, acc0)
            val = acc * jnp.where(valid, wt, 0.0)[None, :]
            # atomics for valid lanes only (H200: -15 % / -30 % down-kernel time at T = 9 / 33 against adding 0
            # from every padding lane into one dump row); the interpreter has no masked atomics, so there the
            # padding lanes still add 0 into the dump row T
            rows = jnp.where(valid, tok, T)
            pltriton.atomic_add(y_ref, (jnp.broadcast_to(rows[None, :], (BD, NB)),
                                        jnp.broadcast_to(drows[:, None], (BD, NB))), val,
                                mask=jnp.broadcast_to(valid[None, :], (BD, NB)) if masked_atomics else None)
            return carry

        _run_chunks(n_chunks, chunk, quant)


def _fit_block(n: int, want: int) -> int:
    b = want
    while b > 16 and n % b:
        b //= 2
    return b if n % b == 0 else 0


def kernel_supports(x_TD, experts: dict) -> bool:
    D = x_TD.shape[1]
    if "gate" in experts:
        F = experts["gate"].shape[1]
        return D % BF16_STEP == 0 and F % BF16_STEP == 0
    F = experts["gate_scale_t"].shape[2] if "gate_planar" in experts else experts["gate_packed"].shape[1]
    return D % SB == 0 and F % SB == 0


def moe_pallas(x_TD, ids_TK, w_TK, experts: dict, *, block_f: int | None = None, block_d: int | None = None,
               steps: int | None = None, num_warps: int = 4, num_stages: int = 3, dense_max_tokens: int = NB,
               use_asm: bool = True, min_programs: int = 0, interpret: bool = False):
    """Pallas MoE (see module docstring).  Same contract as `moe_ref`.

    block_f / block_d: rows of gate/up resp. down per program (default 64 / 128, the INT4 tile heights, which
    they must divide; halved down to 32 while fewer than `min_programs` programs would have work: off by
    default, it measured slower at T = 1); steps: 128-input superblocks (INT4) or 128-input slices (bf16) per
    loop iteration (default 1); use_asm: inline-PTX INT4 unpack (else shifts + converts)."""
    if "gate_packed" in experts:
        experts = relayout_for_kernel(experts)
    quant = "gate_planar" in experts
    T, D = x_TD.shape
    K = ids_TK.shape[1]
    E = num_experts(experts)
    F = experts["gate_scale_t"].shape[2] if quant else experts["gate"].shape[1]
    n_work = min(T * K, E)  # upper bound on experts with work
    if block_f is None:
        block_f = 64
        while block_f > 32 and n_work * (F // block_f) < min_programs:
            block_f //= 2
    if block_d is None:
        block_d = 128
        while block_d > 32 and n_work * (D // block_d) < min_programs:
            block_d //= 2
    BF = _fit_block(F, block_f)
    BD = _fit_block(D, block_d)
    if not BF or not BD:
        raise ValueError(f"no block size fits F={F}, D={D}")
    if steps is None:
        steps = 1
    SPS_gu = mg.fit_divisor(D // SB, steps)
    SPS_dn = mg.fit_divisor(F // SB, steps)
    P = T * K
    dense = T <= min(dense_max_tokens, NB)
    Kp = next_pow2(K)
    ids_TK = ids_TK.astype(jnp.int32)
    w_TK = w_TK.astype(jnp.float32)
    if dense:
        U = P
        ncols = P * T + NB
        route = (ids_TK, w_TK)
    else:
        U = min(P, E)
        flat = ids_TK.reshape(-1)
        order = jnp.argsort(flat, stable=True).astype(jnp.int32)
        sorted_e = flat[order]
        first = jnp.concatenate([jnp.ones((1,), bool), sorted_e[1:] != sorted_e[:-1]])
        slot = jnp.cumsum(first.astype(jnp.int32)) - 1
        tgt = jnp.where(first, slot, U)  # non-first pairs scatter out of range (dropped)
        pos = jnp.arange(P, dtype=jnp.int32)
        s_exp = jnp.full((U,), -1, jnp.int32).at[tgt].set(sorted_e, mode="drop")
        s_start = jnp.zeros((U,), jnp.int32).at[tgt].set(pos, mode="drop")
        s_count = jnp.zeros((U,), jnp.int32).at[slot].add(1, mode="drop")
        s_tok = order // K
        s_w = w_TK.reshape(-1)[order]
        ncols = P + NB
        route = (s_exp, s_start, s_count, s_tok, s_w)
    def params(rows, sps):  # fewer pipeline stages where the stage buffers would not fit in shared memory
        per_stage = (2 * rows * (64 if quant else 256) + NB * 256 + (16 * rows if quant else 0)) * sps
        stages = num_stages
        while stages > 2 and stages * per_stage > 200_000:
            stages -= 1
        return pltriton.CompilerParams(num_warps=num_warps, num_stages=stages)

    if quant and (TILE_GU % BF or TILE_DN % BD):
        raise ValueError(f"INT4 blocks {BF} / {BD} must divide the weight tiles ({TILE_GU} / {TILE_DN} rows)")
    common = dict(dense=dense, quant=quant, T=T, K=K, Kp=Kp, D=D, f32_dots=interpret,
                  use_asm=use_asm and not interpret)

    if quant:
        w_in = (experts["gate_planar"], experts["gate_scale_t"], experts["up_planar"], experts["up_scale_t"])
        d_in = (experts["down_planar"], experts["down_scale_t"])
    else:
        w_in = (experts["gate"], experts["up"])
        d_in = (experts["down"],)
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, BF=BF, SPS=SPS_gu, **common),
        grid=(U, F // BF),
        out_shape=jax.ShapeDtypeStruct((ncols, F), x_TD.dtype),
        compiler_params=params(BF, SPS_gu),
        interpret=interpret,
        name="moe_gate_up",
    )(*route, x_TD, *w_in)
    y0 = jnp.zeros((T + 1, D), jnp.float32)
    n_in = len(route) + 1 + len(d_in) + 1
    y = pl.pallas_call(
        functools.partial(_down_kernel, F=F, BD=BD, SPS=SPS_dn, masked_atomics=not interpret, **common),
        grid=(U, D // BD),
        out_shape=jax.ShapeDtypeStruct((T + 1, D), jnp.float32),
        input_output_aliases={n_in - 1: 0},
        compiler_params=params(BD // 2, SPS_dn),
        interpret=interpret,
        name="moe_down",
    )(*route, h, *d_in, y0)
    return y[:T].astype(x_TD.dtype)


IMPLS = ("xla", "pallas", "interpret", "mgpu", "mgpu_interpret")


def moe(x_TD, ids_TK, w_TK, experts: dict, *, impl: str = "xla"):
    """Dispatch point used by the model (impls: module docstring). Shapes or layouts a kernel does not take
    run `moe_ref` instead; the Mosaic kernels take any T (`moe_int4_mgpu.moe_mgpu_chunks`)."""
    if impl == "xla":
        return moe_ref(x_TD, ids_TK, w_TK, experts)
    if impl in ("pallas", "interpret"):
        if not kernel_supports(x_TD, experts):
            return moe_ref(x_TD, ids_TK, w_TK, experts)
        return moe_pallas(x_TD, ids_TK, w_TK, experts, interpret=impl == "interpret")
    if impl in ("mgpu", "mgpu_interpret"):
        if "gu_q" not in experts or not mg.supports(x_TD[:1], experts):
            return moe_ref(x_TD, ids_TK, w_TK, experts)
        return mg.moe_mgpu_chunks(x_TD, ids_TK, w_TK, experts, interpret=impl == "mgpu_interpret")
    raise ValueError(f"unknown MoE impl {impl!r}: choose one of {', '.join(IMPLS)}")


def _main():  # pragma: no cover - manual check / timing of one case
    import time

    on_gpu = jax.default_backend() == "gpu"
    E, F, D, K, T = (384, 2048, 7168, 8, 9) if on_gpu else (8, 256, 512, 2, 5)
    ks = jax.random.split(jax.random.key(int(time.time())), 9)
    rand = lambda k, s: (lax.bitcast_convert_type(jax.random.bits(k, s.shape, jnp.uint32), jnp.int32)  # any word
                         if s.dtype == jnp.int32 else jax.random.uniform(k, s.shape, jnp.float32, 0.004, 0.02))
    ckpt = {n: rand(k, s).astype(s.dtype) for k, (n, s) in zip(ks, checkpoint_shapes(E, D, F).items())}
    kern = jax.jit(relayout_for_kernel)(ckpt)
    x = jax.random.normal(ks[6], (T, D), jnp.bfloat16)
    _, ids = lax.top_k(jax.random.uniform(ks[7], (T, E)), K)
    w = jax.random.uniform(ks[8], (T, K), jnp.float32, 0.05, 0.5)
    impl = "pallas" if on_gpu else "interpret"
    f = jax.jit(functools.partial(moe, impl=impl))
    g = jax.jit(moe_ref)
    y, y_ref = f(x, ids, w, kern), g(x, ids, w, ckpt)
    err = float(jnp.linalg.norm((y.astype(jnp.float32) - y_ref.astype(jnp.float32)).ravel())
                / jnp.linalg.norm(y_ref.astype(jnp.float32).ravel()))
    n_used = len(jnp.unique(ids))
    mb = n_used * (3 * F * D // 2 + 3 * F * D // 32 * 2) / 1e6
    print(f"T={T} E={E} F={F} D={D}: {n_used} experts ({mb:.0f} MB), rel err vs reference {err:.2e}")
    for name, fn, ex in ((impl, f, kern), ("xla", g, ckpt)):
        jax.block_until_ready(fn(x, ids, w, ex))
        t0 = time.perf_counter()
        for _ in range(10):
            r = fn(x, ids, w, ex)
        jax.block_until_ready(r)
        dt = (time.perf_counter() - t0) / 10
        print(f"{name}: {dt * 1e6:.1f} us/call, {mb / 1e6 / dt:.2f} TB/s of expert weights")


if __name__ == "__main__":
    _main()
