"""The etcd replica: every group's cluster plan in etcd, the join of every node's.

Layout: one key per group, ``PREFIX + "groups/" + quote(name)``, holding the
group's :class:`~moe_sidecar.core.cluster.ClusterPlan` as
:func:`~moe_sidecar.store.row_codec.encode_cluster_plan` writes it (signed with an
HMAC when the cluster has a key: :mod:`moe_sidecar.etcd.document`).

Writing (the push loop). The node's SQLite is the write-ahead record: a step
that grew, reset or absorbed a plan recorded its group as pending in the
same transaction that saved it (the ``outbox``). The loop takes the pending
groups and, for each, compares-and-swaps on the key's ``mod_revision``: what
etcd holds joined with what the node holds
(:func:`~moe_sidecar.core.cluster.join_cluster_plans`); on a lost race it joins
with the winner's value (which the failed transaction returned) and tries
again, so concurrent writers lose nothing. Nothing is written when etcd
already covers the node's group. Once written, the group is cleared from the
outbox unless it was saved again meanwhile, and the node merges what it
wrote (the join may hold another node's growths). While etcd is away the
loop retries with backoff (50 ms doubling to 2 s); rounds never wait for it.

Reading (the watch loop). At start and whenever the watch cannot resume
(history compacted, etcd re-created or restored: its revision went
backwards) the replica reads the whole prefix at one revision: its keys
first, in pages of ``--store-page-bytes / --store-max-document-bytes`` keys,
then each document alone (etcd tells no value's size before sending it, so
one document at a time is what bounds the node's memory, whatever the
prefix holds), merges every document,
queues every local group etcd lacks, and watches from that revision on.
Every document read is untrusted (:func:`~moe_sidecar.etcd.document.open_document`:
size, HMAC, decoding, the core's ranges, plausibility against the group
here); one that fails is logged, counted
(``moe_sidecar_store_rejected_documents``) and set aside: never merged, and
replaced by this node's own document at its next compare-and-swap (a
local group over a set-aside key is queued at once). The replica keeps what
it saw only of the keys of groups this node holds. A deleted key is not a
reset: the nodes write the group again on its next change or their next
start; ResetGroup is how a plan is forgotten everywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from urllib.parse import quote, unquote

import grpc

from moe_sidecar.config import SidecarConfig
from moe_sidecar.config.values import DEFAULT_STORE_PAGE_BYTES
from moe_sidecar.core.cluster import (
    ClusterPlan,
    LayoutMismatch,
    check_cluster_plan,
    covers,
    join_cluster_plans,
)
from moe_sidecar.core.errors import CoordinatorError, InvalidArgument, PreconditionFailed
from moe_sidecar.core.plan import ShapeMismatch
from moe_sidecar.etcd.backoff import Backoff
from moe_sidecar.etcd.client import (
    DEFAULT_PAGE_SIZE,
    EtcdClient,
    EtcdClusterReset,
    EtcdError,
    EtcdRequestError,
    EtcdStale,
    EtcdUnavailable,
    EventType,
    KeyValue,
)
from moe_sidecar.etcd.document import (
    DocumentRefused,
    DocumentRules,
    open_document,
    read_key_file,
    seal_document,
)
from moe_sidecar.store.replica import ReplicaHost, StoreMetrics
from moe_sidecar.store.sqlite import StoreError

__all__ = [
    "GROUPS_DIR",
    "MAX_CAS_ATTEMPTS",
    "RETRY_MAX",
    "RETRY_MIN",
    "EtcdReplica",
    "ReplicaSettings",
    "group_key",
    "replica_settings",
]

_log = logging.getLogger("moe_sidecar.etcd.replica")

GROUPS_DIR = "groups/"
"""Under the URL's prefix, the directory of the groups' keys."""
MAX_CAS_ATTEMPTS = 32
"""Lost compare-and-swap races in a row on one key before backing off."""
RETRY_MIN = 0.05
"""Seconds before a loop retries etcd after its first failure (doubling from there)."""
RETRY_MAX = 2.0
"""The longest pause between retries."""


def group_key(prefix: str, name: str) -> bytes:
    """The key of group ``name`` under ``prefix`` (the name percent-encoded)."""
    return (prefix + GROUPS_DIR + quote(name, safe="")).encode()


@dataclass(frozen=True)
class ReplicaSettings:
    """What the replica reads at once and accepts (the ``--store-*`` flags)."""

    rules: DocumentRules = field(default_factory=DocumentRules)
    page_bytes: int = DEFAULT_STORE_PAGE_BYTES
    """Bytes one page of a prefix read may hold (its keys are listed a page at
    a time, its documents read one by one)."""

    @property
    def page_keys(self) -> int:
        """Keys per listing page: as many documents of the largest size accepted as fit a page."""
        return max(1, min(DEFAULT_PAGE_SIZE, self.page_bytes // self.rules.max_document_bytes))


def replica_settings(config: SidecarConfig) -> ReplicaSettings:
    """The settings ``config`` gives (the key read from ``--store-key-file``).

    Raises:
        ValueError: the key file cannot be read or holds too short a key.
    """
    key = read_key_file(config.store_key_file) if config.store_key_file is not None else None
    rules = DocumentRules(
        max_document_bytes=config.store_max_document_bytes,
        max_generation_lead=config.store_max_generation_lead,
        max_epoch_lead=config.store_max_epoch_lead,
        key=key,
    )
    return ReplicaSettings(rules, config.store_page_bytes)


@dataclass(frozen=True)
class _Known:
    """What the replica last saw under one key."""

    revision: int
    """The key's ``mod_revision`` (0: the key does not exist)."""
    doc: ClusterPlan | None
    """The document (None: none, or it was set aside)."""
    set_aside: bool = False
    """The document was refused: the next write replaces it."""


