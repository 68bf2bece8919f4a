"""The capacity vector's one field table: every field's name, range and why. Pure.

:class:`~moe_sidecar.core.plan.Capacities` declares the fields as a dataclass;
:data:`CAPACITY_FIELDS` declares, in the same order, what each one means
outside Python: its range (checked by :mod:`moe_sidecar.core.limits`), how it
reads for people (:mod:`moe_sidecar.wire.display`) and what a document or
message written before the field existed holds for it. The gRPC codec, the
stored-row codec, the display and the range checks iterate this table, so a
new capacity field is a dataclass field, a row here and a field of the
``.proto``'s ``Capacities`` message (the unit tests check that the three agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = [
    "CAPACITY_FIELDS",
    "MAX_BYTES_PER_TOKEN",
    "MAX_NUM_EXPERTS",
    "MAX_TOKENS",
    "MAX_TOP_K",
    "CapacityField",
    "capacity_field",
]

MAX_TOP_K: Final = 22
"""FlashInfer's kMaxTopK."""
MAX_NUM_EXPERTS: Final = 1 << 16
MAX_TOKENS: Final = (1 << 31) - 1
"""FlashInfer holds max_num_tokens in an int32."""
MAX_BYTES_PER_TOKEN: Final = 1 << 22
"""4 MiB per token: far above any layer (a 65,536-wide fp32 row is 256 KiB)."""


@dataclass(frozen=True)
class CapacityField:
    """One field of the capacity vector."""

    name: str
    """The attribute of :class:`~moe_sidecar.core.plan.Capacities`, the key in
    stored documents and the field of the wire's ``Capacities`` message."""
    low: int
    """The least value (raised to ``ep_size`` when :attr:`at_least_ep_size`)."""
    high: int
    """The greatest value."""
    why: str = ""
    """Why the range is what it is (shown in a refusal); ``{ep_size}`` is
    replaced by the group's EP size."""
    at_least_ep_size: bool = False
    """The least value is the group's EP size (FlashInfer needs an expert per rank)."""
    label: str = ""
    """The name people read (``""``: :attr:`name`)."""
    unit: str = ""
    """Shown after the value, e.g. ``" B/token"``."""
    shown_when_zero: bool = True
    """False: the text form leaves the field out while it is 0 (an unused feature)."""
    missing_reads_as: int | None = None
    """What a stored document written before the field existed holds for it
    (None: the field is required in every document that carries capacities)."""

    def lowest(self, ep_size: int) -> int:
        """The least value in a group of ``ep_size`` ranks."""
        return max(self.low, ep_size) if self.at_least_ep_size else self.low

    def reason(self, ep_size: int) -> str:
        """:attr:`why`, for a group of ``ep_size`` ranks."""
        return self.why.replace("{ep_size}", str(ep_size))


CAPACITY_FIELDS: Final[tuple[CapacityField, ...]] = (
    CapacityField("max_tokens", 1, MAX_TOKENS),
    CapacityField(
        "dispatch_bytes_per_token", 1, MAX_BYTES_PER_TOKEN, label="dispatch", unit=" B/token"
    ),
    CapacityField(
        "combine_bytes_per_token", 1, MAX_BYTES_PER_TOKEN, label="combine", unit=" B/token"
    ),
    CapacityField("top_k", 1, MAX_TOP_K, "FlashInfer's kMaxTopK"),
    CapacityField(
        "num_experts",
        1,
        MAX_NUM_EXPERTS,
        "FlashInfer needs num_experts >= ep_size={ep_size}",
        at_least_ep_size=True,
    ),
    CapacityField("eplb_experts", 0, MAX_NUM_EXPERTS, shown_when_zero=False),
)
"""Every field of :class:`~moe_sidecar.core.plan.Capacities`, in declaration order."""


def capacity_field(name: str) -> CapacityField:
    """The table's row for field ``name``.

    Raises:
        KeyError: no capacity field of that name.
    """
    for field in CAPACITY_FIELDS:
        if field.name == name:
            return field
    raise KeyError(name)
