"""A DeepSeek-V3 ``config.json`` for SGLang's ServerArgs (no weights: none are loaded)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["HIDDEN", "NUM_EXPERTS", "TOP_K", "write_model"]

HIDDEN = 7168
TOP_K = 8
NUM_EXPERTS = 256

_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": HIDDEN,
    "num_experts_per_tok": TOP_K,
    "n_routed_experts": NUM_EXPERTS,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "moe_layer_freq": 1,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def write_model(directory: Path) -> Path:
    """Writes the config into ``directory`` (a model path SGLang reads offline)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(_CONFIG))
    return directory
