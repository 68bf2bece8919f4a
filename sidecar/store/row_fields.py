"""The stored documents' error, encoders and field readers.

A group's row (:mod:`moe_sidecar.store.row_codec`) and a cluster plan
(:mod:`moe_sidecar.store.cluster_plan_codec`) write capacities, plans and growths
the same way and read every field with these checks: present, of its JSON
type and in its range (:mod:`moe_sidecar.core.limits`), else a
:class:`RowError` naming it. A few readers (a rank's build seconds, rank
numbers, the group proof) serve the row alone; they live here beside the
checks they are made of.
"""

from __future__ import annotations

from typing import Any

from moe_sidecar import flashinfer
from moe_sidecar.core import limits
from moe_sidecar.core.capacity_fields import CAPACITY_FIELDS
from moe_sidecar.core.errors import InvalidArgument
from moe_sidecar.core.group import Growth
from moe_sidecar.core.plan import Capacities, Plan

__all__ = [
    "RowError",
    "build_seconds_field",
    "checked",
    "encode_capacities",
    "encode_history",
    "encode_plan",
    "field_of",
    "float_field",
    "growth_fields",
    "int_field",
    "list_field",
    "optional_str_field",
    "proof_field",
    "rank_numbers_field",
    "release_field",
    "str_field",
    "time_field",
    "typed_capacities",
]


class RowError(ValueError):
    """A stored row cannot be loaded; the message says which field and why."""


# --- encoding -----------------------------------------------------------------------


def encode_capacities(c: Capacities) -> dict[str, Any]:
    return {field.name: getattr(c, field.name) for field in CAPACITY_FIELDS}


def encode_plan(p: Plan | None) -> dict[str, Any] | None:
    if p is None:
        return None
    return {
        "capacities": encode_capacities(p.capacities),
        "epoch": p.epoch,
        "generation": p.generation,
    }


def encode_history(history: tuple[Growth, ...]) -> list[dict[str, Any]]:
    return [
        {
            "plan": encode_plan(g.plan),
            "layer": g.layer,
            "ep_rank": g.ep_rank,
            "round": g.round,
            "at": g.at,
            "node": g.node,
        }
        for g in history
    ]


# --- decoding -----------------------------------------------------------------------


def field_of(d: Any, key: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise RowError(f"missing field {key!r}")
    value = d[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int subclass; a stored bool where a number belongs is corruption.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise RowError(f"field {key!r} holds {value!r}")
    return value


def int_field(d: Any, key: str, low: int = 0, high: int = limits.MAX_GENERATION) -> int:
    value = int(field_of(d, key, int))
    if not low <= value <= high:
        raise RowError(f"field {key!r} holds {value}, outside [{low}, {high}]")
    return value


def float_field(d: Any, key: str, low: float, high: float) -> float:
    raw = field_of(d, key, (int, float))
    try:
        value = float(raw)
    except OverflowError:  # an integer beyond any double
        raise RowError(f"field {key!r} holds an integer of {len(str(raw))} digits") from None
    if not low <= value <= high:  # also refuses NaN
        raise RowError(f"field {key!r} holds {value}, outside [{low:g}, {high:g}]")
    return value


def time_field(d: Any, key: str) -> float:
    return float_field(d, key, limits.MIN_TIME, limits.MAX_TIME)


def build_seconds_field(d: Any, key: str) -> float:
    value = float_field(d, key, 0.0, limits.MAX_BUILD_SECONDS)
    checked(limits.check_seconds, key, value)
    return value


def str_field(d: Any, key: str) -> str:
    value = str(field_of(d, key, str))
    if len(value) > 4 * limits.MAX_NAME_LENGTH + 4096:
        raise RowError(f"field {key!r} holds {len(value)} characters")
    try:
        value.encode()
    except UnicodeEncodeError:  # JSON's "\ud800": no answer could carry it
        raise RowError(f"field {key!r} holds a lone surrogate, which is not UTF-8") from None
    return value


def release_field(d: Any, key: str, absent: str) -> str:
    """A FlashInfer release's name (``moe_sidecar.flashinfer``), checked to be
    one of the table's; ``absent`` in rows written before releases were
    recorded."""
    if not isinstance(d, dict) or key not in d:
        return absent
    value = str_field(d, key)
    try:
        return flashinfer.release_named(value).name
    except LookupError as error:
        raise RowError(f"field {key!r}: {error}") from None


def optional_str_field(d: Any, key: str) -> str:
    """A string field that rows written before it existed lack ("" then)."""
    return str_field(d, key) if isinstance(d, dict) and key in d else ""


def proof_field(d: Any, key: str) -> str:
    """A proof's id: empty, or the 64 hex digits of a SHA-256."""
    value = optional_str_field(d, key)
    if value and (len(value) != 64 or any(c not in "0123456789abcdef" for c in value)):
        raise RowError(f"field {key!r} holds {value[:16]!r}..., not a proof's id")
    return value


def list_field(d: Any, key: str) -> list[Any]:
    return list(field_of(d, key, list))


def rank_numbers_field(d: Any, key: str, ep_size: int) -> list[int]:
    ranks = list_field(d, key)
    for rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ep_size:
            raise RowError(f"field {key!r} holds {rank!r}, not a rank below ep_size={ep_size}")
    return ranks


def checked(check: Any, *args: Any) -> None:
    try:
        check(*args)
    except InvalidArgument as error:
        raise RowError(error.message) from None


def typed_capacities(d: Any) -> Capacities:
    """Every field of the capacity table, typed (ranges unchecked); a field
    that documents written before it existed lack reads as its declared value."""
    values = {}
    for field in CAPACITY_FIELDS:
        if field.missing_reads_as is not None and field.name not in d:
            values[field.name] = field.missing_reads_as
        else:
            values[field.name] = int_field(d, field.name)
    return Capacities(**values)


def growth_fields(g: Any, plan: Plan, *, with_node: bool) -> Growth:
    """The growth a stored history entry ``g`` records at ``plan`` (read by
    the caller, which knows its bounds); its node only ``with_node`` (rows
    of older versions have none).

    Raises:
        RowError: a field is missing, of another type or out of range.
    """
    return Growth(
        plan=plan,
        layer=str_field(g, "layer"),
        ep_rank=int_field(g, "ep_rank", 0, limits.MAX_EP_SIZE - 1),
        round=int_field(g, "round", 0, limits.MAX_ROUND),
        at=time_field(g, "at"),
        node=str_field(g, "node") if with_node else "",
    )
