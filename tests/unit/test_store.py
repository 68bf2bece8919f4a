"""The SQLite store: exact round trips, committed writes, clear errors at start."""

from __future__ import annotations

import contextlib
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest

from moe_sidecar.store.row_codec import encode_group
from moe_sidecar.store.sqlite import DATABASE_FILE, ReuseRecord, StateStore, StoreError
from tests.unit.groups import rich_state

pytestmark = pytest.mark.timeout(10)


def test_save_then_load_in_a_new_store(tmp_path: Path) -> None:
    state = rich_state()
    store = StateStore(tmp_path)
    store.save(state)
    store.save(state)  # an upsert, not a second row
    store.close()
    store = StateStore(tmp_path)
    try:
        assert store.load() == {state.name: state}
        mode = sqlite3.connect(tmp_path / DATABASE_FILE).execute("PRAGMA journal_mode").fetchone()
        assert mode[0] == "wal"
    finally:
        store.close()


def test_save_many_is_one_transaction(tmp_path: Path) -> None:
    one = rich_state()
    two = replace(one, name="other")
    store = StateStore(tmp_path)
    store.save_many([one, two])
    assert set(store.load()) == {"g/ep4", "other"}
    store.close()


def test_second_store_on_the_same_dir_is_refused(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    with pytest.raises(StoreError, match="in use by another moe-sidecar"):
        StateStore(tmp_path)
    store.close()
    StateStore(tmp_path).close()  # released on close


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("not json", "not JSON"),
        ('{"name": "g/ep4", "version": 2}', "missing field"),
        (None, "holds True"),
    ],
)
def test_corrupt_rows_name_the_group(tmp_path: Path, text: str | None, needle: str) -> None:
    store = StateStore(tmp_path)
    store.save(rich_state())
    store.close()
    if text is None:
        text = encode_group(rich_state()).replace(
            '"generation":2,"lifetime_index"', '"generation":true,"lifetime_index"'
        )
    with sqlite3.connect(tmp_path / DATABASE_FILE) as db:
        db.execute("UPDATE groups SET state = ?", (text,))
    store = StateStore(tmp_path)
    try:
        with pytest.raises(StoreError, match="group 'g/ep4' is corrupt") as info:
            store.load()
        assert needle in str(info.value)
    finally:
        store.close()


def test_unknown_schema_version_is_refused(tmp_path: Path) -> None:
    StateStore(tmp_path).close()
    with sqlite3.connect(tmp_path / DATABASE_FILE) as db:
        db.execute("PRAGMA user_version=99")
    with pytest.raises(StoreError, match="schema version 99"):
        StateStore(tmp_path)
    # The refused store released the directory.
    with sqlite3.connect(tmp_path / DATABASE_FILE) as db:
        db.execute("PRAGMA user_version=1")
    StateStore(tmp_path).close()


def test_foreign_database_is_refused(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / DATABASE_FILE) as db:
        db.execute("CREATE TABLE something_else (x)")
    with pytest.raises(StoreError, match="schema version 0"):
        StateStore(tmp_path)


def test_garbage_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / DATABASE_FILE).write_bytes(b"\x00garbage" * 512)
    with pytest.raises(StoreError, match="not a usable SQLite database"):
        StateStore(tmp_path)


def test_unusable_state_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StoreError, match="not usable"):
        StateStore(blocker / "state")


# --- the outbox: what the cluster store has not got yet ------------------------------


def test_a_pending_save_is_recorded_with_the_row_and_cleared_by_its_seq(tmp_path: Path) -> None:
    state = rich_state()
    store = StateStore(tmp_path)
    store.save(state)
    assert store.pending() == []
    store.save(state, pending=True)
    [(name, seq)] = store.pending()
    assert name == state.name
    store.save(state, pending=True)  # saved again before the push finished
    assert not store.clear_pending(name, seq)
    [(_, newer)] = store.pending()
    assert newer > seq
    store.mark_pending(["other"])
    assert [n for n, _ in store.pending()] == [state.name, "other"]
    assert store.clear_pending(name, newer)
    store.close()
    # The outbox is durable: a restart still knows what to push.
    store = StateStore(tmp_path)
    try:
        assert [n for n, _ in store.pending()] == ["other"]
    finally:
        store.close()


def test_a_database_without_the_outbox_gets_one(tmp_path: Path) -> None:
    # Written before the outbox existed: same schema version, one table.
    db = sqlite3.connect(tmp_path / DATABASE_FILE)
    db.executescript(
        "CREATE TABLE groups (name TEXT PRIMARY KEY NOT NULL, state TEXT NOT NULL) "
        "WITHOUT ROWID; PRAGMA user_version=1;"
    )
    db.execute("INSERT INTO groups VALUES (?, ?)", (rich_state().name, encode_group(rich_state())))
    db.commit()
    db.close()
    store = StateStore(tmp_path)
    try:
        assert store.load() == {rich_state().name: rich_state()}
        assert store.pending() == []
        store.save(rich_state(), pending=True)
        assert len(store.pending()) == 1
    finally:
        store.close()


def test_a_failed_write_raises_the_stores_error_with_the_drivers_cause(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    try:
        # Another program drops the outbox: the write's transaction fails half-way.
        with contextlib.closing(sqlite3.connect(tmp_path / DATABASE_FILE)) as other:
            other.execute("DROP TABLE outbox")
            other.commit()
        with pytest.raises(StoreError, match=r"cannot save group .* no such table: outbox") as info:
            store.save(rich_state(), pending=True)
        assert isinstance(info.value.__cause__, sqlite3.OperationalError)
        assert store.load() == {}  # rolled back: nothing of it is stored
        with pytest.raises(StoreError, match="no such table: outbox"):
            store.pending()
    finally:
        store.close()


def test_reuse_records_are_read_back_and_forgotten_by_the_next_save(tmp_path: Path) -> None:
    state = rich_state()
    g = state.name
    store = StateStore(tmp_path)
    store.save(state)
    store.record_reuse(ReuseRecord(g, 1, 2, "layer.2"))
    store.record_reuse(ReuseRecord(g, 1, 3, "layer.3"))
    store.close()
    store = StateStore(tmp_path)
    assert store.reuse_records() == [
        ReuseRecord(g, 1, 2, "layer.2"),
        ReuseRecord(g, 1, 3, "layer.3"),
    ]
    store.save(state)  # the row now holds them
    store.close()
    store = StateStore(tmp_path)
    assert store.reuse_records() == []
    store.record_reuse(ReuseRecord(g, 1, 4, "layer.4"))
    store.delete(g)
    assert store.reuse_records() == []
    store.close()
