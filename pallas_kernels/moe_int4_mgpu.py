"""Routed-expert MoE over INT4 experts as Mosaic GPU kernels (Hopper): the decode and verify path, T <= 256 tokens.

Why a second backend: the Triton-lowered kernels (pallas_kernels/moe_int4.py) stream INT4 experts at 52 % of
the HBM read roof at T = 1 and 65-68 % from T = 9 (BENCHMARKS.md, "Kernels"), and what is left there is the
per-iteration unpack + MMA wait inside each program, which Triton schedules for us.  Mosaic GPU gives the
pieces by hand: TMA copies of contiguous weight blocks into shared memory, several steps in flight
(`plgpu.emit_pipeline`), the int4 -> bf16 upcast of a [64, 32] tile in registers (Mosaic's fast path), the
scale applied as a row broadcast, and `wgmma` with the weights as the register A operand ("swap AB": the
expert's rows are M = 64, the tokens are N = 16).

Layout (made once at load time by `to_mgpu_layout`; same bytes as the checkpoint's INT4 + bf16 scales):
  gu_q  int4 [E, F/64, D/32, 128, 32]: block (e, f, g) holds rows f*64 .. f*64+63 of gate (rows 0..63) and
        of up (rows 64..127), inputs g*32 .. g*32+31, signed q (the checkpoint stores q + 8);
  gu_s  bf16 [E, F/64, D/32, 128]: their group-32 scales;
  dn_q  int4 [E, D/64, F/32, 64, 32], dn_s bf16 [E, D/64, F/32, 64]: the same for down (rows of D, inputs F).
A pipeline step of GS groups reads one contiguous GS * 128 * 16-byte piece of weights per program.

Kernels (dense routing: every token is a column of every used expert's product; at T <= 16 the padding
columns cost MMA slots, not bytes):
  1. gate/up: grid (P = T*K pairs, F/64).  Program (u, f) exits unless pair u is the first pair routed to
     its expert (the XLA glue marks duplicates -1; at T=1 no marks: a token's K experts are distinct, and
     only zero-weight pairs are marked), else streams the expert's gate and up rows of block f
     once and writes h[u, f*64 .. +63, :] = silu(gate x) * up x in bf16 for all 16 token columns.
  2. down: grid (P, D/64): y_u[d rows, :] = down_e h[u] in f32 per active pair; XLA sums the pairs with the
     routing weights (zero for tokens not routed to the pair's expert, and for duplicate pairs).
Each used expert's weights are read from HBM once per call.  Dequantisation is bf16(q * s), the reference's
rounding; products accumulate in f32.
From 17 to 256 tokens a slot is one expert's block of <= 16 of its tokens instead (pairs sorted by expert,
`routing_sorted`), with its own gathered x tile; an expert with more than 16 tokens is read once per block.
Each token's K partial rows [D] are then gathered from the slots' f32 outputs and added in k order.

Thread-words layout (`to_mgpu_layout(words=True)`, the fast one): the same bytes permuted per [64, 32] tile so
that each thread's 16 values sit in two 32-bit words whose nibbles unpack straight into its wgmma register
pairs (one 8-byte load, then shift / lop3 / sub / scale per pair in inline PTX): 654 instead of 928
instructions per gate/up pipeline step (offline SASS), which is what limits this kernel.

Measured (BENCHMARKS.md "INT4 MoE as Mosaic GPU kernels", NVIDIA H100, kernel time): with thread words
T=1 95.0 us vs the Triton kernel's 107.3, T=4 313.5 vs 338.8, T=9 628.4 vs 654.6, T=16 1006.5 vs 1103.7;
with int4 tiles 1.5-1.7x slower than Triton. The 17..256-token path is not timed yet. In the model it is
opt-in (`moe_impl="mgpu"`, the experts in the thread-words layout; `moe_mgpu_chunks` below runs passes of
more than 256 tokens, prefill, as chunks).

Interpret mode (CPU tests): Mosaic GPU's interpreter only takes wgmma operands from shared memory, so
there the dequantised tile goes through a shared-memory scratch (thread words are decoded with jnp); on
the GPU it stays in registers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe_layout import _nibbles, checkpoint_shapes

NB = 16  # token columns (wgmma N; bf16 B tiles need >= 16 columns)
BM = 64  # weight rows per wgmma (M)
GROUP = 32  # inputs per INT4 scale group
MAX_DENSE_TOKENS = NB  # up to here every token is a column of every used expert (one shared x tile)
MAX_TOKENS = 256  # beyond 16 tokens: per-slot token lists (each expert's tokens in blocks of 16). The cap
#                   covers decode and verify passes (C=32 b4: 160 tokens); past it an expert's weights would be
#                   read once per 16 of its tokens (prefill wants the Triton kernel) and the f32 partials
#                   [slots, D, 16] grow (235 MB at 256 tokens, Kimi width)
MGPU_KEYS = ("gu_q", "gu_s", "dn_q", "dn_s")


@dataclasses.dataclass(frozen=True)
class Config:
    groups_per_step: int = 8  # scale groups (32 inputs each) per pipeline step
    stages: int = 3  # pipeline steps in flight (TMA)
    wait_each_group: bool = True  # wgmma_wait(0) after every group (False: keep one group's MMAs in flight)
    down_tiles: int = 1  # 64-row tiles of D per down program (more bytes per step, fewer programs)
    vector_loads: bool = False  # load each int4 tile as 4-byte vectors (WGMMA_UPCAST_4X) + register shuffles
    # (weights in the int4 tile layout only; the words layout below ignores both)


# ----------------------------------------------------------------------------------------------
# Layout
# ----------------------------------------------------------------------------------------------


def _signed(packed):
    """checkpoint words int32 [..., out, in/8] (nibble = q + 8) -> int8 q [..., out, in]."""
    return (_nibbles(packed).astype(jnp.int8) - 8)


def _blocks(q_OI, s_OG):
    """[out, in] q and [out, in/32] scales -> [out/64, in/32, 64, 32] and [out/64, in/32, 64]."""
    O, I = q_OI.shape
    q = jnp.transpose(q_OI.reshape(O // BM, BM, I // GROUP, GROUP), (0, 2, 1, 3))
    s = jnp.transpose(s_OG.reshape(O // BM, BM, I // GROUP), (0, 2, 1))
    return q, s


def _one_expert(gp, gs, up, us, dp, ds):
    """One expert's int8 q blocks (gate rows then up rows per block) and scales; the layouts cast / pack them."""
    gq, gsb = _blocks(_signed(gp), gs)
    uq, usb = _blocks(_signed(up), us)
    dq, dsb = _blocks(_signed(dp), ds)
    return jnp.concatenate([gq, uq], axis=2), jnp.concatenate([gsb, usb], axis=2), dq, dsb