_ABSENT = _Known(0, None)


class _Contended(Exception):
    """Too many compare-and-swap races lost in a row on one key."""


class EtcdReplica:
    """Keeps the node's groups in etcd and merges what other nodes put there.

    Created before the event loop serves (no I/O); :meth:`start` reads etcd
    and starts the push and watch tasks; :meth:`close` ends them.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        metrics: StoreMetrics,
        settings: ReplicaSettings = ReplicaSettings(),
    ) -> None:
        self._client = client
        self._settings = settings
        self._prefix = prefix
        self._groups_prefix = (prefix + GROUPS_DIR).encode()
        self.metrics = metrics
        self._known: dict[bytes, _Known] = {}
        self._revision: int | None = None
        """Every change up to this revision has been merged (None: re-read the prefix)."""
        self._high_revision = 0
        self._host: ReplicaHost | None = None
        self._wake: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._outage: str | None = None

    @property
    def prefix(self) -> str:
        return self._prefix

    # --- lifecycle ------------------------------------------------------------------

    async def start(self, host: ReplicaHost) -> None:
        """Reads the prefix once and merges it, then starts pushing and watching.

        An unreachable etcd is logged: the sidecar serves from its own state
        and the tasks catch up once etcd answers.
        """
        self._host = host
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        try:
            await self._sync()
        except EtcdError as error:
            self._down(error)
            _log.warning(
                "cannot read the plans in etcd at start; serving from this node's state "
                "and retrying in the background",
                extra={"prefix": self._prefix, "error": str(error)},
            )
        self._tasks = [
            asyncio.create_task(self._watch_loop(), name="etcd-watch"),
            asyncio.create_task(self._push_loop(), name="etcd-push"),
        ]
        self._wake.set()

    def replicate(self, name: str) -> None:
        """Wakes the push loop (the group is already in the outbox)."""
        if self._wake is not None:
            self._wake.set()

    async def close(self, flush_seconds: float) -> None:
        """Stops watching, pushes what is pending for at most ``flush_seconds``,
        then closes the client. What is left stays in the outbox. Idempotent."""
        if self._closing:
            return
        self._closing = True
        if self._stop is not None:
            self._stop.set()
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._host is not None and flush_seconds > 0:
            try:
                async with asyncio.timeout(flush_seconds):
                    await self._push_pending()
            except TimeoutError:
                _log.warning(
                    "groups still pending for etcd at shutdown; the next start pushes them",
                    extra={"seconds": flush_seconds},
                )
            except (EtcdError, _Contended, StoreError, CoordinatorError) as error:
                _log.warning(
                    "cannot push pending groups to etcd at shutdown; the next start pushes them",
                    extra={"error": str(error)},
                )
        await self._client.close()

    # --- health ---------------------------------------------------------------------

    def _up(self) -> None:
        self.metrics.up.set(1)
        if self._outage is not None:
            _log.info("etcd answers again", extra={"prefix": self._prefix})
            self._outage = None

    def _down(self, error: BaseException) -> None:
        self.metrics.up.set(0)
        if self._outage is None:
            _log.warning(
                "etcd unreachable; rounds are decided on this node's state and pushed later",
                extra={"prefix": self._prefix, "error": str(error)},
            )
        self._outage = str(error)

    # --- reading --------------------------------------------------------------------

    def _name_of(self, key: bytes) -> str:
        return unquote(key[len(self._groups_prefix) :].decode("utf-8", "replace"))

    def _reject(self, key: bytes, reason: str, why: str) -> None:
        self.metrics.rejected.inc()
        _log.error(
            "skipped a plan document in etcd",
            extra={"key": key.decode("utf-8", "replace"), "reason": reason, "why": why},
        )

    def _decode(self, key: bytes, value: bytes, revision: int) -> _Known:
        """What this node accepts of ``value`` under ``key`` (set aside when refused)."""
        assert self._host is not None
        name = self._name_of(key)
        local = self._host.cluster_plan(name)
        try:
            doc = open_document(self._settings.rules, key, value, name, local)
        except DocumentRefused as refused:
            self._reject(key, refused.reason, refused.message)
            return _Known(revision, None, set_aside=True)
        return _Known(revision, doc)

    def _merge(self, key: bytes, doc: ClusterPlan) -> None:
        """Merges ``doc`` into the node's group; a document that cannot join is skipped.

        Raises:
            CoordinatorUnavailable: the node cannot persist the merge.
        """
        assert self._host is not None
        try:
            if self._host.merge(doc):
                self.metrics.merges.inc()
        except (InvalidArgument, PreconditionFailed) as error:
            self._reject(key, "not_joinable", error.message)

    def _accept(self, key: bytes, value: bytes, revision: int) -> None:
        """Merges what ``key`` holds; remembers it only for a group this node holds."""
        assert self._host is not None
        known = self._decode(key, value, revision)
        self._known[key] = known
        if known.doc is not None:
            self._merge(key, known.doc)
        self._settle(key, known)

    def _settle(self, key: bytes, known: _Known) -> None:
        """Forgets ``key`` unless its group is here; queues the group when its
        document was set aside, so that etcd gets a valid one back."""
        assert self._host is not None
        name = self._name_of(key)
        if self._host.cluster_plan(name) is None:
            self._known.pop(key, None)  # not here: nothing to push, nothing to keep
        elif known.set_aside:
            self._host.mark_pending([name])
            if self._wake is not None:
                self._wake.set()

    def _too_large(self, item: KeyValue) -> None:
        self._reject(item.key, "too_big", "larger than one response of etcd may carry")
        known = _Known(item.mod_revision, None, set_aside=True)
        self._known[item.key] = known
        self._settle(item.key, known)

    async def _sync(self) -> None:
        """Reads every group under the prefix at one revision, merging page by page."""
        assert self._host is not None and self._wake is not None
        self.metrics.resyncs.inc()
        self._known.clear()
        revision: int | None = None
        pages = self._client.read_prefix_by_key(self._groups_prefix, keys=self._settings.page_keys)
        async for page in pages:
            if revision is None:
                self._up()
                self._note_revision(page.revision)
            revision = page.revision
            for item in page.too_large:
                self._too_large(item)
            for item in page.items:
                self._accept(item.key, item.value, item.mod_revision)
        assert revision is not None
        missing = [
            name
            for name in self._host.group_names()
            if group_key(self._prefix, name) not in self._known
        ]
        if missing:
            self._host.mark_pending(missing)
        self._revision = revision
        self._wake.set()

    def _note_revision(self, revision: int) -> None:
        if revision < self._high_revision:
            _log.warning(
                "etcd's revision went backwards (re-created or restored from a backup); "
                "merging what it holds and pushing what it lacks",
                extra={"revision": revision, "seen": self._high_revision},
            )
        self._high_revision = revision

    async def _watch_loop(self) -> None:
        assert self._stop is not None
        backoff = Backoff(RETRY_MIN, RETRY_MAX)
        while not self._closing:
            try:
                if self._revision is None:
                    await self._sync()
                assert self._revision is not None
                async with self._client.watch_prefix(
                    self._groups_prefix, start_revision=self._revision + 1
                ) as watch:
                    async for event in watch:
                        known = self._known.get(event.key)
                        if known is not None and known.revision >= event.mod_revision:
                            pass  # this node's own write: nothing new to decode or merge
                        elif event.type is EventType.PUT:
                            self._accept(event.key, event.value, event.mod_revision)
                        else:
                            self._known.pop(event.key, None)
                            _log.info(
                                "a group's key was deleted from etcd; it is written again "
                                "on the group's next change",
                                extra={"key": event.key.decode("utf-8", "replace")},
                            )
                        self._revision = watch.next_revision - 1
                        self._high_revision = max(self._high_revision, event.mod_revision)
                        self._up()
                        backoff.reset()
                return  # the client closed
            except EtcdStale as error:
                # Compacted past what was merged, or etcd re-created: read it all again.
                _log.warning(
                    "etcd watch cannot resume; reading the prefix again",
                    extra={"error": str(error)},
                )
                if isinstance(error, EtcdClusterReset):
                    self._high_revision = 0
                self._revision = None
                continue
            except EtcdError as error:
                self._down(error)
            except (StoreError, CoordinatorError) as error:
                # This node could not write what it read: read it all again later.
                _log.error("cannot merge plans from etcd", extra={"error": str(error)})
                self._revision = None
            await backoff.pause(self._stop)

    # --- writing --------------------------------------------------------------------

    async def _push_loop(self) -> None:
        assert self._wake is not None and self._stop is not None
        backoff = Backoff(RETRY_MIN, RETRY_MAX)
        while not self._closing:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._push_pending()
                backoff.reset()
                continue
            except EtcdError as error:
                self.metrics.writes.labels("error").inc()
                self._down(error)
            except _Contended as error:
                _log.warning(
                    "etcd writes keep losing races; backing off", extra={"key": str(error)}
                )
            except (StoreError, CoordinatorError) as error:
                _log.error("cannot read or clear the outbox", extra={"error": str(error)})
            await backoff.pause(self._stop)
            self._wake.set()

    async def _push_pending(self) -> None:
        """Pushes every pending group until none is left.

        Raises:
            EtcdError: etcd failed (what is left stays pending).
            _Contended: one key kept changing under the writes.
            StoreError: the outbox cannot be read or cleared.
        """
        assert self._host is not None
        while True:
            pending = self._host.pending_replication()
            self.metrics.pending.set(len(pending))
            if not pending:
                return
            for name, seq in pending:
                await self._push(name)
                self._host.replicated(name, seq)

    async def _read(self, key: bytes) -> _Known:
        try:
            got = await self._client.get(key)
        except EtcdRequestError as error:
            if error.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            # A value too large to receive: set it aside, knowing only its revision.
            self._reject(key, "too_big", "larger than one response of etcd may carry")
            return _Known(await self._client.revision_of(key), None, set_aside=True)
        self._up()
        return _ABSENT if got is None else self._decode(key, got.value, got.mod_revision)

    async def _push(self, name: str) -> None:
        """Makes etcd's document of ``name`` cover the node's group.

        Raises:
            EtcdError: etcd failed; whether a write happened is unknown (a
                retry finds out: it loses its race to its own write).
            _Contended: :data:`MAX_CAS_ATTEMPTS` races lost in a row.
        """
        host = self._host
        assert host is not None
        key = group_key(self._prefix, name)
        known = self._known.get(key)
        for _ in range(MAX_CAS_ATTEMPTS):
            doc = host.cluster_plan(name)
            if doc is None:
                return
            if known is None:
                known = await self._read(key)
            remote = known.doc  # None: no key, or a document set aside (replaced here)
            if remote is not None and covers(remote, doc):
                self._merge(key, remote)
                return
            try:
                value = (
                    doc
                    if remote is None
                    else join_cluster_plans(doc, remote, node=host.node, now=host.now())
                )
                check_cluster_plan(value)
            except (LayoutMismatch, ShapeMismatch) as error:
                self._reject(key, "not_joinable", f"cannot join this node's group: {error}")
                return
            except InvalidArgument as error:
                self._reject(
                    key, "not_joinable", f"its join with this node's group is out of range: {error}"
                )
                return
            try:
                sealed = seal_document(self._settings.rules, key, value)
                result = await self._client.put_if(key, sealed, known.revision)
            except EtcdUnavailable:
                self._known.pop(key, None)
                raise
            self._up()
            current = result.current
            if result.succeeded:
                assert current is not None
                self.metrics.writes.labels("written").inc()
                self._known[key] = _Known(current.mod_revision, value)
                if value is not doc:
                    self._merge(key, value)  # the join holds another node's growths
                return
            self.metrics.writes.labels("conflict").inc()
            known = (
                _ABSENT
                if current is None
                else self._decode(key, current.value, current.mod_revision)
            )
            self._known[key] = known
        raise _Contended(key.decode("utf-8", "replace"))
