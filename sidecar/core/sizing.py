"""The one per-layer rule of a MoE layer's payloads per token, in pure Python.

Every engine generation sizes a layer so (:func:`dispatch_bytes_per_token`,
:func:`combine_bytes_per_token`); the capacities of a layer are built from
it in :mod:`moe_sidecar.core.layer`. No release's workspace arithmetic is
here: each FlashInfer release's is in its module of
:mod:`moe_sidecar.flashinfer`, and the core takes the size function as an
argument (:class:`moe_sidecar.core.limits.WorkspaceCeiling`).
"""

from __future__ import annotations

__all__ = [
    "BF16_BYTES",
    "FLOAT32_BYTES",
    "INT32_BYTES",
    "bf16_row_bytes",
    "combine_bytes_per_token",
    "dispatch_bytes_per_token",
    "routing_bytes_per_token",
]

INT32_BYTES = 4
"""An expert id of the top-k routing (int32)."""
FLOAT32_BYTES = 4
"""A routing weight of the top-k routing (float32)."""
BF16_BYTES = 2
"""One element of a bf16 row (the combine payload, and an engine's default dispatch rows)."""


def bf16_row_bytes(hidden_size: int) -> int:
    """Bytes of one token's bf16 hidden states."""
    return BF16_BYTES * hidden_size


def routing_bytes_per_token(top_k: int) -> int:
    """Bytes per token of the routing payloads: an int32 expert id and a
    float32 weight for each of the ``top_k`` experts."""
    return (INT32_BYTES + FLOAT32_BYTES) * top_k


def dispatch_bytes_per_token(
    top_k: int,
    x_bytes_per_token: int,
    x_sf_bytes_per_token: int = 0,
    extra_payload_bytes_per_token: int = 0,
) -> int:
    """The per-layer rule for the dispatch payload per token: the hidden
    states, their scale factors, any extra payload, and the top-k routing
    (:func:`routing_bytes_per_token`). Every engine sizes a layer so."""
    return (
        x_bytes_per_token
        + x_sf_bytes_per_token
        + extra_payload_bytes_per_token
        + routing_bytes_per_token(top_k)
    )


def combine_bytes_per_token(hidden_size: int) -> int:
    """The per-layer rule for the combine payload per token: bf16 hidden states."""
    return bf16_row_bytes(hidden_size)
