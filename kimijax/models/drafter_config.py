"""DFlash drafter configuration: the frozen `DrafterConfig`, its z-lab / HF `config.json` translation, and the
errors a drafter raises. The modules, the `Drafter` object and checkpoint reading live in models/drafter.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from kimijax.config import ConfigError, YarnScaling, yarn_mscale
from kimijax.models.common import yarn_inv_freq


class DrafterError(ValueError):
    """A drafter checkpoint is unreadable, incomplete, mis-shaped, or does not fit the target."""


FULL, SLIDING = "full_attention", "sliding_attention"
_DTYPES = ("bfloat16", "float32", "float16")
# dflash_config keys of DFlash2 (path selector + dynamic convolutions): a different architecture.
_DFLASH2_KEYS = ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The layer choice of the z-lab reference when `target_layer_ids` is absent (evenly spaced in [1, T-3])."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A DFlash drafter. Defaults: z-lab Kimi-K2.5-DFlash (intermediate_size inferred, not read from a config).

    yarn_attention_factor picks the cos/sin amplitude under YaRN:
      "ratio"   as HF computes it: mscale/mscale_all_dim when both are set, else 1 + 0.1 ln(factor)
      "legacy"  1 + 0.1 ln(factor) always (what vllm-ascend injects for Kimi-K2.5-DFlash)
      a float   that amplitude (HF's explicit rope_scaling.attention_factor)
    """
    hidden_size: int = 7168
    num_hidden_layers: int = 6
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 18432
    rms_norm_eps: float = 1e-6
    rope_theta: float = 50000.0
    rope_scaling: YarnScaling | None = YarnScaling()
    yarn_attention_factor: str | float = "ratio"
    block_size: int = 8
    mask_token_id: int = 163838
    target_layer_ids: tuple[int, ...] = (1, 12, 24, 35, 47, 58)
    num_target_layers: int | None = 61
    layer_types: tuple[str, ...] | None = None  # None: every layer full attention
    sliding_window: int | None = None
    is_causal: bool | None = None  # None: sliding layers causal inside the block, full layers bidirectional
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    vocab_size: int | None = 163840
    max_position_embeddings: int = 262144
    dtype: str = "bfloat16"

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even (NeoX rope)")
        if self.block_size < 2:
            raise ConfigError(f"block_size={self.block_size} must be >= 2 (bonus + at least one mask slot)")
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids is empty")
        if min(self.target_layer_ids) < 0:
            raise ConfigError(f"target_layer_ids {list(self.target_layer_ids)} contain a negative id")
        if self.num_target_layers is not None and max(self.target_layer_ids) >= self.num_target_layers:
            raise ConfigError(f"target_layer_ids {list(self.target_layer_ids)} reach past "
                              f"num_target_layers={self.num_target_layers}")
        if self.mask_token_id < 0:
            raise ConfigError(f"mask_token_id={self.mask_token_id} is negative")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ConfigError(f"layer_types has {len(self.layer_types)} entries for "
                                  f"num_hidden_layers={self.num_hidden_layers}")
            bad = [t for t in self.layer_types if t not in (FULL, SLIDING)]
            if bad:
                raise ConfigError(f"unsupported layer type {bad[0]!r} (kimijax supports {FULL!r} and {SLIDING!r})")
            if SLIDING in self.layer_types and not (isinstance(self.sliding_window, int) and self.sliding_window >= 1):
                raise ConfigError(f"layer_types contain {SLIDING!r} but sliding_window={self.sliding_window!r} "
                                  "is not a positive int")
        yaf = self.yarn_attention_factor
        if isinstance(yaf, str):
            if yaf not in ("ratio", "legacy"):
                raise ConfigError(f"yarn_attention_factor={yaf!r}: expected 'ratio', 'legacy' or a number")
        elif not (isinstance(yaf, (int, float)) and yaf > 0):
            raise ConfigError(f"yarn_attention_factor={yaf!r}: expected 'ratio', 'legacy' or a positive number")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"drafter dtype {self.dtype!r} not in {_DTYPES}")

    # ---- derived
    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def layer_window(self, i: int) -> int | None:
        """The trained sliding window of draft layer i (None for full attention)."""
        return self.sliding_window if self.layer_types is not None and self.layer_types[i] == SLIDING else None

    def layer_causal(self, i: int) -> bool:
        """Whether draft layer i is causal inside the block (z-lab: sliding layers are, unless is_causal says)."""
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_window(i) is not None

    @property
    def rope_amplitude(self) -> float:
        """The cos/sin amplitude (YaRN attention factor) the drafter's rope uses."""
        if self.rope_scaling is None:
            return 1.0
        yaf = self.yarn_attention_factor
        if not isinstance(yaf, str):
            return float(yaf)
        if yaf == "legacy":
            return yarn_mscale(self.rope_scaling.factor)
        return yarn_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)[1]

    def rope_tables(self) -> tuple[np.ndarray, float]:
        """(inv_freq [head_dim/2] float32, amplitude)."""
        inv, _ = yarn_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)
        return inv, self.rope_amplitude

    # ---- HF config.json (z-lab format)
    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, dtype: str = "bfloat16",
                yarn_attention_factor: str | float | None = None) -> "DrafterConfig":
        """Read a z-lab DFlash config.json dict. `yarn_attention_factor` overrides the config's choice."""
        dc = hf.get("dflash_config") or {}

        def dv(k, default=None):  # dflash_config first, then the top level (as the z-lab reference reads them)
            v = dc.get(k)
            return hf.get(k, default) if v is None else v

        def req(k):
            if hf.get(k) is None:
                raise ConfigError(f"drafter config.json lacks required field {k!r}")
            return hf[k]

        arch = list(hf.get("architectures") or [])
        if any("DFlash2" in a for a in arch) or any(k in dc for k in _DFLASH2_KEYS):
            raise ConfigError("DFlash2 drafters (path selector, dynamic convolutions) are not supported; "
                              "kimijax runs DFlashDraftModel checkpoints")
        if arch and "DFlashDraftModel" not in arch:
            raise ConfigError(f"unsupported drafter architectures {arch}: expected ['DFlashDraftModel']")
        if hf.get("model_type") not in (None, "qwen3"):
            raise ConfigError(f"unsupported drafter model_type {hf.get('model_type')!r}: expected 'qwen3'")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported hidden_act={hf['hidden_act']!r} (kimijax supports 'silu')")
        for k in ("attention_bias", "mlp_bias"):
            if hf.get(k):
                raise ConfigError(f"unsupported {k}=true (DFlash drafters have no biases)")

        hidden = int(req("hidden_size"))
        n_layers = int(req("num_hidden_layers"))
        n_heads = int(req("num_attention_heads"))
        n_kv = int(hf.get("num_key_value_heads") or n_heads)
        head_dim = int(hf.get("head_dim") or hidden // n_heads)

        # rope: transformers<5 `rope_theta` + `rope_scaling`; transformers 5 `rope_parameters`
        rp = hf.get("rope_parameters")
        rs = rp if rp is not None else hf.get("rope_scaling")
        theta = hf.get("rope_theta")
        if theta is None:
            theta = (rp or {}).get("rope_theta", 10000.0)
        yarn, yaf = None, "ratio"
        if rs is not None:
            rtype = rs.get("rope_type", rs.get("type"))
            if "rope_type" in rs and "type" in rs and rs["type"] != rs["rope_type"]:
                raise ConfigError(f"rope_scaling has rope_type={rs['rope_type']!r} but type={rs['type']!r}")
            if rtype == "yarn":
                if rs.get("truncate") is False:
                    raise ConfigError("unsupported rope_scaling.truncate=false (kimijax implements truncated YaRN)")
                # mscale fields stay 0 when absent: HF then falls back to 1 + 0.1 ln(factor)
                yarn = YarnScaling(
                    factor=float(rs["factor"]),
                    original_max_position_embeddings=int(rs.get("original_max_position_embeddings") or
                                                         hf.get("max_position_embeddings", 4096)),
                    beta_fast=float(rs.get("beta_fast") or 32.0),
                    beta_slow=float(rs.get("beta_slow") or 1.0),
                    mscale=float(rs.get("mscale") or 0.0),
                    mscale_all_dim=float(rs.get("mscale_all_dim") or 0.0),
                )
                if rs.get("attention_factor") is not None:
                    yaf = float(rs["attention_factor"])
            elif rtype not in (None, "default"):
                raise ConfigError(f"unsupported drafter rope type {rtype!r} (kimijax supports 'yarn' or none)")
        if yarn_attention_factor is not None:
            yaf = yarn_attention_factor

        layer_types = hf.get("layer_types")
        if layer_types is None and hf.get("use_sliding_window"):
            mwl = int(hf.get("max_window_layers") or 0)
            layer_types = [SLIDING if i >= mwl else FULL for i in range(n_layers)]
        if layer_types is not None:
            layer_types = tuple(layer_types)
            if all(t == FULL for t in layer_types) and len(layer_types) == n_layers:
                layer_types = None
        sliding = hf.get("sliding_window")
        if layer_types is None:
            sliding = None

        mask_id = dv("mask_token_id")
        if mask_id is None:
            raise ConfigError("drafter config.json lacks dflash_config.mask_token_id")
        n_target = dv("num_target_layers")
        ids = dv("target_layer_ids")
        if ids is None:
            if n_target is None:
                raise ConfigError("drafter config.json has neither dflash_config.target_layer_ids nor "
                                  "num_target_layers")
            ids = default_target_layer_ids(int(n_target), n_layers)
        is_causal = dv("is_causal")
        softcap = dv("final_logit_softcapping")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            intermediate_size=int(req("intermediate_size")),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=yarn,
            yarn_attention_factor=yaf,
            block_size=int(dv("block_size", 16)),
            mask_token_id=int(mask_id),
            target_layer_ids=tuple(int(i) for i in ids),
            num_target_layers=None if n_target is None else int(n_target),
            layer_types=layer_types,
            sliding_window=None if sliding is None else int(sliding),
            is_causal=None if is_causal is None else bool(is_causal),
            input_embedding_scale=float(dv("input_embedding_scale", 1.0)),
            output_multiplier=float(dv("output_multiplier", 1.0)),
            final_logit_softcapping=None if softcap is None or float(softcap) <= 0 else float(softcap),
            vocab_size=None if hf.get("vocab_size") is None else int(hf["vocab_size"]),
            max_position_embeddings=int(hf.get("max_position_embeddings", 262144)),
            dtype=dtype,
        )

    def to_hf(self) -> dict[str, Any]:
        """A z-lab-format config.json dict (what save_drafter writes)."""
        dc: dict[str, Any] = {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id}
        if self.input_embedding_scale != 1.0:
            dc["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            dc["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            dc["final_logit_softcapping"] = self.final_logit_softcapping
        out: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "dflash_config": dc,
            "torch_dtype": "bfloat16",
        }
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.is_causal is not None:  # the z-lab reference reads it from the top level
            out["is_causal"] = self.is_causal
        if self.vocab_size is not None:
            out["vocab_size"] = self.vocab_size
        if self.rope_scaling is not None:
            y = self.rope_scaling
            rs: dict[str, Any] = {"rope_type": "yarn", "type": "yarn", "factor": y.factor,
                                  "original_max_position_embeddings": y.original_max_position_embeddings,
                                  "beta_fast": y.beta_fast, "beta_slow": y.beta_slow}
            if y.mscale:
                rs["mscale"] = y.mscale
            if y.mscale_all_dim:
                rs["mscale_all_dim"] = y.mscale_all_dim
            if self.yarn_attention_factor != "ratio":  # HF honours an explicit attention_factor
                rs["attention_factor"] = self.rope_amplitude
            out["rope_scaling"] = rs
        else:
            out["rope_scaling"] = None
        lt = self.layer_types or (FULL,) * self.num_hidden_layers
        out["layer_types"] = list(lt)
        out["use_sliding_window"] = SLIDING in lt
        out["sliding_window"] = self.sliding_window
        return out


KIMI_K25_DFLASH = DrafterConfig()