def _one_expert_tiles(*args):
    gq, gu_s, dq, dn_s = _one_expert(*args)
    return gq.astype(jnp.int4), gu_s, dq.astype(jnp.int4), dn_s


# The thread words: thread t = 32 w + 4 i + c of the warpgroup holds, for the wgmma A operand of a [64, 32]
# tile, rows 16 w + i + 8 h (h = 0, 1) and columns 8 j + 2 c + e (j = 0..3, e = 0, 1) as bf16 pairs (e = 0
# low half) in register (j, h) of Mosaic's WGMMA layout. Word (t, h) puts the nibble (q + 8) of column
# 8 j + 2 c + e at bits 4 (j + 4 e): `(word >> 4 j) & 0x000F000F` is then register (j, h)'s pair of nibbles.
_J_E_SHIFT = 4 * (np.arange(4)[:, None] + 4 * np.arange(2)[None, :]).astype(np.uint32)  # [j, e]


def _permute_last6(a, perm):
    n = a.ndim - 6
    return jnp.transpose(a, (*range(n), *(n + k for k in perm)))


def _tile_words(q):
    """int q [..., 64, 32] (-8..7) -> int32 [..., 256]: word 2 t + h of thread t (layout above)."""
    nib = (q.astype(jnp.int32) + 8).reshape(*q.shape[:-2], 4, 2, 8, 4, 4, 2)  # [w, h, i, j, c, e]
    nib = _permute_last6(nib, (0, 2, 4, 1, 3, 5))  # -> [w, i, c, h, j, e]
    words = jnp.sum(nib.astype(jnp.uint32) << _J_E_SHIFT, axis=(-2, -1), dtype=jnp.uint32)
    return lax.bitcast_convert_type(words, jnp.int32).reshape(*q.shape[:-2], 256)


