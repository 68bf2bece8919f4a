"""What one MoE layer asks of the all-to-all, in no engine's argument forms.

An engine's room (:mod:`moe_sidecar.client.engines`) turns its own
``initialize()`` arguments into a :class:`LayerNeed`; the engine-neutral
manager (:mod:`moe_sidecar.client.manager`) runs one round of the protocol
for it. Pure: no torch, no FlashInfer.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_sidecar.core.plan import Capacities

__all__ = ["LayerNeed", "Layout"]


@dataclass(frozen=True)
class Layout:
    """A layer's dispatch row as FlashInfer's ``moe_ep`` object describes it:
    a ``QuantFormat`` (None: bf16 rows) at ``hidden_size`` plus extra bytes."""

    hidden_size: int
    dispatch_format: object
    """What the caller passed (a ``QuantFormat``, its name, or None); for a
    layer its engine sized in bytes, the name of the format that best
    describes them."""
    format_name: str | None
    format_bytes: int
    """``MoEEpCommParams.dispatch_bytes_per_token`` of this format and hidden size."""
    extra_payload_bytes_per_token: int

    @property
    def activation_bytes(self) -> int:
        """Activation and scale bytes per token the layer dispatches."""
        return self.format_bytes + self.extra_payload_bytes_per_token


@dataclass(frozen=True)
class LayerNeed:
    """One MoE layer's need: what the manager proposes for it, and the
    dispatch row the ``moe_ep`` object over the workspace describes."""

    capacities: Capacities
    """What the layer needs of the workspace (checked by its engine's sizing)."""
    layout: Layout
    layer: str = ""
    """A label for the layer (e.g. ``"model.layers.61.mlp"``), used in errors
    and the sidecar's history."""
