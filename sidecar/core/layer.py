"""The capacities one MoE layer needs, by the one per-layer rule. Pure.

Every engine sizes a layer alike: dispatch bytes per token are the
activations and their scales (and any extra payload) plus the top-k routing,
combine bytes per token are bf16 hidden states
(:func:`~moe_sidecar.core.sizing.dispatch_bytes_per_token`,
:func:`~moe_sidecar.core.sizing.combine_bytes_per_token`). Each engine's
sizing in the client works out the activation bytes of a call and builds
the layer's capacities here.
"""

from __future__ import annotations

from moe_sidecar.core.plan import Capacities
from moe_sidecar.core.sizing import combine_bytes_per_token, dispatch_bytes_per_token

__all__ = ["layer_capacities"]


def layer_capacities(
    max_tokens: int,
    top_k: int,
    num_experts: int,
    hidden_size: int,
    activation_bytes: int,
    eplb_experts: int = 0,
) -> Capacities:
    """The capacities of a layer dispatching ``activation_bytes`` per token
    (activations, scales and extras) at ``hidden_size``; ranges unchecked
    (:func:`moe_sidecar.core.limits.check_capacities` names a bad field).

    A ``top_k`` that is not an integer adds no routing bytes, so the range
    check names ``top_k`` rather than this arithmetic failing on it.
    """
    routed_top_k = top_k if isinstance(top_k, int) and not isinstance(top_k, bool) else 0
    return Capacities(
        max_tokens=max_tokens,
        dispatch_bytes_per_token=dispatch_bytes_per_token(routed_top_k, activation_bytes),
        combine_bytes_per_token=combine_bytes_per_token(hidden_size),
        top_k=top_k,
        num_experts=num_experts,
        eplb_experts=eplb_experts,
    )