def _words_tile(words):
    """Inverse of _tile_words: int32 [..., 256] -> int32 q [..., 64, 32]."""
    w = lax.bitcast_convert_type(words, jnp.uint32).reshape(*words.shape[:-1], 4, 8, 4, 2)  # [w, i, c, h]
    nib = jnp.stack([jnp.stack([(w >> jnp.uint32(4 * (j + 4 * e))) & jnp.uint32(0xF) for e in range(2)], -1)
                     for j in range(4)], -2)  # [w, i, c, h, j, e] (no array constants: this runs in the kernel)
    nib = _permute_last6(nib, (0, 3, 1, 4, 2, 5))  # -> [w, h, i, j, c, e]
    return nib.astype(jnp.int32).reshape(*words.shape[:-1], 64, 32) - 8


def _one_expert_words(gp, gs, up, us, dp, ds):
    gq, gu_s, dq, dn_s = _one_expert(gp, gs, up, us, dp, ds)
    gq = gq.reshape(*gq.shape[:2], 2, BM, GROUP)  # [F/64, D/32, gate|up, 64, 32]
    return _tile_words(gq), gu_s, _tile_words(dq), dn_s


def to_mgpu_layout(experts: dict, words: bool = False) -> dict:
    """Checkpoint INT4 expert dict (gate/up/down _packed + _scale; kimijax/quant.py) -> the layout above,
    one expert at a time (lax.map: the temporaries are one expert's nibbles). words=True: the weights as
    thread words (gu_q int32 [E, F/64, D/32, 2, 256], dn_q int32 [E, D/64, F/32, 256]; same bytes)."""
    ins = tuple(experts[k] for k in ("gate_packed", "gate_scale", "up_packed", "up_scale",
                                      "down_packed", "down_scale"))
    gu_q, gu_s, dn_q, dn_s = lax.map(lambda a: (_one_expert_words if words else _one_expert_tiles)(*a), ins)
    return {"gu_q": gu_q, "gu_s": gu_s.astype(jnp.bfloat16), "dn_q": dn_q, "dn_s": dn_s.astype(jnp.bfloat16)}


def _unblocks(q, s):
    """Inverse of _blocks: [out/64, in/32, 64, 32] q and [out/64, in/32, 64] scales -> [out, in], [out, in/32]."""
    O64, G = q.shape[:2]
    return (jnp.transpose(q, (0, 2, 1, 3)).reshape(O64 * BM, G * GROUP),
            jnp.transpose(s, (0, 2, 1)).reshape(O64 * BM, G))


def _expert_blocks(gu_q, gu_s, dn_q, dn_s):
    """One expert in the layout above (int4 tiles or thread words) -> int32 q blocks: gate and up
    [F/64, D/32, 64, 32] each, down [D/64, F/32, 64, 32], with their [.., 64] scales."""
    if gu_q.dtype == jnp.int32:  # thread words
        gq, dq = _words_tile(gu_q), _words_tile(dn_q)  # [F/64, D/32, 2, 64, 32], [D/64, F/32, 64, 32]
    else:
        gq = gu_q.astype(jnp.int32).reshape(*gu_q.shape[:2], 2, BM, GROUP)
        dq = dn_q.astype(jnp.int32)
    gs = gu_s.reshape(*gu_s.shape[:2], 2, BM)
    return (gq[:, :, 0], gs[:, :, 0]), (gq[:, :, 1], gs[:, :, 1]), (dq, dn_s)


