"""The one codec between a group's state and its stored documents (JSON text).

Two documents, both versioned and both read with the same field checks:

* the row of a group in the node's SQLite (:func:`encode_group`,
  :func:`decode_group`; ``"version": 3``);
* a group's cluster plan in a cluster store such as etcd
  (:func:`encode_cluster_plan`, :func:`decode_cluster_plan`;
  ``"kind": "moe-sidecar/cluster-plan"``, ``"version": 1``): written by other
  nodes, so it is untrusted input, checked like a request.

Rows are versioned documents. Every field is read,
type-checked and range-checked (:mod:`moe_sidecar.core.limits`) explicitly: a
hand-edited, truncated or absurd row fails to load with the reason, never
half-loads, and never loads a value the sidecar would refuse as input.

Rows of earlier versions load too: a row written by one release loads in the
next. Fields added to version 3 since it was first written (the group
proof's id of the lifetime, of each waiting proposal and of the rank that
opened a round, and the count of proposals refused for their proof) read as
their defaults when absent. Version 2 is version 3 without the node of each growth (loaded as
``""``). Version 1 (moe-sidecar 0.1.0, plans as byte counts) is migrated on
load: each stored plan becomes the least capacities whose FlashInfer
workspace is at least the stored byte count at the stored token count (the
split into dispatch and combine bytes was not recorded, so the combine part
is the minimum and the dispatch part takes the rest); retained round
outcomes and an open round are dropped (a rank retrying across the upgrade
re-proposes its round).
"""

from __future__ import annotations

import json
from typing import Any

from moe_sidecar.core import limits
from moe_sidecar.core.capacity_fields import CAPACITY_FIELDS
from moe_sidecar.core.cluster import MAX_HISTORY, ClusterPlan, check_cluster_plan
from moe_sidecar.core.errors import ErrorCode, InvalidArgument
from moe_sidecar.core.group import (
    Decision,
    GroupState,
    Growth,
    OpenRound,
    Outcome,
    Proposal,
    RankRecord,
    Refusal,
    Requirement,
)
from moe_sidecar.core.plan import Action, Capacities, Plan
from moe_sidecar.core.sizing import align, aux_data_size

__all__ = [
    "CLUSTER_PLAN_KIND",
    "CLUSTER_PLAN_VERSION",
    "MAX_DOCUMENT_BYTES",
    "ROW_VERSION",
    "RowError",
    "decode_cluster_plan",
    "decode_group",
    "encode_cluster_plan",
    "encode_group",
]

ROW_VERSION = 3
"""Version of the rows this release writes; it reads this and every earlier one."""
CLUSTER_PLAN_KIND = "moe-sidecar/cluster-plan"
CLUSTER_PLAN_VERSION = 1
"""Version of the cluster plans this release writes and reads."""
MAX_DOCUMENT_BYTES = 4 << 20
"""A cluster plan holds at most 256 growths (well under 1 MiB); more is refused unread."""


class RowError(ValueError):
    """A stored row cannot be loaded; the message says which field and why."""


# --- encoding -----------------------------------------------------------------------


def _capacities(c: Capacities) -> dict[str, Any]:
    return {field.name: getattr(c, field.name) for field in CAPACITY_FIELDS}


def _plan(p: Plan | None) -> dict[str, Any] | None:
    if p is None:
        return None
    return {"capacities": _capacities(p.capacities), "epoch": p.epoch, "generation": p.generation}


def _outcome(o: Outcome) -> dict[str, Any]:
    if isinstance(o, Decision):
        return {
            "kind": "decision",
            "round": o.round,
            "action": o.action.value,
            "plan": _plan(o.plan),
            "grew": o.grew,
            "layer": o.layer,
        }
    return {
        "kind": "refusal",
        "round": o.round,
        "code": o.code.value,
        "message": o.message,
        "missing_ranks": list(o.missing_ranks),
    }


def _proposal(p: Proposal) -> dict[str, Any]:
    return {
        "group": p.group,
        "ep_size": p.ep_size,
        "ep_rank": p.ep_rank,
        "local_ranks": p.local_ranks,
        "lifetime": p.lifetime,
        "round": p.round,
        "requirement": {
            "capacities": _capacities(p.requirement.capacities),
            "layer": p.requirement.layer,
        },
        # Written only when set, so a row without proofs reads as it always did.
        **({"proof": p.proof} if p.proof else {}),
    }


