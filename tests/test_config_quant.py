"""Config parsing (both HF layouts, unsupported fields), YaRN constants, INT4 layout."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from kimijax import quant
from kimijax.config import KIMI_K26, TINY, ConfigError, KimiConfig, YarnScaling
from kimijax.models.common import yarn_inv_freq


def test_softmax_scale_constants():
    assert KIMI_K26.softmax_scale == pytest.approx(0.1446796, abs=1e-7)
    k2 = dataclasses.replace(KIMI_K26, rope_scaling=YarnScaling(factor=32.0, beta_fast=1.0))
    assert k2.softmax_scale == pytest.approx(0.1308608, abs=1e-7)
    assert KIMI_K26.latent_dim == 576


@pytest.mark.parametrize("beta_fast,low,high", [(1.0, 19, 20), (32.0, 8, 20)])
def test_yarn_ramp_matches_reference_constants(beta_fast, low, high):
    y = YarnScaling(factor=64.0, beta_fast=beta_fast)
    inv, amp = yarn_inv_freq(64, 50000.0, y)
    assert amp == 1.0
    ext = 1.0 / 50000.0 ** (np.arange(0, 64, 2) / 64)
    # dims below `low` keep the extrapolation frequency, dims from `high` on are divided by the factor
    np.testing.assert_allclose(inv[:low], ext[:low], rtol=1e-6)
    np.testing.assert_allclose(inv[high:], ext[high:] / 64, rtol=1e-6)
    assert np.all(inv[low:high] <= ext[low:high] * (1 + 1e-6))


def _hf_text():
    return KIMI_K26.to_hf(nested=False)


def test_from_hf_both_layouts_roundtrip():
    nested = KIMI_K26.to_hf(nested=True)
    c1 = KimiConfig.from_hf(nested)
    assert c1.weight_prefix == "language_model." and c1.experts_int4 and c1.n_routed_experts == 384
    flat = KIMI_K26.to_hf(nested=False)
    flat["model_type"] = "deepseek_v3"
    c2 = KimiConfig.from_hf(flat)
    assert c2.weight_prefix == "" and c2.hidden_size == 7168
    assert dataclasses.replace(c2, weight_prefix="language_model.") == c1
    # quantization_config at the top level of a nested config is accepted too
    qc = nested["text_config"].pop("quantization_config")
    nested["quantization_config"] = qc
    assert KimiConfig.from_hf(nested).experts_int4


@pytest.mark.parametrize("field,value", [
    ("scoring_func", "softmax"), ("topk_method", "greedy"), ("moe_layer_freq", 2), ("hidden_act", "gelu"),
    ("tie_word_embeddings", True), ("q_lora_rank", None), ("model_type", "llama"),
])
def test_unsupported_fields_raise(field, value):
    hf = _hf_text()
    hf[field] = value
    with pytest.raises(ConfigError, match=field if field != "model_type" else "model_type"):
        KimiConfig.from_hf(hf)


def test_fp8_refused_clearly():
    hf = _hf_text()
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    with pytest.raises(ConfigError, match="FP8"):
        KimiConfig.from_hf(hf)


def test_missing_field_and_bad_rope():
    hf = _hf_text()
    del hf["kv_lora_rank"]
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        KimiConfig.from_hf(hf)
    hf = _hf_text()
    hf["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    with pytest.raises(ConfigError, match="rope_scaling"):
        KimiConfig.from_hf(hf)


def test_group_config_validation():
    with pytest.raises(ConfigError):
        dataclasses.replace(TINY, n_group=3)  # 8 experts not divisible by 3
    with pytest.raises(ConfigError):
        dataclasses.replace(TINY, n_group=2, topk_group=3)


def test_int4_worked_example_and_roundtrip():
    p = quant.pack_int4_np(np.array([[5, 5, 5, 6, -3, -5, -7, 5]]))
    assert p.view(np.uint32)[0, 0] == 0xD135EDDD
    rng = np.random.default_rng(0)
    q = rng.integers(-8, 8, size=(5, 64))
    packed = quant.pack_int4_np(q)
    np.testing.assert_array_equal(quant.unpack_int4_np(packed), q)
    np.testing.assert_array_equal(np.asarray(quant.unpack_int4(jnp.asarray(packed))), q)


def test_dequantize_jax_matches_numpy():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(2, 6, 64)).astype(np.float32)
    packed, scale = quant.quantize_int4_np(w)
    ref = quant.dequantize_np(packed, scale)
    got = np.asarray(quant.dequantize(jnp.asarray(packed), jnp.asarray(scale), jnp.float32))
    np.testing.assert_array_equal(got, ref)
    assert np.abs(ref - w).max() <= np.abs(w).max() / 7.5  # within one quantization step
