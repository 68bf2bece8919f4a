"""Every number's range, checked in one place on every path. Pure.

The same checks run on what arrives (a request), on what is loaded (a stored
row, a plan from another node) and on what the core computes (a grown plan),
so the sidecar never stores, answers or loads a value it would refuse as
input. A failed check names the field and the value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, TypeAlias

from moe_sidecar.core.capacity_fields import (
    CAPACITY_FIELDS,
    MAX_BYTES_PER_TOKEN,
    MAX_NUM_EXPERTS,
    MAX_TOKENS,
    MAX_TOP_K,
)
from moe_sidecar.core.errors import InvalidArgument
from moe_sidecar.core.plan import Capacities, Plan

__all__ = [
    "DEFAULT_MAX_WORKSPACE_BYTES",
    "EP_SIZE_REASON",
    "MAX_BUILD_SECONDS",
    "MAX_BYTES_PER_TOKEN",
    "MAX_EP_SIZE",
    "MAX_GENERATION",
    "MAX_NAME_LENGTH",
    "MAX_NUM_EXPERTS",
    "MAX_ROUND",
    "MAX_TIME",
    "MAX_TOKENS",
    "MAX_TOP_K",
    "MAX_WORKSPACE_BYTES",
    "MIN_TIME",
    "WorkspaceCeiling",
    "WorkspaceSize",
    "check_capacities",
    "check_count",
    "check_name",
    "check_plan",
    "check_seconds",
    "check_workspace_ceiling",
    "payload_bytes",
]

MAX_EP_SIZE: Final = 64
"""The largest EP group the sidecar holds. It is the ``kMaxRanks`` of the
oldest FlashInfer release the project drives (``moe_sidecar.flashinfer``),
and the group size the sidecar's state and memory bounds are measured for
(``--max-groups`` of the largest groups under 64 MiB of state and 256 MiB of
memory, ``tests/integration/test_attacks.py``). The newer release's
one-sided all-to-all takes 256 ranks (without its Lamport transport, 64),
but the largest group's row grows from 269,380 bytes at 64 ranks to 681,940
at 256, so 128 such groups would no longer fit 64 MiB: a larger limit needs
those bounds re-measured first."""

EP_SIZE_REASON: Final = (
    f"the sidecar holds EP groups of at most {MAX_EP_SIZE} ranks "
    "(the oldest FlashInfer release's limit, and what its state and memory bounds are "
    "measured for)"
)
"""Why :data:`MAX_EP_SIZE` is the limit, as a refusal says it."""
MAX_WORKSPACE_BYTES: Final = 1 << 40
"""A plan whose payloads alone exceed 1 TiB per rank is refused as absurd
(and no ceiling may be set above it)."""
DEFAULT_MAX_WORKSPACE_BYTES: Final = 64 << 30
"""The default per-rank workspace ceiling (the sidecar's ``--max-workspace-bytes``):
64 GiB, which no real model's all-to-all reaches (DeepSeek-V3 shapes at EP 8
and 128 tokens map about 15 MB) while a plan of it would not fit beside any
model on today's GPUs."""
MAX_GENERATION: Final = (1 << 53) - 1
"""Generations and epochs stay exact in JSON, in a double and in uint64."""
MAX_ROUND: Final = (1 << 31) - 1
MAX_NAME_LENGTH: Final = 256
"""Longest group name, layer label or lifetime token."""
MAX_BUILD_SECONDS: Final = 86400.0
MIN_TIME: Final = -62135596800.0
MAX_TIME: Final = 253402300799.0
"""Seconds since the epoch that a protobuf Timestamp holds (years 1 to 9999):
every stored time must be one, or no answer that shows it can be encoded."""


