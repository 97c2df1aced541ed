import os

os.environ.setdefault("KIMIJAX_CACHE", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "kimijax"))
os.environ.setdefault("KIMIJAX_COMPILE_CACHE", "off")  # in-process CLI tests must not switch it on for the rest
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402
import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop every compiled program after each test module. Each CPU executable holds ~6 memory mappings until
    jax's caches let it go; the whole suite compiles >10k programs, and past the kernel's vm.max_map_count
    (65530) mmap fails inside XLA's compiler, which segfaults (CI exit 139 in test_spec.py). Session-scoped
    targets keep their engines' programs on themselves: those go too."""
    yield
    import jax

    from kimijax.engine import drop_programs
    from kimijax.models.llama import LlamaTarget
    from kimijax.target import KimiTarget

    jax.clear_caches()
    for obj in gc.get_objects():
        if isinstance(obj, (KimiTarget, LlamaTarget)):
            drop_programs(obj)
    gc.collect()


@pytest.fixture(scope="session")
def tiny_f32():
    """A tiny random Kimi target in float32 (INT4 experts)."""
    from kimijax.config import TINY
    from kimijax.target import KimiTarget, random_kimi_params

    cfg = dataclasses.replace(TINY, dtype="float32")
    return KimiTarget(cfg, random_kimi_params(cfg, seed=0), random_weights=True)
