"""The models ``moe-sidecar simulate`` runs: their MoE layers, in the order their ranks build them.

Pure: no torch, so the presets list without the client extra's weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = ["MODELS", "ModelPreset", "MoeLayer", "Quantization"]

Quantization = Literal["nvfp4", "bf16"]


@dataclass(frozen=True)
class MoeLayer:
    """One MoE layer as an inference server describes it to the manager."""

    name: str
    quant: Quantization
    hidden_size: int
    top_k: int
    num_experts: int

    @property
    def x_bytes_per_token(self) -> int:
        """Dispatched hidden states: two FP4 values per byte, or bf16."""
        return self.hidden_size // 2 if self.quant == "nvfp4" else self.hidden_size * 2

    @property
    def x_sf_bytes_per_token(self) -> int:
        """NVFP4's one FP8 scale per 16 values; bf16 has none."""
        return self.hidden_size // 16 if self.quant == "nvfp4" else 0


@dataclass(frozen=True)
class ModelPreset:
    """A model's MoE layers, in the order its ranks initialize them."""

    name: str
    summary: str
    layers: tuple[MoeLayer, ...]


def _deepseek_v3() -> ModelPreset:
    # DeepSeek-V3: layers 0-2 are dense, 3-60 are MoE, 61 is the MTP head.
    # Quantized to NVFP4 the base MoE layers dispatch hidden/2 + hidden/16
    # bytes per token; the MTP head stays bf16 and dispatches hidden*2.
    def layer(index: int, quant: Quantization) -> MoeLayer:
        """DeepSeek-V3's MoE layer ``index``, with its experts in ``quant``."""
        return MoeLayer(f"model.layers.{index}.mlp", quant, 7168, top_k=8, num_experts=256)

    base = tuple(layer(i, "nvfp4") for i in range(3, 61))
    mtp = layer(61, "bf16")
    return ModelPreset(
        "deepseek-v3",
        "DeepSeek-V3 with NVFP4 experts: 58 NVFP4 MoE layers, then the bf16 MTP layer "
        "(hidden 7168, top_k 8, 256 experts); the MTP layer grows the workspace",
        (*base, mtp),
    )


def _qwen3_30b_a3b() -> ModelPreset:
    return ModelPreset(
        "qwen3-30b-a3b",
        "Qwen3-30B-A3B in bf16: 48 identical MoE layers (hidden 2048, top_k 8, 128 experts); "
        "homogeneous, so one build and no growth",
        tuple(
            MoeLayer(f"model.layers.{i}.mlp", "bf16", 2048, top_k=8, num_experts=128)
            for i in range(48)
        ),
    )


MODELS: Mapping[str, ModelPreset] = {p.name: p for p in (_deepseek_v3(), _qwen3_30b_a3b())}
"""The presets ``--model`` accepts, by name."""
