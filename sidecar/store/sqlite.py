"""Durable group state: one SQLite database (WAL) in the state directory.

Each group is one row holding its whole :class:`~moe_sidecar.core.group.GroupState`
as a versioned JSON document (:mod:`moe_sidecar.store.row_codec`, the one codec of
this boundary): the stored plan, the generation counter, the growth history, the
ranks, the open round and the outcomes of recent closed rounds (so that a
rank retrying after a sidecar crash gets the very decision it missed). A
``save`` is one committed transaction; the state holder calls it before it
answers anyone, so an answered decision is on disk.

With a cluster store (etcd), the same database is the node's write-ahead
record: a ``save`` that must reach the cluster also records the group in the
``outbox`` table in the same transaction, and the replica clears it only once
the cluster has the group as it was saved (or later); what the cluster
missed while it was away, or while the sidecar was down, is pushed from
there. The table is created when missing; a release without it ignores it.

A round decided REUSE changes the group by its outcome alone, so instead of
rewriting the group's row it is recorded as one short row of the
``reuse_rounds`` table (group, lifetime, round, layer) before it is
answered (:meth:`StateStore.record_reuse`); :meth:`StateStore.reuse_records`
reads them back for the state holder to apply to the rows they follow
(:func:`moe_sidecar.core.policy.recovery.replay_reuse`), and the group's next
``save`` forgets them, in the same transaction (the row then holds them).
This table is created when missing too.

A lock file keeps a second sidecar off the same state directory: two
writers would overwrite each other's groups.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

from moe_sidecar.core.errors import quote_name
from moe_sidecar.core.group import GroupState
from moe_sidecar.store.row_codec import RowError, decode_group, encode_group

__all__ = [
    "DATABASE_FILE",
    "LOCK_FILE",
    "SCHEMA_VERSION",
    "ReuseRecord",
    "StateStore",
    "StoreError",
]

DATABASE_FILE = "sidecar.sqlite3"
LOCK_FILE = "sidecar.lock"
SCHEMA_VERSION = 1
"""The table layout, stored in ``PRAGMA user_version``; bumped with every
incompatible change of the table. Rows carry their own version
(:data:`moe_sidecar.store.row_codec.ROW_VERSION`)."""

_SCHEMA = """
CREATE TABLE groups (
    name TEXT PRIMARY KEY NOT NULL,
    state TEXT NOT NULL
) WITHOUT ROWID;
"""
_OUTBOX = """
CREATE TABLE IF NOT EXISTS outbox (
    name TEXT PRIMARY KEY NOT NULL,
    seq INTEGER NOT NULL
) WITHOUT ROWID;
"""
"""Groups the cluster store has not got yet; ``seq`` moves with every save."""
_REMOVED = """
CREATE TABLE IF NOT EXISTS removed (
    name TEXT PRIMARY KEY NOT NULL
) WITHOUT ROWID;
"""
"""Groups an admin removed: the cluster store's copy of them is not merged
back until a rank of this node proposes for the group again."""
_REUSE_ROUNDS = """
CREATE TABLE IF NOT EXISTS reuse_rounds (
    name TEXT NOT NULL,
    lifetime_index INTEGER NOT NULL,
    round INTEGER NOT NULL,
    layer TEXT NOT NULL,
    PRIMARY KEY (name, round)
) WITHOUT ROWID;
"""
"""The REUSE rounds closed since each group's row was last written."""
_RECORD_REUSE = (
    "INSERT OR REPLACE INTO reuse_rounds (name, lifetime_index, round, layer) VALUES (?, ?, ?, ?)"
)
_FORGET_REUSE = "DELETE FROM reuse_rounds WHERE name = ?"
_MARK = (
    "INSERT INTO outbox (name, seq) VALUES (?, 1) "
    "ON CONFLICT(name) DO UPDATE SET seq = outbox.seq + 1"
)


_UPSERT = (
    "INSERT INTO groups (name, state) VALUES (?, ?) "
    "ON CONFLICT(name) DO UPDATE SET state = excluded.state"
)


class ReuseRecord(NamedTuple):
    """One REUSE round recorded since its group's row was written."""

    group: str
    lifetime_index: int
    round: int
    layer: str