def check_count(field: str, value: int, low: int, high: int, why: str = "") -> None:
    """Checks that the integer ``value`` lies in ``[low, high]``.

    Raises:
        InvalidArgument: naming ``field`` and ``value``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        suffix = f" ({why})" if why else ""
        raise InvalidArgument.of(field, value, f"must be an integer in [{low}, {high}]{suffix}")


def check_seconds(field: str, value: float) -> None:
    """Checks a duration in seconds: finite, in ``[0, MAX_BUILD_SECONDS)``.

    Raises:
        InvalidArgument: naming ``field`` and ``value``.
    """
    if not (isinstance(value, (int, float)) and math.isfinite(value)) or not (
        0.0 <= value < MAX_BUILD_SECONDS
    ):
        raise InvalidArgument.of(field, value, f"must be in [0, {MAX_BUILD_SECONDS:g}) seconds")


def check_name(field: str, value: str, *, allow_empty: bool) -> None:
    """Checks a name or label: printable, at most :data:`MAX_NAME_LENGTH` characters.

    Raises:
        InvalidArgument: naming ``field`` and ``value`` (quoted by
            :func:`~moe_sidecar.core.errors.quote_name`, so cut when long).
    """
    if not isinstance(value, str):
        raise InvalidArgument.of(field, value, "must be a string")
    if not value and not allow_empty:
        raise InvalidArgument.of(field, value, "must not be empty")
    if len(value) > MAX_NAME_LENGTH:
        # The quoted name says its length.
        raise InvalidArgument.of_name(field, value, f"at most {MAX_NAME_LENGTH} characters")
    if not value.isprintable():
        raise InvalidArgument.of_name(field, value, "must hold printable characters only")


def payload_bytes(capacities: Capacities, ep_size: int) -> int:
    """The dispatch and combine payload bytes per rank of ``capacities`` at
    ``ep_size``: what every release's workspace holds at least (each adds its
    own auxiliary regions and alignment)."""
    c = capacities
    return ep_size * c.max_tokens * (c.dispatch_bytes_per_token + c.combine_bytes_per_token)


def check_capacities(prefix: str, capacities: Capacities, ep_size: int) -> None:
    """Checks every field of ``capacities`` and the payloads they derive at ``ep_size``.

    Raises:
        InvalidArgument: naming the first bad field (``prefix.field``) and its value.
    """
    c = capacities
    for field in CAPACITY_FIELDS:
        check_count(
            f"{prefix}.{field.name}",
            getattr(c, field.name),
            field.lowest(ep_size),
            field.high,
            field.reason(ep_size),
        )
    payload = payload_bytes(c, ep_size)
    if payload > MAX_WORKSPACE_BYTES:
        raise InvalidArgument(
            f"{prefix}: max_tokens={c.max_tokens}, dispatch_bytes_per_token="
            f"{c.dispatch_bytes_per_token}, combine_bytes_per_token={c.combine_bytes_per_token} "
            f"derive payloads of {payload} bytes per rank at ep_size={ep_size}; at most "
            f"{MAX_WORKSPACE_BYTES} (1 TiB)",
            field=prefix,
            value=payload,
        )


def check_plan(prefix: str, plan: Plan, ep_size: int) -> None:
    """Checks a plan's capacities, epoch and generation.

    Raises:
        InvalidArgument: naming the first bad field and its value.
    """
    check_capacities(f"{prefix}.capacities", plan.capacities, ep_size)
    check_count(f"{prefix}.epoch", plan.epoch, 0, MAX_GENERATION)
    check_count(f"{prefix}.generation", plan.generation, 1, MAX_GENERATION)


WorkspaceSize: TypeAlias = Callable[[str, Capacities, int], int]
"""A size function: per-rank workspace bytes a FlashInfer release (by name;
empty: the release of clients older than the name) builds for
``(capacities, ep_size)``. It raises ``LookupError`` for an unknown release
and ``ValueError`` for capacities the release's layout refuses. The core
holds none; the state holder passes the one of ``moe_sidecar.flashinfer``."""


@dataclass(frozen=True)
class WorkspaceCeiling:
    """The per-rank workspace ceiling (the sidecar's ``--max-workspace-bytes``)
    and the size function a plan is measured with."""

    max_bytes: int
    size: WorkspaceSize

    def workspace_bytes(self, release: str, capacities: Capacities, ep_size: int) -> int:
        """What ``release`` builds for ``capacities`` at ``ep_size``.

        Raises:
            InvalidArgument: the size function refuses them, naming the release.
        """
        try:
            return self.size(release, capacities, ep_size)
        except (LookupError, ValueError) as error:
            raise InvalidArgument(
                f"FlashInfer release {release or '(default)'!r} cannot lay out {capacities} "
                f"at ep_size={ep_size}: {error}",
                field="release",
                value=release,
            ) from error


def check_workspace_ceiling(
    field: str, capacities: Capacities, ep_size: int, ceiling: WorkspaceCeiling, release: str
) -> None:
    """Checks that ``capacities`` derive at most ``ceiling.max_bytes``
    workspace bytes per rank at ``ep_size`` in ``release``'s arithmetic
    (``ceiling.size``).

    The one ceiling check: proposals, commits, decided plans, stored rows
    and cluster documents all go through it.

    Raises:
        InvalidArgument: naming ``field``, the derived bytes and the ceiling
            (or the release, when its layout refuses the capacities).
    """
    workspace = ceiling.workspace_bytes(release, capacities, ep_size)
    limit = ceiling.max_bytes
    if workspace > limit:
        raise InvalidArgument(
            f"{field}: max_tokens={capacities.max_tokens}, dispatch_bytes_per_token="
            f"{capacities.dispatch_bytes_per_token}, combine_bytes_per_token="
            f"{capacities.combine_bytes_per_token} derive a workspace of {workspace} bytes "
            f"({workspace / (1 << 30):.1f} GiB) per rank at ep_size={ep_size}, above the "
            f"per-rank workspace ceiling of {limit} bytes ({limit / (1 << 30):.1f} GiB; "
            "the sidecar's --max-workspace-bytes)",
            field=field,
            value=workspace,
        )
