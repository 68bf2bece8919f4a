"""What one MoE layer needs, as capacities; FlashInfer's arithmetic, as the client names it.

:func:`layer_capacities` is the per-layer rule, for a layer stated in
bytes per token (the arguments vLLM 0.30's manager takes): the dispatch
payload per token is the hidden states, their scale factors and the int32
expert ids plus float32 weights of the top-k routing; the combine payload is
bf16 hidden states. Each engine's own argument forms are its room's
(vLLM's: :func:`moe_sidecar.client.engines.vllm.sizing.classify_call`, which
gives the same capacities for 0.30's keywords).

The per-layer rule itself (:func:`dispatch_bytes_per_token`,
:func:`combine_bytes_per_token`) lives in :mod:`moe_sidecar.core.sizing`,
because the decision core needs it too; the ``MoeAlltoAll`` workspace
arithmetic lives in its release's module,
:mod:`moe_sidecar.flashinfer.v0_7_2_post1`. Both are re-exported here.
"""

from __future__ import annotations

from moe_sidecar.core import layer
from moe_sidecar.core.limits import MAX_BYTES_PER_TOKEN, check_capacities, check_count
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
    check_count("hidden_size", hidden_size, 1, MAX_BYTES_PER_TOKEN)
    check_count(
        "x_bytes_per_token",
        x_bytes_per_token,
        max(hidden_size // 2, 1),
        MAX_BYTES_PER_TOKEN,
        "at least hidden_size // 2, the fewest bytes a token's activations take (4-bit)",
    )
    check_count("x_sf_bytes_per_token", x_sf_bytes_per_token, 0, MAX_BYTES_PER_TOKEN)
    capacities = layer.layer_capacities(
        max_num_tokens,
        top_k,
        num_experts,
        hidden_size,
        x_bytes_per_token + x_sf_bytes_per_token,
        eplb_experts,
    )
    check_capacities("layer", capacities, ep_size)
    return capacities