class StoreError(Exception):
    """The state store failed: at start, the state directory cannot be used
    (locked, corrupt, an unknown schema); later, a read or write failed (the
    database driver's error is the ``__cause__``) and nothing of it happened.

    The store's callers catch this, never the driver's own errors.
    """


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
                f"(lock {LOCK_FILE!r} held); give each sidecar its own --state-dir"
            ) from None
        try:
            self._db = self._open()
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._with_reuse_rounds: set[str] = set()
        """Groups with rows in ``reuse_rounds``: their next save forgets them."""

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
            db.execute(_OUTBOX)
            db.execute(_REMOVED)
            db.execute(_REUSE_ROUNDS)
            self._probe_write(db)
        except sqlite3.DatabaseError as error:
            db.close()
            raise StoreError(
                f"{str(self.path)!r} is not a usable SQLite database: {error}"
            ) from None
        except BaseException:
            db.close()
            raise
        return db

    def _probe_write(self, db: sqlite3.Connection) -> None:
        """One committed write, so a database the sidecar cannot write stops the
        start instead of failing every round after it reported SERVING.

        Raises:
            StoreError: the write failed (read-only file, WAL file not creatable).
        """
        try:
            db.execute("BEGIN IMMEDIATE")
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            db.execute("COMMIT")
        except sqlite3.OperationalError as error:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise StoreError(
                f"{str(self.path)!r} cannot be written: {error}; the sidecar must store every "
                "decision before it answers (check the file's and the state dir's permissions)"
            ) from None

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
            except RowError as error:
                raise StoreError(
                    f"{str(self.path)!r}: group {quote_name(name)} is corrupt ({error}); "
                    "move the file away to start from empty state"
                ) from None
            if state.name != name:
                raise StoreError(
                    f"{str(self.path)!r}: row {quote_name(name)} holds group "
                    f"{quote_name(state.name)}"
                )
            groups[name] = state
        return groups

    def save(self, state: GroupState, *, pending: bool = False) -> None:
        """Writes one group in one committed transaction; with ``pending``, also
        records in it that the cluster store must get the group.

        Raises:
            StoreError: the write failed; nothing of it is stored.
        """
        name = state.name
        row = (name, encode_group(state))
        recorded = name in self._with_reuse_rounds
        with self._driver_errors(f"save group {quote_name(name)}"):
            if not pending and not recorded:
                self._db.execute(_UPSERT, row)
                return
            with self._transaction():
                self._db.execute(_UPSERT, row)
                if pending:
                    self._db.execute(_MARK, (name,))
                if recorded:
                    self._db.execute(_FORGET_REUSE, (name,))
        self._with_reuse_rounds.discard(name)

    def record_reuse(self, record: ReuseRecord) -> None:
        """Records one round of ``record.group`` decided REUSE (one committed
        write of a few bytes, instead of the group's row).

        Raises:
            StoreError: the write failed; nothing of it is stored.
        """
        with self._driver_errors(f"record a REUSE round of group {quote_name(record.group)}"):
            self._db.execute(_RECORD_REUSE, record)
        self._with_reuse_rounds.add(record.group)

    def reuse_records(self) -> list[ReuseRecord]:
        """Every REUSE round recorded since its group's row was written, by
        group and round.

        Raises:
            StoreError: the read failed.
        """
        with self._driver_errors("read the recorded REUSE rounds"):
            rows = self._db.execute(
                "SELECT name, lifetime_index, round, layer FROM reuse_rounds ORDER BY name, round"
            ).fetchall()
        records = [ReuseRecord(str(n), int(i), int(r), str(layer)) for n, i, r, layer in rows]
        self._with_reuse_rounds.update(r.group for r in records)
        return records

    def mark_pending(self, names: Iterable[str]) -> None:
        """Records that the cluster store must get these groups (one transaction).

        Raises:
            StoreError: the write failed; nothing of it is stored.
        """
        rows = [(name,) for name in names]
        if not rows:
            return
        with self._driver_errors("record groups for the cluster store"), self._transaction():
            self._db.executemany(_MARK, rows)

    def pending(self) -> list[tuple[str, int]]:
        """The groups the cluster store has not got yet, by name, each with its
        ``seq`` (pass it to :meth:`clear_pending`).

        Raises:
            StoreError: the read failed.
        """
        with self._driver_errors("read the groups pending for the cluster store"):
            rows = self._db.execute("SELECT name, seq FROM outbox ORDER BY name").fetchall()
        return [(str(name), int(seq)) for name, seq in rows]

    def clear_pending(self, name: str, seq: int) -> bool:
        """Forgets that ``name`` is pending, unless it was saved again since
        ``seq`` was read; True if it was forgotten.

        Raises:
            StoreError: the write failed.
        """
        with self._driver_errors(f"clear group {quote_name(name)} from the outbox"):
            cursor = self._db.execute("DELETE FROM outbox WHERE name = ? AND seq = ?", (name, seq))
        return cursor.rowcount > 0

    def delete(self, name: str) -> None:
        """Removes one group (its row and any pending push) and remembers the
        removal, in one committed transaction.

        Raises:
            StoreError: the write failed; nothing changed.
        """
        with self._driver_errors(f"remove group {quote_name(name)}"), self._transaction():
            self._db.execute("DELETE FROM groups WHERE name = ?", (name,))
            self._db.execute("DELETE FROM outbox WHERE name = ?", (name,))
            self._db.execute(_FORGET_REUSE, (name,))
            self._db.execute("INSERT OR IGNORE INTO removed (name) VALUES (?)", (name,))
        self._with_reuse_rounds.discard(name)

    def removed(self) -> set[str]:
        """Groups an admin removed and no rank of this node proposed for since.

        Raises:
            StoreError: the read failed.
        """
        with self._driver_errors("read the removed groups"):
            return {str(row[0]) for row in self._db.execute("SELECT name FROM removed")}

    def forget_removed(self, name: str) -> None:
        """A rank of this node proposes for a removed group again: merges resume.

        Raises:
            StoreError: the write failed.
        """
        with self._driver_errors(f"record group {quote_name(name)} again"):
            self._db.execute("DELETE FROM removed WHERE name = ?", (name,))

    def save_many(self, states: Iterable[GroupState]) -> None:
        """Writes several groups in one committed transaction.

        Raises:
            StoreError: the write failed; none of it is stored.
        """
        rows = [(s.name, encode_group(s)) for s in states]
        if not rows:
            return
        recorded = [(name,) for name, _ in rows if name in self._with_reuse_rounds]
        with self._driver_errors(f"save {len(rows)} groups"), self._transaction():
            self._db.executemany(_UPSERT, rows)
            self._db.executemany(_FORGET_REUSE, recorded)
        self._with_reuse_rounds.difference_update(name for (name,) in recorded)

    @contextlib.contextmanager
    def _driver_errors(self, what: str) -> Iterator[None]:
        """Turns the driver's error into a :class:`StoreError` naming ``what``
        failed, the driver's error chained as its cause."""
        try:
            yield
        except sqlite3.Error as error:
            raise StoreError(f"cannot {what} in {str(self.path)!r}: {error}") from error

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One committed transaction around the block; rolled back if it raises."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
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
