"""Lower Pallas Triton kernels for a pretend H200 on any host (no GPU needed): the Triton IR text of every
pallas_call a function traces. Tests use it to check that the GPU lowering (which interpret mode never runs)
accepts a kernel; scripts/triton_sass.py compiles the IR further with pip Triton."""

from __future__ import annotations

import jax
from jax._src.pallas.triton import gpu_info, pallas_call_registration as reg


def triton_ir(fn, *args) -> dict[str, str]:
    """{pallas_call name: Triton IR} of jax.jit(fn) traced at `args` (arrays or ShapeDtypeStructs), lowered
    for CUDA with the H200's GPU info."""
    captured, lower, info = {}, reg.lowering.lower_jaxpr_to_triton_module, reg.gpu_info_lib.get_gpu_info
    reg.gpu_info_lib.get_gpu_info = lambda: gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)

    def capture(jaxpr, *a, **k):
        res = lower(jaxpr, *a, **k)
        res.module.operation.verify()  # what XLA's parse of the module checks first (e.g. select operand types)
        captured[jaxpr.debug_info.func_name] = res.module.operation.get_asm()
        return res

    reg.lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        reg.lowering.lower_jaxpr_to_triton_module, reg.gpu_info_lib.get_gpu_info = lower, info
    return captured
