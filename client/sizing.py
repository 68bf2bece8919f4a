"""What one MoE layer needs, as capacities; FlashInfer's arithmetic, as the client names it.

:func:`layer_capacities` is the per-layer rule, for the
arguments vLLM 0.30's manager takes: the dispatch payload per token is the
hidden states, their scale factors and the int32 expert ids plus float32
weights of the top-k routing; the combine payload is bf16 hidden states. It
is :func:`moe_sidecar.client.vllm_sizing.classify_call` with 0.30's keywords,
where the other generations' rules live beside it.

The per-layer rule itself (:func:`dispatch_bytes_per_token`,
:func:`combine_bytes_per_token`) lives in :mod:`moe_sidecar.core.sizing`,
because the decision core needs it too; the ``MoeAlltoAll`` workspace
arithmetic lives in its release's module,
:mod:`moe_sidecar.flashinfer.v0_7_2_post1`. Both are re-exported here.
"""

from __future__ import annotations

from dataclasses import replace

from moe_sidecar.client.vllm_sizing import classify_call
from moe_sidecar.core.limits import check_capacities
from moe_sidecar.core.plan import Capacities
from moe_sidecar.core.sizing import combine_bytes_per_token, dispatch_bytes_per_token
from moe_sidecar.flashinfer.v0_7_2_post1 import (
    ALIGNMENT,
    KMAX_TOP_K,
    AuxOffsets,
    align,
    aux_data_size,
    aux_offsets,
    workspace_size_per_rank,
)

__all__ = [
    "ALIGNMENT",
    "KMAX_TOP_K",
    "AuxOffsets",
    "align",
    "aux_data_size",
    "aux_offsets",
    "combine_bytes_per_token",
    "dispatch_bytes_per_token",
    "layer_capacities",
    "workspace_size_per_rank",
]


def layer_capacities(
    ep_size: int,
    max_num_tokens: int,
    top_k: int,
    num_experts: int,
    hidden_size: int,
    x_bytes_per_token: int,
    x_sf_bytes_per_token: int,
    eplb_experts: int = 0,
) -> Capacities:
    """The capacities one layer needs.

    Raises:
        InvalidArgument: an argument out of range, naming it (also when the
            derived workspace at ``ep_size`` would be absurd, or when
            ``x_bytes_per_token`` is below ``hidden_size // 2``).
    """
    call = classify_call(
        ep_size,
        max_num_tokens,
        top_k,
        num_experts,
        hidden_size,
        (),
        {"x_bytes_per_token": x_bytes_per_token, "x_sf_bytes_per_token": x_sf_bytes_per_token},
    )
    capacities = replace(call.capacities, eplb_experts=eplb_experts)
    check_capacities("layer", capacities, ep_size)
    return capacities