def expert_weights(experts: dict, e, dtype):
    """Expert e's gate, up ([F, D]) and down ([D, F]) dequantised from this layout, with the numerics of
    kimijax.quant.dequantize (bf16(q * s)); for `moe_int4.moe_ref`, the reference of every layout."""
    out = []
    for q, s in _expert_blocks(*(experts[k][e] for k in MGPU_KEYS)):
        w, sc = _unblocks(q, s)
        w = (w.astype(jnp.bfloat16).reshape(*sc.shape, GROUP) * sc.astype(jnp.bfloat16)[..., None])
        out.append(w.reshape(sc.shape[0], -1).astype(dtype))
    return tuple(out)


def from_mgpu_layout(experts: dict) -> dict:
    """Inverse of `to_mgpu_layout` (either variant): the checkpoint dict, bit for bit."""
    from pallas_kernels.moe_layout import _pack_nibbles

    def one(args):
        ck = []
        for q, s in _expert_blocks(*args):
            w, sc = _unblocks(q, s)
            ck += [_pack_nibbles(w + 8), sc.astype(jnp.bfloat16)]
        return tuple(ck)

    outs = lax.map(one, tuple(experts[k] for k in MGPU_KEYS))
    return dict(zip(("gate_packed", "gate_scale", "up_packed", "up_scale", "down_packed", "down_scale"), outs))


def layout_shapes(E: int, D: int, F: int, words: bool = False) -> dict:
    """ShapeDtypeStructs of `to_mgpu_layout`'s output for E experts of width D, F (nothing allocated)."""
    return jax.eval_shape(functools.partial(to_mgpu_layout, words=words), checkpoint_shapes(E, D, F, GROUP))


def supports(x_TD, experts: dict) -> bool:
    """Shapes this path runs: T <= MAX_TOKENS tokens, D (matching the experts') and F multiples of 64."""
    T, D = x_TD.shape
    if "gu_q" in experts:  # int4 tiles or thread words: [E, F/64, D/32, ...] either way
        F, De = experts["gu_q"].shape[1] * BM, experts["gu_q"].shape[2] * GROUP
    elif "gate_packed" in experts:
        F, De = experts["gate_packed"].shape[1], experts["gate_packed"].shape[2] * 8
    else:
        return False
    return T <= MAX_TOKENS and D == De and D % BM == 0 and F % BM == 0


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


def fit_divisor(n: int, want: int) -> int:
    """The largest divisor of n that is <= want (at least 1)."""
    g = max(1, min(want, n))
    while n % g:
        g -= 1
    return g


