"""scripts/offline_gpu.py's HLO walk (the part that needs no CUDA plugin): launches of a scheduled module."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import offline_gpu as og  # noqa: E402

HLO = """HloModule jit_f, is_scheduled=true

%fused_add (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %add = f32[4]{0} add(%p0, %p0)
}

%body (arg: (s32[], f32[4])) -> (s32[], f32[4]) {
  %arg = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[4]{0} get-tuple-element(%arg), index=1
  %loop_add_fusion = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_add, metadata={op_name="jit(f)/while/body/verify/add"}
  %cc = f32[4]{0} custom-call(%loop_add_fusion), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/while/body/commit/pallas_call"}
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %cc)
}

%cond (arg.1: (s32[], f32[4])) -> pred[] {
  %arg.1 = (s32[], f32[4]{0}) parameter(0)
  %j = s32[] get-tuple-element(%arg.1), index=0
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %c), direction=LT
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %copy = f32[4]{0} copy(%a)
  %z = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%z, %copy)
  %w = (s32[], /*index=1*/f32[4]{0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_launches_walk_the_while_body():
    every = og.launches(HLO)
    assert [k for k, _, _ in every] == ["copy", "compare", "fusion:kLoop", "custom-call:__gpu$xla.gpu.triton"]
    per_round = og.launches(HLO, in_loop=True)
    assert [n for _, n, _ in per_round] == ["lt", "loop_add_fusion", "cc"]
    assert per_round[2][2] == "jit(f)/while/body/commit/pallas_call"
    assert og.count_kernels(HLO, in_loop=True) == {"compare": 1, "fusion:kLoop": 1,
                                                   "custom-call:__gpu$xla.gpu.triton": 1}


def test_mesh_report_reads_gathers_and_kernel_rows():
    hlo = """  %all-gather-start = ((bf16[9,8,576]{2,0,1}), bf16[9,64,576]{2,0,1}) all-gather-start(%b), channel_id=1
  %pallas_call.6 = (f32[1,13,576,512]{3,2,1,0}, f32[1,13,576]{2,1,0}) custom-call(%p, %q), custom_call_target="__gpu$xla.gpu.triton"
"""
    assert og._mesh_report(hlo) == ("1 all-gathers; the kernel's query rows per device (padded to its blocks): 576")