def _round(rnd: OpenRound | None) -> dict[str, Any] | None:
    if rnd is None:
        return None
    return {
        "number": rnd.number,
        "opened_at": rnd.opened_at,
        "deadline": rnd.deadline,
        "proposals": [_proposal(p) for p in rnd.proposals],
        "need": None if rnd.need is None else _capacities(rnd.need),
        **({"first_proof": rnd.first_proof} if rnd.first_proof else {}),
    }


def encode_group(state: GroupState) -> str:
    """The JSON text stored for ``state`` (a version :data:`ROW_VERSION` row)."""
    document = {
        "version": ROW_VERSION,
        "name": state.name,
        "ep_size": state.ep_size,
        "local_ranks": state.local_ranks,
        "epoch": state.epoch,
        "plan": _plan(state.plan),
        "generation": state.generation,
        "lifetime_index": state.lifetime_index,
        "built": _plan(state.built),
        "last_closed_round": state.last_closed_round,
        "closed": [_outcome(o) for o in state.closed],
        "open_round": _round(state.open_round),
        "pending": _round(state.pending),
        "ranks": [
            {
                "ep_rank": r.ep_rank,
                "lifetime": r.lifetime,
                "lifetime_index": r.lifetime_index,
                "last_round": r.last_round,
                "last_layer": r.last_layer,
                "last_seen": r.last_seen,
                "committed_generation": r.committed_generation,
                "build_seconds": r.build_seconds,
                "left": r.left,
            }
            for r in state.ranks
        ],
        "history": _history(state.history),
        **({"proof": state.proof} if state.proof is not None else {}),
        **({"refused_proposals": state.refused_proposals} if state.refused_proposals else {}),
    }
    return json.dumps(document, separators=(",", ":"))


def _history(history: tuple[Growth, ...]) -> list[dict[str, Any]]:
    return [
        {
            "plan": _plan(g.plan),
            "layer": g.layer,
            "ep_rank": g.ep_rank,
            "round": g.round,
            "at": g.at,
            "node": g.node,
        }
        for g in history
    ]


def encode_cluster_plan(doc: ClusterPlan) -> bytes:
    """The bytes a cluster store holds for ``doc`` (UTF-8 JSON)."""
    document = {
        "kind": CLUSTER_PLAN_KIND,
        "version": CLUSTER_PLAN_VERSION,
        "name": doc.name,
        "ep_size": doc.ep_size,
        "epoch": doc.epoch,
        "plan": _plan(doc.plan),
        "generation": doc.generation,
        "history": _history(doc.history),
    }
    return json.dumps(document, separators=(",", ":")).encode()


# --- decoding -----------------------------------------------------------------------