@functools.cache
def _words_dequant():
    """inline Mosaic GPU: a thread-words tile ref [256] int32 in shared memory -> its int4 values q as a bf16
    [64, 32] array in the WGMMA layout. Per thread: one 8-byte load, then per register pair a shift, an
    and-or onto the exponent of 128 (bf16 128 + nibble: exact) and a subtraction of 136 (= q, exact)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, vector
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgu

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=plgpu.ShapeDtypeStruct((BM, GROUP), jnp.bfloat16, layout=plgpu.Layout.WGMMA))
    def dequant(ctx, ref):
        del ctx
        i32, bf16 = ir.IntegerType.get_signless(32), ir.BF16Type.get()
        idx = ir.IndexType.get()
        tid = arith.remui(mgu.thread_idx(), mgu.c(128, i32))
        off = arith.index_cast(idx, arith.muli(tid, mgu.c(2, i32)))
        v = vector.load(ir.VectorType.get([2], i32), ref, [off])
        pair_ty = ir.VectorType.get([2], bf16)
        regs = np.empty(fa.WGMMA_LAYOUT.registers_shape((BM, GROUP)), dtype=object)
        for h in range(2):
            word = vector.extract(v, dynamic_position=[], static_position=[h])
            for j in range(4):
                # as inline PTX (like Mosaic's own int4 upcast): written as LLVM and/or, ptxas rematerialises
                # the mask into a register before every lop3
                pair = llvm.inline_asm(i32, [word], f"""
                    {{
                    .reg .b32 s<3>;
                    shr.u32 s0, $1, {4 * j};
                    lop3.b32 s1, s0, 0x000F000F, 0x43004300, (0xf0 & 0xcc) | 0xaa;
                    mov.b32 s2, 0x43084308;
                    sub.bf16x2 $0, s1, s2;
                    }}
                    """, "=r,r")
                regs[0, j, 0, 0, h, 0, 0, 0, 0] = mgu.bitcast(pair, pair_ty)
        return mgpu.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return dequant


def _mma_groups(tiles, b_smem, n_groups, a_scr, wait_each_group, vector_loads=False):
    """For each of the step's groups and each tile (acc, weights [GS, ...], scales [GS, rows], first row,
    words index): dequantise the tile's [64, 32] int4 block of that group to bf16(q * s) and accumulate it
    times the group's [32, NB] activations. words index None: weights [GS, rows, 32] int4; else thread words
    [GS, (tiles,) 256] int32, that tile's words at w_smem.at[g, *index]."""
    for g in range(n_groups):
        for j, (acc, w_smem, s_smem, lo, widx) in enumerate(tiles):
            sc = s_smem[g]
            if widx is not None:
                if a_scr is None:
                    q = _words_dequant()(w_smem.at[(g, *widx)])
                else:  # interpret mode: decode the words with jnp
                    q = _words_tile(w_smem[(g, *widx)]).astype(jnp.bfloat16)
                a = q * sc[lo:lo + BM, None]
            elif vector_loads and a_scr is None:
                q = plgpu.load(w_smem.at[g, lo:lo + BM], layout=plgpu.Layout.WGMMA_UPCAST_4X)
                a = plgpu.layout_cast(q, plgpu.Layout.WGMMA).astype(jnp.bfloat16) * sc[lo:lo + BM, None]
            else:
                a = w_smem[g, lo:lo + BM].astype(jnp.bfloat16) * sc[lo:lo + BM, None]
            if a_scr is not None:  # interpret mode: wgmma operands from shared memory only
                a_scr[j] = a
                a = a_scr.at[j]
            plgpu.wgmma(acc, a, b_smem.at[g])
        if wait_each_group or a_scr is not None:
            plgpu.wgmma_wait(0)
        else:  # the registers of this group's tiles stay live until the next group's wait
            plgpu.wgmma_wait(len(tiles))
    if not wait_each_group and a_scr is None:
        plgpu.wgmma_wait(0)


def _params():
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def _with_scratch(interpret, n, fn):
    """fn(a_scr) with a [n, 64, 32] bf16 shared-memory scratch in interpret mode, fn(None) on the GPU."""
    if not interpret:
        return fn(None)
    return pl.run_scoped(fn, plgpu.SMEM((n, BM, GROUP), jnp.bfloat16))


