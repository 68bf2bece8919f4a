"""The cluster plan a cluster store such as etcd holds for a group (UTF-8 JSON).

``"kind": "moe-sidecar/cluster-plan"``, ``"version": 1``: written by other
nodes, so it is untrusted input, read with the same field checks as a row
(:mod:`moe_sidecar.store.row_fields`) and then checked like a request.

``"owner"``, the owner id of the group's stored plan, was added to version 1
later: it is written only when set (so a group without an owner writes the
bytes it always did), and a document without it (one written before owners
travelled, or by a node older than them) reads as no owner.
"""

from __future__ import annotations

import json
from typing import Any

from moe_sidecar.core import limits
from moe_sidecar.core.cluster import MAX_HISTORY, ClusterPlan, check_cluster_plan
from moe_sidecar.core.group import Growth
from moe_sidecar.core.plan import Plan
from moe_sidecar.store.row_fields import (
    RowError,
    checked,
    encode_history,
    encode_plan,
    field_of,
    growth_fields,
    int_field,
    list_field,
    optional_str_field,
    str_field,
    typed_capacities,
)

__all__ = [
    "CLUSTER_PLAN_KIND",
    "CLUSTER_PLAN_VERSION",
    "MAX_DOCUMENT_BYTES",
    "decode_cluster_plan",
    "encode_cluster_plan",
]

CLUSTER_PLAN_KIND = "moe-sidecar/cluster-plan"
CLUSTER_PLAN_VERSION = 1
"""Version of the cluster plans this release writes and reads."""
MAX_DOCUMENT_BYTES = 4 << 20
"""A cluster plan holds at most 256 growths (well under 1 MiB); more is refused unread."""


def encode_cluster_plan(doc: ClusterPlan) -> bytes:
    """The bytes a cluster store holds for ``doc`` (UTF-8 JSON)."""
    document = {
        "kind": CLUSTER_PLAN_KIND,
        "version": CLUSTER_PLAN_VERSION,
        "name": doc.name,
        "ep_size": doc.ep_size,
        "epoch": doc.epoch,
        "plan": encode_plan(doc.plan),
        "generation": doc.generation,
        "history": encode_history(doc.history),
        **({"owner": doc.owner} if doc.owner else {}),
    }
    return json.dumps(document, separators=(",", ":")).encode()


def _typed_plan(d: Any, key: str) -> Plan | None:
    """A plan's fields, typed; their ranges are left to check_cluster_plan (once)."""
    value = field_of(d, key, (dict, type(None)))
    if value is None:
        return None
    return Plan(
        capacities=typed_capacities(field_of(value, "capacities", dict)),
        epoch=int_field(value, "epoch"),
        generation=int_field(value, "generation"),
    )


def _typed_growth(g: Any) -> Growth:
    plan = _typed_plan(g, "plan")
    if plan is None:
        raise RowError("field 'plan' holds null")
    return growth_fields(g, plan, with_node=True)


def decode_cluster_plan(data: bytes) -> ClusterPlan:
    """The cluster plan a store holds as ``data``, every field checked.

    Raises:
        RowError: not a complete, well-typed, in-range cluster plan of a
            version this release reads (the message names the field); a
            newer version says so.
    """
    if len(data) > MAX_DOCUMENT_BYTES:
        raise RowError(f"{len(data)} bytes; a cluster plan has at most {MAX_DOCUMENT_BYTES}")
    try:
        document = json.loads(data)
    except RecursionError:
        raise RowError("nested too deeply to be a cluster plan") from None
    except ValueError as error:
        raise RowError(f"not JSON: {error}") from None
    if not isinstance(document, dict):
        raise RowError(f"not a JSON object but {type(document).__name__}")
    if document.get("kind") != CLUSTER_PLAN_KIND:
        raise RowError(f"kind {document.get('kind')!r}; expected {CLUSTER_PLAN_KIND!r}")
    version = document.get("version")
    if version != CLUSTER_PLAN_VERSION:
        raise RowError(
            f"cluster plan version {version!r}; this release reads version "
            f"{CLUSTER_PLAN_VERSION} (a newer sidecar wrote it?)"
        )
    try:
        history = list_field(document, "history")
        if len(history) > MAX_HISTORY:
            raise RowError(f"field 'history' holds {len(history)} entries; at most {MAX_HISTORY}")
        doc = ClusterPlan(
            name=str_field(document, "name"),
            ep_size=int_field(document, "ep_size", 1, limits.MAX_EP_SIZE),
            epoch=int_field(document, "epoch"),
            plan=_typed_plan(document, "plan"),
            generation=int_field(document, "generation"),
            history=tuple(_typed_growth(g) for g in history),
            # Documents written before owners travelled: no owner.
            owner=optional_str_field(document, "owner"),
        )
    except (KeyError, TypeError) as error:
        raise RowError(f"malformed: {error!r}") from None
    except ValueError as error:
        if isinstance(error, RowError):
            raise
        raise RowError(str(error)) from None
    checked(check_cluster_plan, doc)
    return doc