def _get(d: Any, key: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise RowError(f"missing field {key!r}")
    value = d[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int subclass; a stored bool where a number belongs is corruption.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise RowError(f"field {key!r} holds {value!r}")
    return value


def _int(d: Any, key: str, low: int = 0, high: int = limits.MAX_GENERATION) -> int:
    value = int(_get(d, key, int))
    if not low <= value <= high:
        raise RowError(f"field {key!r} holds {value}, outside [{low}, {high}]")
    return value


def _float(d: Any, key: str, low: float, high: float) -> float:
    raw = _get(d, key, (int, float))
    try:
        value = float(raw)
    except OverflowError:  # an integer beyond any double
        raise RowError(f"field {key!r} holds an integer of {len(str(raw))} digits") from None
    if not low <= value <= high:  # also refuses NaN
        raise RowError(f"field {key!r} holds {value}, outside [{low:g}, {high:g}]")
    return value


def _time(d: Any, key: str) -> float:
    return _float(d, key, limits.MIN_TIME, limits.MAX_TIME)


def _build_seconds(d: Any, key: str) -> float:
    value = _float(d, key, 0.0, limits.MAX_BUILD_SECONDS)
    _checked(limits.check_seconds, key, value)
    return value


def _str(d: Any, key: str) -> str:
    value = str(_get(d, key, str))
    if len(value) > 4 * limits.MAX_NAME_LENGTH + 4096:
        raise RowError(f"field {key!r} holds {len(value)} characters")
    try:
        value.encode()
    except UnicodeEncodeError:  # JSON's "\ud800": no answer could carry it
        raise RowError(f"field {key!r} holds a lone surrogate, which is not UTF-8") from None
    return value


def _optional_str(d: Any, key: str) -> str:
    """A string field that rows written before it existed lack ("" then)."""
    return _str(d, key) if isinstance(d, dict) and key in d else ""


def _proof(d: Any, key: str) -> str:
    """A proof's id: empty, or the 64 hex digits of a SHA-256."""
    value = _optional_str(d, key)
    if value and (len(value) != 64 or any(c not in "0123456789abcdef" for c in value)):
        raise RowError(f"field {key!r} holds {value[:16]!r}..., not a proof's id")
    return value


def _list(d: Any, key: str) -> list[Any]:
    return list(_get(d, key, list))


def _rank_numbers(d: Any, key: str, ep_size: int) -> list[int]:
    ranks = _list(d, key)
    for rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ep_size:
            raise RowError(f"field {key!r} holds {rank!r}, not a rank below ep_size={ep_size}")
    return ranks


def _checked(check: Any, *args: Any) -> None:
    try:
        check(*args)
    except InvalidArgument as error:
        raise RowError(error.message) from None


def _typed_capacities(d: Any) -> Capacities:
    """Every field of the capacity table, typed (ranges unchecked); a field
    that documents written before it existed lack reads as its declared value."""
    values = {}
    for field in CAPACITY_FIELDS:
        if field.missing_reads_as is not None and field.name not in d:
            values[field.name] = field.missing_reads_as
        else:
            values[field.name] = _int(d, field.name)
    return Capacities(**values)


def _decode_capacities(d: Any, ep_size: int, where: str) -> Capacities:
    capacities = _typed_capacities(d)
    _checked(limits.check_capacities, where, capacities, ep_size)
    return capacities


def _decode_plan(d: Any, key: str, ep_size: int) -> Plan | None:
    value = _get(d, key, (dict, type(None)))
    if value is None:
        return None
    plan = Plan(
        capacities=_decode_capacities(
            _get(value, "capacities", dict), ep_size, f"{key}.capacities"
        ),
        epoch=_int(value, "epoch"),
        generation=_int(value, "generation"),
    )
    _checked(limits.check_plan, key, plan, ep_size)
    return plan


def _required_plan(d: Any, key: str, ep_size: int) -> Plan:
    plan = _decode_plan(d, key, ep_size)
    if plan is None:
        raise RowError(f"field {key!r} holds null")
    return plan


def _decode_outcome(d: Any, ep_size: int) -> Outcome:
    kind = _str(d, "kind")
    if kind == "decision":
        return Decision(
            round=_int(d, "round", 1, limits.MAX_ROUND),
            action=Action(_str(d, "action")),
            plan=_required_plan(d, "plan", ep_size),
            grew=bool(_get(d, "grew", bool)),
            layer=_str(d, "layer"),
        )
    if kind == "refusal":
        return Refusal(
            round=_int(d, "round", 1, limits.MAX_ROUND),
            code=ErrorCode(_str(d, "code")),
            message=_str(d, "message"),
            missing_ranks=tuple(_rank_numbers(d, "missing_ranks", ep_size)),
        )
    raise RowError(f"unknown outcome kind {kind!r}")


def _decode_proposal(d: Any, ep_size: int) -> Proposal:
    r = _get(d, "requirement", dict)
    return Proposal(
        group=_str(d, "group"),
        ep_size=_int(d, "ep_size", 1, limits.MAX_EP_SIZE),
        ep_rank=_int(d, "ep_rank", 0, limits.MAX_EP_SIZE - 1),
        local_ranks=_int(d, "local_ranks", 1, limits.MAX_EP_SIZE),
        lifetime=_str(d, "lifetime"),
        round=_int(d, "round", 1, limits.MAX_ROUND),
        requirement=Requirement(
            capacities=_decode_capacities(_get(r, "capacities", dict), ep_size, "requirement"),
            layer=_str(r, "layer"),
        ),
        proof=_proof(d, "proof"),
    )


def _decode_rank(r: Any) -> RankRecord:
    return RankRecord(
        ep_rank=_int(r, "ep_rank", 0, limits.MAX_EP_SIZE - 1),
        lifetime=_str(r, "lifetime"),
        lifetime_index=_int(r, "lifetime_index"),
        last_round=_int(r, "last_round", 0, limits.MAX_ROUND),
        last_layer=_str(r, "last_layer"),
        last_seen=_time(r, "last_seen"),
        committed_generation=_int(r, "committed_generation"),
        build_seconds=_build_seconds(r, "build_seconds"),
        # Rows written before sessions have no "left".
        left=_str(r, "left") if isinstance(r, dict) and "left" in r else "",
    )


def _decode_round(d: Any, key: str, ep_size: int) -> OpenRound | None:
    rnd = _get(d, key, (dict, type(None)))
    if rnd is None:
        return None
    need = _get(rnd, "need", (dict, type(None)))
    return OpenRound(
        number=_int(rnd, "number", 1, limits.MAX_ROUND),
        opened_at=_time(rnd, "opened_at"),
        deadline=_time(rnd, "deadline"),
        proposals=tuple(_decode_proposal(p, ep_size) for p in _list(rnd, "proposals")),
        need=None if need is None else _decode_capacities(need, ep_size, f"{key}.need"),
        first_proof=_proof(rnd, "first_proof"),
    )


def _decode_growth(g: Any, ep_size: int, *, with_node: bool) -> Growth:
    return Growth(
        plan=_required_plan(g, "plan", ep_size),
        layer=_str(g, "layer"),
        ep_rank=_int(g, "ep_rank", 0, limits.MAX_EP_SIZE - 1),
        round=_int(g, "round", 0, limits.MAX_ROUND),
        at=_time(g, "at"),
        node=_str(g, "node") if with_node else "",
    )


def _decode_v2(d: Any, *, with_node: bool = False) -> GroupState:
    ep_size = _int(d, "ep_size", 1, limits.MAX_EP_SIZE)
    return GroupState(
        name=_str(d, "name"),
        ep_size=ep_size,
        local_ranks=_int(d, "local_ranks", 1, ep_size),
        epoch=_int(d, "epoch"),
        plan=_decode_plan(d, "plan", ep_size),
        generation=_int(d, "generation"),
        lifetime_index=_int(d, "lifetime_index"),
        built=_decode_plan(d, "built", ep_size),
        last_closed_round=_int(d, "last_closed_round", 0, limits.MAX_ROUND),
        closed=tuple(_decode_outcome(o, ep_size) for o in _list(d, "closed")),
        open_round=_decode_round(d, "open_round", ep_size),
        # Rows written before restarts were collected apart have no "pending".
        pending=_decode_round(d, "pending", ep_size) if "pending" in d else None,
        ranks=tuple(_decode_rank(r) for r in _list(d, "ranks")),
        history=tuple(_decode_growth(g, ep_size, with_node=with_node) for g in _list(d, "history")),
        # Rows written before group proofs: the lifetime's proof is not fixed yet.
        proof=_proof(d, "proof") if d.get("proof") is not None else None,
        refused_proposals=_int(d, "refused_proposals") if "refused_proposals" in d else 0,
    )


def _decode_v3(d: Any) -> GroupState:
    return _decode_v2(d, with_node=True)


# --- version 1 (moe-sidecar 0.1.0) --------------------------------------------------


def _v1_capacities(
    ep_size: int, workspace_bytes: int, max_tokens: int, top_k: int, num_experts: int
) -> Capacities:
    """The least capacities (combine part minimal) whose workspace holds ``workspace_bytes``."""
    per_token_row = ep_size * max_tokens
    room = workspace_bytes - align(aux_data_size(ep_size, max_tokens)) - align(per_token_row)
    dispatch = max(1, -(-room // per_token_row))
    return Capacities(
        max_tokens=max_tokens,
        dispatch_bytes_per_token=dispatch,
        combine_bytes_per_token=1,
        top_k=top_k,
        num_experts=num_experts,
    )


def _decode_v1_plan(d: Any, key: str, ep_size: int, epoch: int) -> Plan | None:
    value = _get(d, key, (dict, type(None)))
    if value is None:
        return None
    tokens = _int(value, "max_num_tokens", 1, limits.MAX_TOKENS)
    plan = Plan(
        capacities=_v1_capacities(
            ep_size,
            _int(value, "workspace_bytes", 1, limits.MAX_WORKSPACE_BYTES),
            tokens,
            _int(value, "top_k"),
            _int(value, "num_experts"),
        ),
        epoch=epoch,
        generation=_int(value, "generation"),
    )
    _checked(limits.check_plan, key, plan, ep_size)
    return plan


def _decode_v1(d: Any) -> GroupState:
    ep_size = _int(d, "ep_size", 1, limits.MAX_EP_SIZE)
    plan = _decode_v1_plan(d, "plan", ep_size, 0)
    shape = plan.capacities if plan is not None else None
    history = []
    for g in _list(d, "history"):
        if shape is None:
            break  # a history without a stored plan has no shape to give it
        grown = Plan(
            capacities=_v1_capacities(
                ep_size,
                _int(g, "workspace_bytes", 1, limits.MAX_WORKSPACE_BYTES),
                _int(g, "max_num_tokens", 1, limits.MAX_TOKENS),
                shape.top_k,
                shape.num_experts,
            ),
            epoch=0,
            generation=_int(g, "generation"),
        )
        history.append(
            Growth(
                plan=grown,
                layer=_str(g, "layer"),
                ep_rank=_int(g, "ep_rank", 0, limits.MAX_EP_SIZE - 1),
                round=_int(g, "round", 0, limits.MAX_ROUND),
                at=_time(g, "at"),
            )
        )
    return GroupState(
        name=_str(d, "name"),
        ep_size=ep_size,
        local_ranks=_int(d, "local_ranks", 1, ep_size),
        plan=plan,
        generation=_int(d, "generation"),
        lifetime_index=_int(d, "lifetime_index"),
        built=_decode_v1_plan(d, "built", ep_size, 0),
        last_closed_round=_int(d, "last_closed_round", 0, limits.MAX_ROUND),
        ranks=tuple(_decode_rank(r) for r in _list(d, "ranks")),
        history=tuple(history),
    )


_DECODERS = {1: _decode_v1, 2: _decode_v2, 3: _decode_v3}


def decode_group(text: str) -> GroupState:
    """The group state stored as ``text``, of any version this release reads.

    Raises:
        RowError: the text is not a complete, well-typed, in-range group
            document of a known version.
    """
    try:
        document = json.loads(text)
    except RecursionError:
        raise RowError("the row is nested too deeply to be a group") from None
    except ValueError as error:
        raise RowError(f"not JSON: {error}") from None
    if not isinstance(document, dict):
        raise RowError(f"not a JSON object but {type(document).__name__}")
    version = document.get("version", 1)
    decoder = _DECODERS.get(version) if isinstance(version, int) else None
    if decoder is None:
        raise RowError(f"row version {version!r}; this release reads versions {sorted(_DECODERS)}")
    try:
        return decoder(document)
    except (KeyError, TypeError, OverflowError) as error:
        raise RowError(f"malformed: {error!r}") from None
    except ValueError as error:
        if isinstance(error, RowError):
            raise
        raise RowError(str(error)) from None


def _typed_plan(d: Any, key: str) -> Plan | None:
    """A plan's fields, typed; their ranges are left to check_cluster_plan (once)."""
    value = _get(d, key, (dict, type(None)))
    if value is None:
        return None
    return Plan(
        capacities=_typed_capacities(_get(value, "capacities", dict)),
        epoch=_int(value, "epoch"),
        generation=_int(value, "generation"),
    )


def _typed_growth(g: Any) -> Growth:
    plan = _typed_plan(g, "plan")
    if plan is None:
        raise RowError("field 'plan' holds null")
    return Growth(
        plan=plan,
        layer=_str(g, "layer"),
        ep_rank=_int(g, "ep_rank", 0, limits.MAX_EP_SIZE - 1),
        round=_int(g, "round", 0, limits.MAX_ROUND),
        at=_time(g, "at"),
        node=_str(g, "node"),
    )


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
        history = _list(document, "history")
        if len(history) > MAX_HISTORY:
            raise RowError(f"field 'history' holds {len(history)} entries; at most {MAX_HISTORY}")
        doc = ClusterPlan(
            name=_str(document, "name"),
            ep_size=_int(document, "ep_size", 1, limits.MAX_EP_SIZE),
            epoch=_int(document, "epoch"),
            plan=_typed_plan(document, "plan"),
            generation=_int(document, "generation"),
            history=tuple(_typed_growth(g) for g in history),
        )
    except (KeyError, TypeError) as error:
        raise RowError(f"malformed: {error!r}") from None
    except ValueError as error:
        if isinstance(error, RowError):
            raise
        raise RowError(str(error)) from None
    _checked(check_cluster_plan, doc)
    return doc
