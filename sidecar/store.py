"""Durable group state: one SQLite database (WAL) in the state directory.

Each group is one row holding its whole :class:`~moe_sidecar.policy.GroupState`
as JSON: the stored plan, the generation counter, the growth history, the
ranks, the open round and the outcomes of recent closed rounds (so that a
rank retrying after a sidecar crash gets the very decision it missed). A
``save`` is one committed transaction; the state holder calls it before it
answers anyone, so an answered decision is on disk.

A lock file keeps a second sidecar off the same state directory: two
writers would overwrite each other's groups.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from moe_sidecar.errors import ErrorCode
from moe_sidecar.policy import (
    Action,
    Decision,
    GroupState,
    Growth,
    OpenRound,
    Outcome,
    Plan,
    Proposal,
    RankRecord,
    Refusal,
    Requirement,
)

__all__ = [
    "DATABASE_FILE",
    "LOCK_FILE",
    "SCHEMA_VERSION",
    "StateStore",
    "StoreError",
    "decode_group",
    "encode_group",
]

DATABASE_FILE = "sidecar.sqlite3"
LOCK_FILE = "sidecar.lock"
SCHEMA_VERSION = 1
"""Stored in ``PRAGMA user_version``; bumped with every incompatible change."""

_SCHEMA = """
CREATE TABLE groups (
    name TEXT PRIMARY KEY NOT NULL,
    state TEXT NOT NULL
) WITHOUT ROWID;
"""


_UPSERT = (
    "INSERT INTO groups (name, state) VALUES (?, ?) "
    "ON CONFLICT(name) DO UPDATE SET state = excluded.state"
)


class StoreError(Exception):
    """The state directory cannot be used: locked, corrupt, or an unknown schema."""


# --- encoding -----------------------------------------------------------------------


def _plan(p: Plan) -> dict[str, Any]:
    return {
        "workspace_bytes": p.workspace_bytes,
        "max_num_tokens": p.max_num_tokens,
        "top_k": p.top_k,
        "num_experts": p.num_experts,
        "generation": p.generation,
        "shape_layer": p.shape_layer,
        "shape_rank": p.shape_rank,
        "payload_bytes": p.payload_bytes,
    }


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
    r = p.requirement
    return {
        "group": p.group,
        "ep_size": p.ep_size,
        "ep_rank": p.ep_rank,
        "local_ranks": p.local_ranks,
        "lifetime": p.lifetime,
        "round": p.round,
        "requirement": {
            "workspace_bytes": r.workspace_bytes,
            "max_num_tokens": r.max_num_tokens,
            "top_k": r.top_k,
            "num_experts": r.num_experts,
            "layer": r.layer,
            "payload_bytes": r.payload_bytes,
        },
    }


def encode_group(state: GroupState) -> str:
    """The JSON text stored for ``state``."""
    rnd = state.open_round
    document = {
        "name": state.name,
        "ep_size": state.ep_size,
        "local_ranks": state.local_ranks,
        "plan": None if state.plan is None else _plan(state.plan),
        "generation": state.generation,
        "lifetime_index": state.lifetime_index,
        "built": None if state.built is None else _plan(state.built),
        "last_closed_round": state.last_closed_round,
        "closed": [_outcome(o) for o in state.closed],
        "open_round": None
        if rnd is None
        else {
            "number": rnd.number,
            "opened_at": rnd.opened_at,
            "deadline": rnd.deadline,
            "proposals": [_proposal(p) for p in rnd.proposals],
        },
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
            }
            for r in state.ranks
        ],
        "history": [
            {
                "generation": g.generation,
                "workspace_bytes": g.workspace_bytes,
                "max_num_tokens": g.max_num_tokens,
                "layer": g.layer,
                "ep_rank": g.ep_rank,
                "round": g.round,
                "at": g.at,
            }
            for g in state.history
        ],
    }
    return json.dumps(document, separators=(",", ":"))


# --- decoding -----------------------------------------------------------------------
# Every field is read and type-checked explicitly: a hand-edited or truncated
# row must fail at start with its group's name, never half-load.


def _get(d: Any, key: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise ValueError(f"missing field {key!r}")
    value = d[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int subclass; a stored bool where a number belongs is corruption.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ValueError(f"field {key!r} holds {value!r}")
    return value


def _int(d: Any, key: str) -> int:
    return int(_get(d, key, int))


def _float(d: Any, key: str) -> float:
    return float(_get(d, key, (int, float)))


def _str(d: Any, key: str) -> str:
    return str(_get(d, key, str))


def _list(d: Any, key: str) -> list[Any]:
    return list(_get(d, key, list))


def _decode_plan(d: Any) -> Plan:
    return Plan(
        workspace_bytes=_int(d, "workspace_bytes"),
        max_num_tokens=_int(d, "max_num_tokens"),
        top_k=_int(d, "top_k"),
        num_experts=_int(d, "num_experts"),
        generation=_int(d, "generation"),
        shape_layer=_str(d, "shape_layer"),
        shape_rank=_int(d, "shape_rank"),
        payload_bytes=_int(d, "payload_bytes"),
    )


def _optional_plan(d: Any, key: str) -> Plan | None:
    if not isinstance(d, dict) or key not in d:
        raise ValueError(f"missing field {key!r}")
    return None if d[key] is None else _decode_plan(d[key])


def _decode_outcome(d: Any) -> Outcome:
    kind = _str(d, "kind")
    if kind == "decision":
        return Decision(
            round=_int(d, "round"),
            action=Action(_str(d, "action")),
            plan=_decode_plan(_get(d, "plan", dict)),
            grew=bool(_get(d, "grew", bool)),
            layer=_str(d, "layer"),
        )
    if kind == "refusal":
        return Refusal(
            round=_int(d, "round"),
            code=ErrorCode(_str(d, "code")),
            message=_str(d, "message"),
            missing_ranks=tuple(int(r) for r in _list(d, "missing_ranks")),
        )
    raise ValueError(f"unknown outcome kind {kind!r}")


def _decode_proposal(d: Any) -> Proposal:
    r = _get(d, "requirement", dict)
    return Proposal(
        group=_str(d, "group"),
        ep_size=_int(d, "ep_size"),
        ep_rank=_int(d, "ep_rank"),
        local_ranks=_int(d, "local_ranks"),
        lifetime=_str(d, "lifetime"),
        round=_int(d, "round"),
        requirement=Requirement(
            workspace_bytes=_int(r, "workspace_bytes"),
            max_num_tokens=_int(r, "max_num_tokens"),
            top_k=_int(r, "top_k"),
            num_experts=_int(r, "num_experts"),
            layer=_str(r, "layer"),
            payload_bytes=_int(r, "payload_bytes"),
        ),
    )


def decode_group(text: str) -> GroupState:
    """The group state stored as ``text``.

    Raises:
        ValueError: the text is not a complete, well-typed group document.
    """
    d = json.loads(text)
    rnd = _get(d, "open_round", (dict, type(None)))
    return GroupState(
        name=_str(d, "name"),
        ep_size=_int(d, "ep_size"),
        local_ranks=_int(d, "local_ranks"),
        plan=_optional_plan(d, "plan"),
        generation=_int(d, "generation"),
        lifetime_index=_int(d, "lifetime_index"),
        built=_optional_plan(d, "built"),
        last_closed_round=_int(d, "last_closed_round"),
        closed=tuple(_decode_outcome(o) for o in _list(d, "closed")),
        open_round=None
        if rnd is None
        else OpenRound(
            number=_int(rnd, "number"),
            opened_at=_float(rnd, "opened_at"),
            deadline=_float(rnd, "deadline"),
            proposals=tuple(_decode_proposal(p) for p in _list(rnd, "proposals")),
        ),
        ranks=tuple(
            RankRecord(
                ep_rank=_int(r, "ep_rank"),
                lifetime=_str(r, "lifetime"),
                lifetime_index=_int(r, "lifetime_index"),
                last_round=_int(r, "last_round"),
                last_layer=_str(r, "last_layer"),
                last_seen=_float(r, "last_seen"),
                committed_generation=_int(r, "committed_generation"),
                build_seconds=_float(r, "build_seconds"),
            )
            for r in _list(d, "ranks")
        ),
        history=tuple(
            Growth(
                generation=_int(g, "generation"),
                workspace_bytes=_int(g, "workspace_bytes"),
                max_num_tokens=_int(g, "max_num_tokens"),
                layer=_str(g, "layer"),
                ep_rank=_int(g, "ep_rank"),
                round=_int(g, "round"),
                at=_float(g, "at"),
            )
            for g in _list(d, "history")
        ),
    )


# --- the store ----------------------------------------------------------------------


class StateStore:
    """The SQLite database of every group's state under one state directory.

    Not thread-safe: the state holder calls it from the event loop only.

    Raises:
        StoreError: (on construction) the directory cannot be created, another
            sidecar holds it, the file is not a database, or its schema is
            not :data:`SCHEMA_VERSION`.
    """

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / DATABASE_FILE
        try:
            state_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
            self._lock_fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o640)
        except OSError as error:
            raise StoreError(f"state dir {str(state_dir)!r} is not usable: {error}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StoreError(
                f"state dir {str(state_dir)!r} is in use by another moe-sidecar process "
                f"(lock {LOCK_FILE!r} held)"
            ) from None
        try:
            self._db = self._open()
        except BaseException:
            os.close(self._lock_fd)
            raise

    def _open(self) -> sqlite3.Connection:
        # isolation_level=None: no implicit transactions; every statement
        # below either is one committed transaction or sits in an explicit
        # BEGIN ... COMMIT.
        try:
            db = sqlite3.connect(self.path, isolation_level=None)
        except sqlite3.Error as error:
            raise StoreError(f"cannot open {str(self.path)!r}: {error}") from None
        try:
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreError(f"{str(self.path)!r}: cannot switch to WAL (mode {mode!r})")
            # synchronous=NORMAL: in WAL mode a commit appends to the WAL file
            # before it returns, so a committed decision survives the sidecar
            # process dying at any point (kill -9, OOM): the bytes are in the
            # OS page cache and the next open replays them. Only a power loss
            # or kernel crash can drop the last commits (NORMAL skips the
            # fsync per commit that FULL does), and then the worst outcome is
            # a warm restart that rebuilds once more: the union is recomputed
            # from the ranks' next proposals. FULL would put an fsync on every
            # answered round.
            db.execute("PRAGMA synchronous=NORMAL")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
            if version == 0 and not tables:
                db.executescript(
                    f"BEGIN IMMEDIATE;{_SCHEMA}PRAGMA user_version={SCHEMA_VERSION};COMMIT;"
                )
            elif version != SCHEMA_VERSION or "groups" not in tables:
                raise StoreError(
                    f"{str(self.path)!r} has schema version {version} (tables "
                    f"{sorted(tables)}); this sidecar reads version {SCHEMA_VERSION}. "
                    "Move the file away to start from empty state."
                )
        except sqlite3.DatabaseError as error:
            db.close()
            raise StoreError(
                f"{str(self.path)!r} is not a usable SQLite database: {error}"
            ) from None
        except BaseException:
            db.close()
            raise
        return db

    def load(self) -> dict[str, GroupState]:
        """Every stored group, by name.

        Raises:
            StoreError: a row does not decode (the message names the group).
        """
        groups: dict[str, GroupState] = {}
        try:
            rows = self._db.execute("SELECT name, state FROM groups ORDER BY name").fetchall()
        except sqlite3.DatabaseError as error:
            raise StoreError(f"{str(self.path)!r} cannot be read: {error}") from None
        for name, text in rows:
            try:
                state = decode_group(text)
            except (ValueError, TypeError, KeyError) as error:
                raise StoreError(
                    f"{str(self.path)!r}: group {name!r} is corrupt ({error}); "
                    "move the file away to start from empty state"
                ) from None
            if state.name != name:
                raise StoreError(f"{str(self.path)!r}: row {name!r} holds group {state.name!r}")
            groups[name] = state
        return groups

    def save(self, state: GroupState) -> None:
        """Writes one group in one committed transaction.

        Raises:
            sqlite3.Error: the write failed; nothing of it is stored.
        """
        self._db.execute(
            _UPSERT,
            (state.name, encode_group(state)),
        )

    def save_many(self, states: Iterable[GroupState]) -> None:
        """Writes several groups in one committed transaction.

        Raises:
            sqlite3.Error: the write failed; none of it is stored.
        """
        rows = [(s.name, encode_group(s)) for s in states]
        if not rows:
            return
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.executemany(
                _UPSERT,
                rows,
            )
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def close(self) -> None:
        """Closes the database and releases the state directory. Idempotent."""
        if self._lock_fd < 0:
            return
        try:
            self._db.close()
        finally:
            os.close(self._lock_fd)
            self._lock_fd = -1