def _gate_up(slot_e, xg, gu_q, gu_s, *, cfg: Config, interpret):
    P = slot_e.shape[0]
    NF, G = gu_q.shape[1:3]
    GS = fit_divisor(G, cfg.groups_per_step)
    words = gu_q.dtype == jnp.int32
    q_block = (GS, 2, 256) if words else (GS, 2 * BM, GROUP)
    per_slot_x = xg.ndim == 4  # [slots, D/32, 32, NB]: each slot's own tokens; else one [D/32, 32, NB] for all

    def body(e_ref, x_ref, q_ref, s_ref, h_ref):
        u, f = lax.axis_index("u"), lax.axis_index("f")
        e = e_ref[u]

        @pl.when(e >= 0)
        def _():
            def run(a_scr):
                def accs_scope(acc_g, acc_u):
                    def step(_, x_smem, q_smem, s_smem):
                        tiles = ((acc_g, q_smem, s_smem, 0, (0,) if words else None),
                                 (acc_u, q_smem, s_smem, BM, (1,) if words else None))
                        _mma_groups(tiles, x_smem, GS, a_scr, cfg.wait_each_group, cfg.vector_loads)

                    plgpu.emit_pipeline(step, grid=(G // GS,), in_specs=[
                        plgpu.BlockSpec((GS, GROUP, NB), lambda s: (s, 0, 0)),
                        plgpu.BlockSpec(q_block, lambda s: (s, 0, 0)),
                        plgpu.BlockSpec((GS, 2 * BM), lambda s: (s, 0)),
                    ], max_concurrent_steps=cfg.stages)(x_ref.at[u] if per_slot_x else x_ref, q_ref.at[e, f],
                                                        s_ref.at[e, f])
                    return acc_g[...], acc_u[...]

                return pl.run_scoped(accs_scope, plgpu.ACC((BM, NB)), plgpu.ACC((BM, NB)))

            ag, au = _with_scratch(interpret, 2, run)
            h = ag / (1.0 + jnp.exp(-ag)) * au

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((BM, NB), jnp.bfloat16))
            def _(o_smem):
                o_smem[...] = h.astype(jnp.bfloat16)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, h_ref.at[u, pl.ds(f * BM, BM)])
                plgpu.wait_smem_to_gmem(0)

    kern = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((P, NF * BM, NB), jnp.bfloat16), grid=(P, NF),
                        grid_names=("u", "f"), compiler_params=_params(), interpret=_interp(interpret))
    return kern(slot_e, xg, gu_q, gu_s)


def _down(slot_e, h, dn_q, dn_s, *, cfg: Config, interpret, zero_inactive: bool = False):
    """zero_inactive: programs of inactive pairs (slot_e -1) write zeros, so the combine reads y as it is
    (one XLA select fewer); otherwise their rows are left unwritten."""
    P = slot_e.shape[0]
    ND, Gf = dn_q.shape[1:3]
    GS = fit_divisor(Gf, cfg.groups_per_step)
    words = dn_q.dtype == jnp.int32
    q_block, q_map = ((GS, 256), lambda s: (s, 0)) if words else ((GS, BM, GROUP), lambda s: (s, 0, 0))
    DT = cfg.down_tiles if ND % cfg.down_tiles == 0 else 1
    hg = h.reshape(P, Gf, GROUP, NB)

    def body(e_ref, h_ref, q_ref, s_ref, y_ref):
        u, d = lax.axis_index("u"), lax.axis_index("d")
        e = e_ref[u]

        def store(ys):
            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((DT, BM, NB), jnp.float32))
            def _(o_smem):
                for i in range(DT):
                    o_smem[i] = ys[i]
                plgpu.commit_smem()
                for i in range(DT):
                    plgpu.copy_smem_to_gmem(o_smem.at[i], y_ref.at[u, pl.ds((d * DT + i) * BM, BM)])
                plgpu.wait_smem_to_gmem(0)

        @pl.when(e >= 0)
        def _():
            def run(a_scr):
                def acc_scope(*accs):
                    def step(_, h_smem, *ws):
                        tiles = [(accs[i], ws[2 * i], ws[2 * i + 1], 0, () if words else None) for i in range(DT)]
                        _mma_groups(tiles, h_smem, GS, a_scr, cfg.wait_each_group, cfg.vector_loads)

                    w_specs = [plgpu.BlockSpec(q_block, q_map),
                               plgpu.BlockSpec((GS, BM), lambda s: (s, 0))] * DT
                    w_refs = [r for i in range(DT) for r in (q_ref.at[e, d * DT + i], s_ref.at[e, d * DT + i])]
                    plgpu.emit_pipeline(step, grid=(Gf // GS,), in_specs=[
                        plgpu.BlockSpec((GS, GROUP, NB), lambda s: (s, 0, 0)), *w_specs,
                    ], max_concurrent_steps=cfg.stages)(h_ref.at[u], *w_refs)
                    return tuple(a[...] for a in accs)

                return pl.run_scoped(acc_scope, *[plgpu.ACC((BM, NB)) for _ in range(DT)])

            store(_with_scratch(interpret, DT, run))

        if zero_inactive:
            @pl.when(e < 0)
            def _():
                store([jnp.zeros((BM, NB), jnp.float32)] * DT)

    kern = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((P, ND * BM, NB), jnp.float32), grid=(P, ND // DT),
                        grid_names=("u", "d"), compiler_params=_params(), interpret=_interp(interpret))
    return kern(slot_e, hg, dn_q, dn_s)


