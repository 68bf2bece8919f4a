"""The one codec between a group's state and its stored documents (JSON text).

Two documents, both versioned and both read with the same field checks:

* the row of a group in the node's SQLite (:func:`encode_group`,
  :func:`decode_group`; ``"version": 3``);
* a group's cluster plan in a cluster store such as etcd
  (:func:`encode_cluster_plan`, :func:`decode_cluster_plan`;
  ``"kind": "moe-sidecar/cluster-plan"``, ``"version": 1``): written by other
  nodes, so it is untrusted input, checked like a request.

The cluster plan's codec is :mod:`moe_sidecar.store.cluster_plan_codec`, re-exported
here; the field readers and encoders both share are :mod:`moe_sidecar.store.row_fields`.

Rows are versioned documents. Every field is read,
type-checked and range-checked (:mod:`moe_sidecar.core.limits`) explicitly: a
hand-edited, truncated or absurd row fails to load with the reason, never
half-loads, and never loads a value the sidecar would refuse as input.

Rows of earlier versions load too: a row written by one release loads in the
next. Fields added to version 3 since it was first written (the group
proof's id of the lifetime, of each waiting proposal and of the rank that
opened a round, the count of proposals refused for their proof, the
FlashInfer release of the group and of each waiting proposal, and the
owner's id of the group and of each waiting proposal) read as their defaults
when absent (a waiting proposal's release: the default release of
``moe_sidecar.flashinfer``, the one clients older than the field drove; the
group's: none fixed yet; an owner: none, so the group's next restart
begins a new epoch). Version 2 is version 3 without the node of each growth (loaded as
``""``). Version 1 (moe-sidecar 0.1.0, plans as byte counts) is migrated on
load: each stored plan becomes the least capacities whose FlashInfer
workspace (in the default release's arithmetic, the one 0.1.0 used) is at
least the stored byte count at the stored token count (the
split into dispatch and combine bytes was not recorded, so the combine part
is the minimum and the dispatch part takes the rest); retained round
outcomes and an open round are dropped (a rank retrying across the upgrade
re-proposes its round).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from moe_sidecar import flashinfer
from moe_sidecar.core import limits
from moe_sidecar.core.errors import ErrorCode
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
from moe_sidecar.flashinfer.v0_7_2_post1 import align, aux_data_size
from moe_sidecar.store.cluster_plan_codec import (
    CLUSTER_PLAN_KIND,
    CLUSTER_PLAN_VERSION,
    MAX_DOCUMENT_BYTES,
    decode_cluster_plan,
    encode_cluster_plan,
)
from moe_sidecar.store.row_fields import (
    RowError,
    build_seconds_field,
    checked,
    encode_capacities,
    encode_history,
    encode_plan,
    field_of,
    growth_fields,
    int_field,
    list_field,
    proof_field,
    rank_numbers_field,
    release_field,
    str_field,
    time_field,
    typed_capacities,
)
from moe_sidecar.store.view_codec import decode_view, encode_view

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


# --- encoding -----------------------------------------------------------------------


def _outcome(o: Outcome) -> dict[str, Any]:
    if isinstance(o, Decision):
        return {
            "kind": "decision",
            "round": o.round,
            "action": o.action.value,
            "plan": encode_plan(o.plan),
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
            "capacities": encode_capacities(p.requirement.capacities),
            "layer": p.requirement.layer,
        },
        # Written only when set, so a row without proofs reads as it always did.
        **({"proof": p.proof} if p.proof else {}),
        # The default release is what a row without the field means.
        **({"release": p.release} if p.release != flashinfer.DEFAULT_RELEASE.name else {}),
        **({"owner": p.owner} if p.owner else {}),
    }


def _round(rnd: OpenRound | None) -> dict[str, Any] | None:
    if rnd is None:
        return None
    return {
        "number": rnd.number,
        "opened_at": rnd.opened_at,
        "deadline": rnd.deadline,
        "proposals": [_proposal(p) for p in rnd.proposals],
        "need": None if rnd.need is None else encode_capacities(rnd.need),
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
        "plan": encode_plan(state.plan),
        "generation": state.generation,
        "lifetime_index": state.lifetime_index,
        "built": encode_plan(state.built),
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
                **({"ended_lifetime": r.ended_lifetime} if r.ended_lifetime else {}),
            }
            for r in state.ranks
        ],
        "history": encode_history(state.history),
        **({"proof": state.proof} if state.proof is not None else {}),
        **({"refused_proposals": state.refused_proposals} if state.refused_proposals else {}),
        **({"release": state.release} if state.release else {}),
        **({"view": encode_view(state.view, state.view_lifetime)} if state.view else {}),
        **({"owner": state.owner} if state.owner else {}),
    }
    return json.dumps(document, separators=(",", ":"))


# --- decoding -----------------------------------------------------------------------


def _decode_capacities(d: Any, ep_size: int, where: str) -> Capacities:
    capacities = typed_capacities(d)
    checked(limits.check_capacities, where, capacities, ep_size)
    return capacities


def _decode_plan(d: Any, key: str, ep_size: int) -> Plan | None:
    value = field_of(d, key, (dict, type(None)))
    if value is None:
        return None
    plan = Plan(
        capacities=_decode_capacities(
            field_of(value, "capacities", dict), ep_size, f"{key}.capacities"
        ),
        epoch=int_field(value, "epoch"),
        generation=int_field(value, "generation"),
    )
    checked(limits.check_plan, key, plan, ep_size)
    return plan


def _required_plan(d: Any, key: str, ep_size: int) -> Plan:
    plan = _decode_plan(d, key, ep_size)
    if plan is None:
        raise RowError(f"field {key!r} holds null")
    return plan


def _decode_outcome(d: Any, ep_size: int) -> Outcome:
    kind = str_field(d, "kind")
    if kind == "decision":
        return Decision(
            round=int_field(d, "round", 1, limits.MAX_ROUND),
            action=Action(str_field(d, "action")),
            plan=_required_plan(d, "plan", ep_size),
            grew=bool(field_of(d, "grew", bool)),
            layer=str_field(d, "layer"),
        )
    if kind == "refusal":
        return Refusal(
            round=int_field(d, "round", 1, limits.MAX_ROUND),
            code=ErrorCode(str_field(d, "code")),
            message=str_field(d, "message"),
            missing_ranks=tuple(rank_numbers_field(d, "missing_ranks", ep_size)),
        )
    raise RowError(f"unknown outcome kind {kind!r}")


def _decode_proposal(d: Any, ep_size: int) -> Proposal:
    r = field_of(d, "requirement", dict)
    return Proposal(
        group=str_field(d, "group"),
        ep_size=int_field(d, "ep_size", 1, limits.MAX_EP_SIZE),
        ep_rank=int_field(d, "ep_rank", 0, limits.MAX_EP_SIZE - 1),
        local_ranks=int_field(d, "local_ranks", 1, limits.MAX_EP_SIZE),
        lifetime=str_field(d, "lifetime"),
        round=int_field(d, "round", 1, limits.MAX_ROUND),
        requirement=Requirement(
            capacities=_decode_capacities(field_of(r, "capacities", dict), ep_size, "requirement"),
            layer=str_field(r, "layer"),
        ),
        proof=proof_field(d, "proof"),
        # A proposal stored before releases were recorded came from a client
        # older than the field: the default release.
        release=release_field(d, "release", flashinfer.DEFAULT_RELEASE.name),
        owner=proof_field(d, "owner"),
    )


def _decode_rank(r: Any) -> RankRecord:
    return RankRecord(
        ep_rank=int_field(r, "ep_rank", 0, limits.MAX_EP_SIZE - 1),
        lifetime=str_field(r, "lifetime"),
        lifetime_index=int_field(r, "lifetime_index"),
        last_round=int_field(r, "last_round", 0, limits.MAX_ROUND),
        last_layer=str_field(r, "last_layer"),
        last_seen=time_field(r, "last_seen"),
        committed_generation=int_field(r, "committed_generation"),
        build_seconds=build_seconds_field(r, "build_seconds"),
        # Rows written before sessions have no "left".
        left=str_field(r, "left") if isinstance(r, dict) and "left" in r else "",
        # Rows written before it have no "ended_lifetime".
        ended_lifetime=(
            str_field(r, "ended_lifetime") if isinstance(r, dict) and "ended_lifetime" in r else ""
        ),
    )


def _decode_round(d: Any, key: str, ep_size: int) -> OpenRound | None:
    rnd = field_of(d, key, (dict, type(None)))
    if rnd is None:
        return None
    need = field_of(rnd, "need", (dict, type(None)))
    return OpenRound(
        number=int_field(rnd, "number", 1, limits.MAX_ROUND),
        opened_at=time_field(rnd, "opened_at"),
        deadline=time_field(rnd, "deadline"),
        proposals=tuple(_decode_proposal(p, ep_size) for p in list_field(rnd, "proposals")),
        need=None if need is None else _decode_capacities(need, ep_size, f"{key}.need"),
        first_proof=proof_field(rnd, "first_proof"),
    )


def _decode_growth(g: Any, ep_size: int, *, with_node: bool) -> Growth:
    return growth_fields(g, _required_plan(g, "plan", ep_size), with_node=with_node)


def _decode_v2(d: Any, *, with_node: bool = False) -> GroupState:
    ep_size = int_field(d, "ep_size", 1, limits.MAX_EP_SIZE)
    return GroupState(
        name=str_field(d, "name"),
        ep_size=ep_size,
        local_ranks=int_field(d, "local_ranks", 1, ep_size),
        epoch=int_field(d, "epoch"),
        plan=_decode_plan(d, "plan", ep_size),
        generation=int_field(d, "generation"),
        lifetime_index=int_field(d, "lifetime_index"),
        built=_decode_plan(d, "built", ep_size),
        last_closed_round=int_field(d, "last_closed_round", 0, limits.MAX_ROUND),
        closed=tuple(_decode_outcome(o, ep_size) for o in list_field(d, "closed")),
        open_round=_decode_round(d, "open_round", ep_size),
        # Rows written before restarts were collected apart have no "pending".
        pending=_decode_round(d, "pending", ep_size) if "pending" in d else None,
        ranks=tuple(_decode_rank(r) for r in list_field(d, "ranks")),
        history=tuple(
            _decode_growth(g, ep_size, with_node=with_node) for g in list_field(d, "history")
        ),
        # Rows written before group proofs: the lifetime's proof is not fixed yet.
        proof=proof_field(d, "proof") if d.get("proof") is not None else None,
        refused_proposals=int_field(d, "refused_proposals") if "refused_proposals" in d else 0,
        # Rows written before releases were recorded: none fixed yet (sized
        # as the default release; the lifetime's next decided round fixes it).
        release=release_field(d, "release", ""),
        # Rows written before owners: none, so the next restart begins a new epoch.
        owner=proof_field(d, "owner"),
    )


def _decode_v3(d: Any) -> GroupState:
    state = _decode_v2(d, with_node=True)
    if d.get("view") is None:  # rows written before views
        return state
    view, lifetime = decode_view(d["view"], state.ep_size)
    return replace(state, view=view, view_lifetime=lifetime)


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
    value = field_of(d, key, (dict, type(None)))
    if value is None:
        return None
    tokens = int_field(value, "max_num_tokens", 1, limits.MAX_TOKENS)
    plan = Plan(
        capacities=_v1_capacities(
            ep_size,
            int_field(value, "workspace_bytes", 1, limits.MAX_WORKSPACE_BYTES),
            tokens,
            int_field(value, "top_k"),
            int_field(value, "num_experts"),
        ),
        epoch=epoch,
        generation=int_field(value, "generation"),
    )
    checked(limits.check_plan, key, plan, ep_size)
    return plan


def _decode_v1(d: Any) -> GroupState:
    ep_size = int_field(d, "ep_size", 1, limits.MAX_EP_SIZE)
    plan = _decode_v1_plan(d, "plan", ep_size, 0)
    shape = plan.capacities if plan is not None else None
    history = []
    for g in list_field(d, "history"):
        if shape is None:
            break  # a history without a stored plan has no shape to give it
        grown = Plan(
            capacities=_v1_capacities(
                ep_size,
                int_field(g, "workspace_bytes", 1, limits.MAX_WORKSPACE_BYTES),
                int_field(g, "max_num_tokens", 1, limits.MAX_TOKENS),
                shape.top_k,
                shape.num_experts,
            ),
            epoch=0,
            generation=int_field(g, "generation"),
        )
        history.append(
            Growth(
                plan=grown,
                layer=str_field(g, "layer"),
                ep_rank=int_field(g, "ep_rank", 0, limits.MAX_EP_SIZE - 1),
                round=int_field(g, "round", 0, limits.MAX_ROUND),
                at=time_field(g, "at"),
            )
        )
    return GroupState(
        name=str_field(d, "name"),
        ep_size=ep_size,
        local_ranks=int_field(d, "local_ranks", 1, ep_size),
        plan=plan,
        generation=int_field(d, "generation"),
        lifetime_index=int_field(d, "lifetime_index"),
        built=_decode_v1_plan(d, "built", ep_size, 0),
        last_closed_round=int_field(d, "last_closed_round", 0, limits.MAX_ROUND),
        ranks=tuple(_decode_rank(r) for r in list_field(d, "ranks")),
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
