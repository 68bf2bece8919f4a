"""The widest dispatch row per hidden size a manager's layers asked for, and
how FlashInfer's moe_ep object describes a plan from them."""

from __future__ import annotations

from moe_sidecar.client.backends import CommunicationSpec

# The 0.33 description of a row size is vLLM's call form, borrowed from its
# room (tests/unit/test_import_graph.py lists what is borrowed).
from moe_sidecar.client.engines.vllm.sizing import describe_activation
from moe_sidecar.client.layer_need import Layout
from moe_sidecar.core.plan import Plan
from moe_sidecar.core.sizing import routing_bytes_per_token
from moe_sidecar.flashinfer.v0_7_2_post1 import DISPATCH_FORMAT_BYTES

__all__ = ["DispatchLayouts"]


class DispatchLayouts:
    """Per hidden size, the widest dispatch row a layer asked for (what
    ``get_communication().params`` describes)."""

    def __init__(self) -> None:
        self._widest: dict[int, Layout] = {}

    def remember(self, layout: Layout) -> None:
        """Keeps ``layout`` when it is the widest of its hidden size so far."""
        known = self._widest.get(layout.hidden_size)
        if known is None or layout.activation_bytes > known.activation_bytes:
            self._widest[layout.hidden_size] = layout

    def communication_spec(
        self, plan: Plan, ep_size: int, ep_rank: int, low_precision_combine: bool
    ) -> CommunicationSpec:
        """How the moe_ep object describes ``plan``: the largest hidden size
        and the widest dispatch row asked for at it, plus the extra bytes that
        make up the plan's dispatch bytes (vLLM 0.33's own description of the
        same union), combining in FP8 when ``low_precision_combine``."""
        capacities = plan.capacities
        hidden = capacities.combine_bytes_per_token // 2
        activation = capacities.dispatch_bytes_per_token - routing_bytes_per_token(capacities.top_k)
        layout = self._widest.get(hidden)
        if layout is not None and layout.format_bytes <= activation:
            described: object = layout.dispatch_format
            name = layout.format_name
            format_bytes = layout.format_bytes
        else:
            # A plan wider than any layer of this process (restored from the
            # sidecar): the format that best describes its bytes.
            name, _ = describe_activation(hidden, activation)
            described = name
            format_bytes = 2 * hidden if name is None else DISPATCH_FORMAT_BYTES[name](hidden)
        return CommunicationSpec(
            ep_size=ep_size,
            ep_rank=ep_rank,
            num_experts=capacities.num_experts,
            top_k=capacities.top_k,
            max_tokens_per_rank=capacities.max_tokens,
            hidden_size=hidden,
            dispatch_format=described,
            dispatch_format_name=name,
            extra_payload_bytes_per_token=max(activation - format_bytes, 0),
            use_low_precision_combine=low_precision_combine,
        )