def _interp(interpret):
    return plgpu.InterpretGPUParams() if interpret else None


def routing(ids_TK, w_TK):
    """-> slot_e [P] (pair p's expert, -1 unless p is the first pair routed to it) and wt [P, NB] f32 (the
    routing weight of token n for pair p's expert; 0 for duplicate pairs and padding tokens)."""
    T, K = ids_TK.shape
    flat = ids_TK.reshape(-1).astype(jnp.int32)
    p = jnp.arange(T * K)
    dup = jnp.any((flat[None, :] == flat[:, None]) & (p[None, :] < p[:, None]), axis=1)
    slot_e = jnp.where(dup, -1, flat)
    hit = ids_TK.astype(jnp.int32)[None, :, :] == flat[:, None, None]  # [P, T, K]
    w = jnp.where(hit, w_TK.astype(jnp.float32)[None], 0.0)
    # the K-term sum as adds: elementwise, so it fuses into the combine (a reduce is a launch of its own)
    wt = functools.reduce(jnp.add, [w[:, :, k] for k in range(K)])  # [P, T]
    wt = jnp.where(dup[:, None], 0.0, wt)
    return slot_e, jnp.pad(wt, ((0, 0), (0, NB - T)))


def routing_sorted(ids_TK, n_experts: int):
    """Token lists per slot, for T > 16: the T*K (token, expert) pairs sorted by expert, each expert's run cut
    into blocks of NB tokens, one slot per block -> slot_e [S] (-1: unused slot), tok [S, NB] (T for an empty
    column) and where each pair went: at_TK [T, K] = slot * NB + column. S = min(T*K, E) +
    ceil(T*K / NB) bounds the blocks (one partial block per run). A token routed to one expert twice takes two
    columns of its slot (the reference adds both weights)."""
    T, K = ids_TK.shape
    P = T * K
    S = min(P, n_experts) + -(-P // NB)
    e_p = ids_TK.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(e_p, stable=True)
    e_s, t_s = e_p[order], (order // K).astype(jnp.int32)
    i_p = jnp.arange(P, dtype=jnp.int32)
    new_run = jnp.concatenate([jnp.ones((1,), bool), e_s[1:] != e_s[:-1]])
    r = i_p - lax.cummax(jnp.where(new_run, i_p, 0))  # position within the expert's run
    slot = jnp.cumsum((new_run | (r % NB == 0)).astype(jnp.int32)) - 1
    col = r % NB
    slot_e = jnp.full((S,), -1, jnp.int32).at[slot].set(e_s)
    tok = jnp.full((S, NB), T, jnp.int32).at[slot, col].set(t_s)
    at_TK = jnp.zeros((P,), jnp.int32).at[order].set(slot * NB + col).reshape(T, K)
    return slot_e, tok, at_TK


def moe_mgpu(x_TD, ids_TK, w_TK, experts: dict, *, cfg: Config = Config(), interpret: bool = False):
    """`moe_int4.moe_ref` for T <= MAX_TOKENS tokens with bf16 activations (x and h are rounded to bf16, as the
    reference does for a bf16 x); experts in the layout above (or the checkpoint layout, converted here:
    correct but slow, a whole-layer re-layout per call). Up to 16 tokens every token is a column of every
    used expert's product (`routing`); beyond, each slot holds one expert's block of <= 16 tokens
    (`routing_sorted`), gathered from x, and each token's K partial outputs are gathered and added."""
    T, D = x_TD.shape
    if not supports(x_TD, experts):
        raise ValueError(f"moe_mgpu runs T <= {MAX_TOKENS} tokens with D (the experts') and F multiples of {BM}: "
                         f"got x {x_TD.shape}")
    if "gate_packed" in experts:
        experts = to_mgpu_layout(experts)
    x = x_TD.astype(jnp.bfloat16)
    dense = T <= MAX_DENSE_TOKENS
    if dense:  # one x tile for all pairs: the tokens are its columns
        if T == 1:  # decode: each pair with its own weight, no duplicate marks (top-k ids are distinct; a repeated
            # id would be read twice, still exact). Zero-weight pairs are skipped; the select also lets XLA fuse the
            # ids' slice out of top-k with the weights' scaling (offline: a Kimi layer 33 -> 32 launches)
            slot_e = jnp.where(w_TK[0] != 0, ids_TK[0].astype(jnp.int32), -1)
        else:
            slot_e, wt = routing(ids_TK, w_TK)
        xg = jnp.pad(x, ((0, NB - T), (0, 0))).T.reshape(D // GROUP, GROUP, NB)
    else:
        slot_e, tok, at_TK = routing_sorted(ids_TK, experts["gu_q"].shape[0])
        x_pad = jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])  # row T: empty columns
        xg = jnp.transpose(x_pad[tok], (0, 2, 1)).reshape(-1, D // GROUP, GROUP, NB)
    h = _gate_up(slot_e, xg, experts["gu_q"], experts["gu_s"], cfg=cfg, interpret=interpret)
    # dense: every pair's rows are summed, so inactive pairs write zeros (0 * garbage could be NaN)
    y_PDN = _down(slot_e, h, experts["dn_q"], experts["dn_s"], cfg=cfg, interpret=interpret, zero_inactive=dense)
    if T == 1:
        y_TD = jnp.einsum("pd,p->d", y_PDN[:, :, 0], w_TK[0].astype(jnp.float32))[None]
    elif dense:
        y_TD = jnp.einsum("pdn,pn->nd", y_PDN, wt)[:T]
    else:
        # Each token's K partial rows (active slots only), gathered and weighted in k order: deterministic,
        # unlike a scatter-add; a one-hot contraction would cost S * NB * T * D flops (13 GFLOP at 129 tokens).
        y_XD = jnp.transpose(y_PDN, (0, 2, 1)).reshape(-1, D)  # [S * NB, D]: row slot * NB + column
        y_TKD = y_XD[at_TK]
        w = w_TK.astype(jnp.float32)
        y_TD = functools.reduce(jnp.add, [w[:, k, None] * y_TKD[:, k] for k in range(ids_TK.shape[1])])
    return y_TD.astype(x_TD.dtype)


def moe_mgpu_chunks(x_TD, ids_TK, w_TK, experts: dict, *, interpret: bool = False):
    """The Mosaic GPU MoE (thread words, two down tiles per program: the fastest measured) over any number of
    tokens: up to MAX_TOKENS in one call, more (prefill) as equal chunks of at most that many, each reading
    its experts again (a prefill cost the Triton kernel does not pay; decode and verify passes are one chunk).
    Padding rows route to expert ids[0] with weight 0 and are dropped."""
    T, D = x_TD.shape
    cfg = Config(down_tiles=2)
    if T <= MAX_TOKENS:
        return moe_mgpu(x_TD, ids_TK, w_TK, experts, cfg=cfg, interpret=interpret)
    n = -(-T // MAX_TOKENS)
    c = -(-T // n)
    pad = n * c - T
    x = jnp.pad(x_TD, ((0, pad), (0, 0))).reshape(n, c, D)
    ids = jnp.concatenate([ids_TK, jnp.broadcast_to(ids_TK[:1], (pad, ids_TK.shape[1]))]).reshape(n, c, -1)
    w = jnp.pad(w_TK, ((0, pad), (0, 0))).reshape(n, c, -1)
    y = lax.map(lambda a: moe_mgpu(*a, experts, cfg=cfg, interpret=interpret), (x, ids, w))
    return y.reshape(n * c, D)[:T]
