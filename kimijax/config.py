"""Frozen model configs. One dataclass per model; `from_hf()` reads a HF config.json dict.

KimiConfig covers the Kimi K2.x family (DeepSeek-V3 architecture): flat K2 / K2-Thinking configs
(`model_type` kimi_k2 or deepseek_v3) and nested K2.5 / K2.6 configs (`kimi_k25`, text model in
`text_config`, weights under `language_model.`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


class ConfigError(ValueError):
    """A config field has a value kimijax does not support (or is missing)."""


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    factor: float = 64.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class KimiConfig:
    vocab_size: int = 163840
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    first_k_dense_replace: int = 1
    num_attention_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 384
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.827
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-5
    latent_norm_eps: float = 1e-6  # q_a/kv_a layernorms: HF and DeepSeek-official ignore rms_norm_eps
    rope_theta: float = 50000.0
    rope_scaling: YarnScaling | None = YarnScaling()
    max_position_embeddings: int = 262144
    experts_int4: bool = True  # routed experts in compressed-tensors pack-quantized INT4
    quant_group_size: int = 32
    bos_token_id: int = 163584
    eos_token_ids: tuple[int, ...] = (163585, 163586)  # [EOS] and <|im_end|>: both end a request
    pad_token_id: int = 163839
    weight_prefix: str = "language_model."  # "" for flat K2 checkpoints, "language_model." for K2.5/K2.6
    dtype: str = "bfloat16"

    # ---- derived ----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:  # one cache row per token per layer: c_kv (512) + k_pe (64)
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        s = self.qk_head_dim ** -0.5
        if self.rope_scaling is not None:
            m = yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
            s = s * m * m
        return s

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    def __post_init__(self):
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"n_routed_experts={self.n_routed_experts} not divisible by n_group={self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError("num_experts_per_tok exceeds n_routed_experts")
        if self.qk_rope_head_dim % 2:
            raise ConfigError("qk_rope_head_dim must be even")
        if self.experts_int4 and (self.hidden_size % self.quant_group_size or self.moe_intermediate_size % self.quant_group_size):
            raise ConfigError(
                f"INT4 experts need hidden_size and moe_intermediate_size divisible by the group size {self.quant_group_size}")

    # ---- HF config.json ----
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "KimiConfig":
        """Read a HF config.json dict (flat K2/K2-Thinking or nested K2.5/K2.6)."""
        top = hf
        mt = hf.get("model_type")
        if mt == "kimi_k25" or "text_config" in hf:
            if "text_config" not in hf:
                raise ConfigError("model_type kimi_k25 but no text_config in config.json")
            text = dict(hf["text_config"])
            prefix = "language_model."
            # K2.5/K2.6 keep quantization_config inside text_config; accept top level as well.
            if "quantization_config" not in text and "quantization_config" in top:
                text["quantization_config"] = top["quantization_config"]
            for k in ("eos_token_id", "bos_token_id", "pad_token_id"):
                if k not in text and k in top:
                    text[k] = top[k]
        elif mt in ("kimi_k2", "deepseek_v3"):
            text, prefix = dict(hf), ""
        else:
            raise ConfigError(f"unsupported model_type {mt!r}: expected kimi_k2, deepseek_v3 or kimi_k25")
        tmt = text.get("model_type", "kimi_k2")
        if tmt not in ("kimi_k2", "deepseek_v3"):
            raise ConfigError(f"unsupported text model_type {tmt!r}")

        def req(k):
            if k not in text:
                raise ConfigError(f"config.json lacks required field {k!r}")
            return text[k]

        def check(k, ok, want):
            if k in text and text[k] is not None and not ok(text[k]):
                raise ConfigError(f"unsupported config value {k}={text[k]!r} (kimijax supports {want})")

        check("scoring_func", lambda v: v == "sigmoid", "'sigmoid'")
        check("topk_method", lambda v: v == "noaux_tc", "'noaux_tc'")
        check("moe_layer_freq", lambda v: v == 1, "1")
        check("hidden_act", lambda v: v == "silu", "'silu'")
        check("attention_bias", lambda v: v is False, "false")
        check("tie_word_embeddings", lambda v: v is False, "false (untied lm_head)")
        check("q_lora_rank", lambda v: isinstance(v, int) and v > 0, "a positive q_lora_rank")
        if text.get("q_lora_rank", 1) is None:
            raise ConfigError("unsupported config value q_lora_rank=None (kimijax supports a positive q_lora_rank)")
        check("rope_interleave", lambda v: v is True, "true (interleaved rope pairs)")

        rs = text.get("rope_scaling")
        yarn = None
        if rs is not None:
            rtype = rs.get("type", rs.get("rope_type"))
            if rtype != "yarn":
                raise ConfigError(f"unsupported rope_scaling type {rtype!r} (kimijax supports 'yarn' or none)")
            yarn = YarnScaling(
                factor=float(rs["factor"]),
                original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 4096)),
                beta_fast=float(rs.get("beta_fast", 32.0)),
                beta_slow=float(rs.get("beta_slow", 1.0)),
                mscale=float(rs.get("mscale", 1.0)),
                mscale_all_dim=float(rs.get("mscale_all_dim", 0.0) or 0.0),
            )

        qc = text.get("quantization_config")
        int4 = False
        group = 32
        if qc is not None:
            method = qc.get("quant_method")
            if method == "fp8":
                raise ConfigError(
                    "block-FP8 checkpoints (Kimi K2-Instruct / K2-Base) are not supported: kimijax serves the INT4 "
                    "releases (K2-Thinking, K2.5, K2.6). Convert the FP8 weights to bf16 first (DeepSeek's "
                    "fp8_cast_bf16.py) or use an INT4 release.")
            if method != "compressed-tensors":
                raise ConfigError(f"unsupported quantization method {method!r}")
            if qc.get("format") != "pack-quantized":
                raise ConfigError(f"unsupported compressed-tensors format {qc.get('format')!r} (need pack-quantized)")
            groups = qc.get("config_groups", {})
            if len(groups) != 1:
                raise ConfigError(f"expected one compressed-tensors config group, got {len(groups)}")
            w = next(iter(groups.values()))["weights"]
            if not (w.get("num_bits") == 4 and w.get("type") == "int" and w.get("symmetric") and w.get("strategy") == "group"):
                raise ConfigError(f"unsupported INT4 weight scheme {w}: need symmetric int4 group quantization")
            int4, group = True, int(w.get("group_size", 32))

        eos = text.get("eos_token_id", 163585)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        if 163586 not in eos_ids and req("vocab_size") > 163586:
            eos_ids = eos_ids + (163586,)  # <|im_end|> ends a chat turn in every K2 release
        n_layers = req("num_hidden_layers")
        return cls(
            vocab_size=req("vocab_size"),
            hidden_size=req("hidden_size"),
            intermediate_size=req("intermediate_size"),
            moe_intermediate_size=req("moe_intermediate_size"),
            num_hidden_layers=n_layers,
            first_k_dense_replace=text.get("first_k_dense_replace", 0),
            num_attention_heads=req("num_attention_heads"),
            q_lora_rank=req("q_lora_rank"),
            kv_lora_rank=req("kv_lora_rank"),
            qk_nope_head_dim=req("qk_nope_head_dim"),
            qk_rope_head_dim=req("qk_rope_head_dim"),
            v_head_dim=req("v_head_dim"),
            n_routed_experts=req("n_routed_experts"),
            num_experts_per_tok=req("num_experts_per_tok"),
            n_shared_experts=text.get("n_shared_experts", 0) or 0,
            routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
            n_group=text.get("n_group", 1) or 1,
            topk_group=text.get("topk_group", 1) or 1,
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(text.get("rope_theta", 10000.0)),
            rope_scaling=yarn,
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            experts_int4=int4,
            quant_group_size=group,
            bos_token_id=text.get("bos_token_id", 163584),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            pad_token_id=text.get("pad_token_id", 163839) if text.get("pad_token_id") is not None else 163839,
            weight_prefix=prefix,
        )

    def to_hf(self, nested: bool = True) -> dict[str, Any]:
        """A HF config.json dict in the K2.6 (nested) or K2 (flat) layout; used to write test checkpoints."""
        text = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "kimi_k2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "routed_scaling_factor": self.routed_scaling_factor,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "norm_topk_prob": self.norm_topk_prob,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "num_nextn_predict_layers": 0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0],
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "bfloat16",
        }
        if self.rope_scaling is not None:
            text["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(self.rope_scaling)}
        if self.experts_int4:
            text["quantization_config"] = {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "type": "int", "num_bits": 4, "group_size": self.quant_group_size, "strategy": "group",
                    "symmetric": True, "dynamic": False, "observer": "minmax"}}},
                "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                           "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
            }
        if not nested:
            return text
        return {
            "architectures": ["KimiK25ForConditionalGeneration"],
            "model_type": "kimi_k25",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0],
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": False,
            "text_config": text,
            "vision_config": {"vt_num_hidden_layers": 0},
        }


# ---------------------------------------------------------------- presets
KIMI_K26 = KimiConfig(eos_token_ids=(163586, 163585))

# Tiny configs keep every structural feature (MLA with YaRN, dense + MoE layers, shared expert, INT4 experts)
# at sizes that compile in seconds on CPU.
TINY = KimiConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    routed_scaling_factor=2.827, n_group=1, topk_group=1, rms_norm_eps=1e-5, rope_theta=50000.0,
    rope_scaling=YarnScaling(factor=64.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0),
    max_position_embeddings=262144, experts_int4=True, bos_token_id=1, eos_token_ids=(2,), pad_token_id=0,
)
TINY_BF16 = dataclasses.replace(TINY, experts_int4=False)

PRESETS: dict[str, KimiConfig] = {
    "kimi-k2.6": KIMI_K26,
    "tiny": TINY,
    "tiny-bf16": TINY_BF16,
}


def preset(name: str) -> KimiConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
