"""moe_sidecar.etcd.client (and its transport and watch) against a real etcd: CAS races, prefix reads, watches
that survive a restart, compaction, auth, TLS, failover and deadlines."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import pytest

from moe_sidecar.etcd.client import (
    EtcdAuthError,
    EtcdClientClosed,
    EtcdClusterReset,
    EtcdCompacted,
    EtcdEventTooLarge,
    EtcdPermissionDenied,
    EtcdRequestError,
    EtcdStale,
    EtcdTimeout,
    EtcdTls,
    EtcdUnavailable,
    EtcdWatch,
    EventType,
    Versioned,
    WatchEvent,
    parse_etcd_url,
)
from tests.etcd_server import EtcdServer, EtcdTestClient, StartEtcd, free_port

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(90)]

T = TypeVar("T")


async def eventually(action: Callable[[], Awaitable[T]], *, within: float = 20.0) -> T:
    """``action()``'s result once it stops raising EtcdUnavailable (etcd coming back)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await action()
        except EtcdUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def next_events(watch: EtcdWatch, count: int, *, within: float = 20.0) -> list[WatchEvent]:
    """The next ``count`` events of ``watch``, failing if they take longer than ``within``."""

    async def take() -> list[WatchEvent]:
        return [await anext(watch) for _ in range(count)]

    return await asyncio.wait_for(take(), within)


async def test_get_put_if_and_delete(etcd_server: EtcdServer) -> None:
    async with EtcdTestClient([etcd_server.endpoint]) as client:
        assert await client.get("/t/k") is None

        created = await client.put_if("/t/k", b"a", 0)
        assert created.succeeded
        assert created.current is not None
        r1 = created.current.mod_revision
        assert created.current == Versioned(b"a", r1)
        assert await client.get("/t/k") == (b"a", r1)

        again = await client.put_if("/t/k", b"b", 0)
        assert not again.succeeded
        assert again.current == (b"a", r1)

        swapped = await client.put_if("/t/k", b"c", r1)
        assert swapped.succeeded
        assert swapped.current is not None
        r2 = swapped.current.mod_revision
        assert r2 > r1
        assert await client.get(b"/t/k") == (b"c", r2)

        stale = await client.put_if("/t/k", b"d", r1)
        assert (stale.succeeded, stale.current) == (False, (b"c", r2))

        assert await client.delete("/t/k") is True
        assert await client.delete("/t/k") is False
        assert await client.get("/t/k") is None
        gone = await client.put_if("/t/k", b"e", r2)
        assert (gone.succeeded, gone.current) == (False, None)
        assert (await client.put_if("/t/k", b"e", 0)).succeeded

        revision = await client.put("/t/plain", b"p")
        assert await client.get("/t/plain") == (b"p", revision)
        with pytest.raises(ValueError, match="expected_mod_revision"):
            await client.put_if("/t/k", b"x", -1)


async def test_two_concurrent_writers_one_wins_and_the_loser_learns_its_value(
    etcd_server: EtcdServer,
) -> None:
    async with (
        EtcdTestClient([etcd_server.endpoint]) as one,
        EtcdTestClient([etcd_server.endpoint]) as two,
    ):
        start = await one.put_if("/t/plan", b"v0", 0)
        assert start.current is not None
        expected = start.current.mod_revision
        for attempt in range(20):
            a, b = await asyncio.gather(
                one.put_if("/t/plan", f"one-{attempt}".encode(), expected),
                two.put_if("/t/plan", f"two-{attempt}".encode(), expected),
            )
            assert sorted([a.succeeded, b.succeeded]) == [False, True]
            winner, loser = (a, b) if a.succeeded else (b, a)
            assert winner.current is not None
            # The loser is told exactly what the winner wrote, and at which revision.
            assert loser.current == winner.current
            assert await one.get("/t/plan") == winner.current
            expected = winner.current.mod_revision

        # A loser that retries against the revision it was told wins.
        lost = await two.put_if("/t/plan", b"late", expected - 1)
        assert not lost.succeeded
        assert lost.current is not None
        assert (await two.put_if("/t/plan", b"late", lost.current.mod_revision)).succeeded


async def test_get_prefix_reads_one_snapshot_in_pages(etcd_server: EtcdServer) -> None:
    async with EtcdTestClient([etcd_server.endpoint], page_size=3) as client:
        keys = [f"/t/p/{i:02d}" for i in range(10)]
        for key in reversed(keys):
            await client.put(key, key.encode())
        # Neighbours that share the text prefix but not the "directory".
        await client.put("/t/p0", b"outside")
        await client.put("/t/o", b"outside")
        latest = await client.put("/t/q", b"outside")

        read = await client.get_prefix("/t/p/")
        assert [item.key for item in read.items] == [k.encode() for k in keys]
        assert [item.value for item in read.items] == [k.encode() for k in keys]
        assert read.revision == latest
        assert all(0 < item.mod_revision <= read.revision for item in read.items)
        first_key, first_value, first_revision = read.items[0]
        assert (first_key, first_value) == (b"/t/p/00", b"/t/p/00")
        assert first_revision == read.items[0].mod_revision

        empty = await client.get_prefix("/t/none/")
        assert empty.items == []
        assert empty.revision == latest


async def test_watch_sees_another_clients_writes_in_order(etcd_server: EtcdServer) -> None:
    async with (
        EtcdTestClient([etcd_server.endpoint]) as watcher,
        EtcdTestClient([etcd_server.endpoint]) as writer,
    ):
        snapshot = await watcher.get_prefix("/t/w/")
        async with watcher.watch_prefix("/t/w/", snapshot.revision + 1) as watch:
            r1 = await writer.put("/t/w/a", b"1")
            await writer.put("/t/elsewhere", b"not watched")
            r2 = (await writer.put_if("/t/w/a", b"2", r1)).current
            await writer.delete("/t/w/a")
            events = await next_events(watch, 3)
        assert r2 is not None
        assert [(e.type, e.key, e.value) for e in events] == [
            (EventType.PUT, b"/t/w/a", b"1"),
            (EventType.PUT, b"/t/w/a", b"2"),
            (EventType.DELETE, b"/t/w/a", b""),
        ]
        assert events[0].mod_revision == r1
        assert events[1].mod_revision == r2.mod_revision
        assert events[2].mod_revision > r2.mod_revision


async def test_watch_from_now_and_from_an_old_revision(etcd_server: EtcdServer) -> None:
    async with EtcdTestClient([etcd_server.endpoint]) as client:
        first = await client.put("/t/h/a", b"1")
        await client.put("/t/h/b", b"2")
        async with client.watch_prefix("/t/h/", first) as replay:
            assert [e.value for e in await next_events(replay, 2)] == [b"1", b"2"]
        async with client.watch_prefix("/t/h/") as from_now:
            # The stream opens on the first read; write once it is certainly open.
            waiting = asyncio.ensure_future(next_events(from_now, 1))
            for _ in range(200):
                if from_now.next_revision:
                    break
                await asyncio.sleep(0.01)
            await client.put("/t/h/c", b"3")
            assert [e.value for e in await waiting] == [b"3"]


async def test_watch_resumes_after_etcd_is_killed_and_restarted(etcd_server: EtcdServer) -> None:
    async with (
        EtcdTestClient([etcd_server.endpoint]) as watcher,
        EtcdTestClient([etcd_server.endpoint]) as writer,
    ):
        start = await watcher.get_prefix("/t/r/")
        async with watcher.watch_prefix("/t/r/", start.revision + 1) as watch:
            await writer.put("/t/r/before", b"0")
            assert [e.key for e in await next_events(watch, 1)] == [b"/t/r/before"]

            await asyncio.to_thread(etcd_server.kill)
            with pytest.raises(EtcdUnavailable):
                await writer.put("/t/r/during", b"x", timeout=1)
            await asyncio.to_thread(etcd_server.start)

            # Written as soon as etcd is back, likely before the watch reconnected:
            # the watch resumes from its last revision, so it still sees them.
            after: list[int] = []
            for i in range(3):
                key = f"/t/r/after-{i}"
                after.append(await eventually(functools.partial(writer.put, key, b"v")))
            events = await next_events(watch, 3)
            assert [e.key for e in events] == [f"/t/r/after-{i}".encode() for i in range(3)]
            assert [e.mod_revision for e in events] == after
            assert watch.next_revision == after[-1] + 1


async def test_watch_from_a_compacted_revision_raises_a_typed_error(
    etcd_server: EtcdServer,
) -> None:
    async with EtcdTestClient([etcd_server.endpoint]) as client:
        first = await client.put("/t/c/k", b"0")
        for i in range(1, 5):
            latest = await client.put("/t/c/k", str(i).encode())
        await client.compact(latest)

        with pytest.raises(EtcdCompacted, match="re-read") as raised:
            async with client.watch_prefix("/t/c/", first) as watch:
                await next_events(watch, 1)
        assert raised.value.compact_revision == latest
        assert raised.value.requested_revision == first

        # What the error asks for works: read again, watch from that read's revision + 1.
        read = await client.get_prefix("/t/c/")
        assert [item.value for item in read.items] == [b"4"]
        async with client.watch_prefix("/t/c/", read.revision + 1) as watch:
            await client.put("/t/c/k", b"5")
            assert [e.value for e in await next_events(watch, 1)] == [b"5"]

        with pytest.raises(EtcdCompacted):
            await client.compact(first)


async def test_a_watch_that_must_resume_past_compacted_history_raises_compacted(
    etcd_server: EtcdServer,
) -> None:
    async with (
        EtcdTestClient([etcd_server.endpoint]) as watcher,
        EtcdTestClient([etcd_server.endpoint]) as writer,
    ):
        start = await watcher.get_prefix("/t/x/")
        async with watcher.watch_prefix("/t/x/", start.revision + 1) as watch:
            seen = await writer.put("/t/x/k", b"0")
            assert [e.mod_revision for e in await next_events(watch, 1)] == [seen]
            # The watch reads its stream only when asked for the next event, so
            # it cannot reconnect before the history it needs is gone.
            await asyncio.to_thread(etcd_server.kill)
            await asyncio.to_thread(etcd_server.start)
            for i in range(3):
                latest = await eventually(functools.partial(writer.put, "/t/x/k", str(i).encode()))
            await writer.compact(latest)

            with pytest.raises(EtcdCompacted) as raised:
                await next_events(watch, 1)
            assert raised.value.requested_revision == seen + 1
            assert raised.value.compact_revision == latest


async def test_auth_with_the_right_password_survives_an_etcd_restart(
    etcd_factory: StartEtcd,
) -> None:
    server = etcd_factory(auth_password="root-pw")
    async with (
        EtcdTestClient([server.endpoint], user="root", password="root-pw") as client,
        EtcdTestClient([server.endpoint], user="root", password="root-pw") as writer,
    ):
        await client.put("/t/a/k", b"1")
        assert await client.get("/t/a/k") is not None
        start = await client.get_prefix("/t/a/")
        async with client.watch_prefix("/t/a/", start.revision + 1) as watch:
            await writer.put("/t/a/k", b"2")
            assert [e.value for e in await next_events(watch, 1)] == [b"2"]
            token = client.transport._token

            # etcd's simple tokens live in its memory: after a restart it no longer
            # knows them. The client logs in again (calls and the watch alike).
            await asyncio.to_thread(server.kill)
            await asyncio.to_thread(server.start)
            assert await eventually(lambda: client.get("/t/a/k")) is not None
            assert client.transport._token is not None
            assert client.transport._token != token
            await eventually(lambda: writer.put("/t/a/k", b"3"))
            assert [e.value for e in await next_events(watch, 1)] == [b"3"]


async def test_clients_recover_when_etcd_is_recreated_empty(etcd_factory: StartEtcd) -> None:
    server = etcd_factory(auth_password="root-pw")
    async with (
        EtcdTestClient([server.endpoint], user="root", password="root-pw", timeout=2) as client,
        EtcdTestClient([server.endpoint], user="root", password="root-pw", timeout=2) as watcher,
    ):
        start = await watcher.get_prefix("/t/")
        async with watcher.watch_prefix("/t/", start.revision + 1) as watch:
            for i in range(30):
                await client.put("/t/n", str(i).encode())
            assert len(await next_events(watch, 30)) == 30

            await asyncio.to_thread(server.wipe)
            await asyncio.to_thread(server.start)
            await asyncio.to_thread(server.enable_auth, "root-pw")

            # etcd 3.4 holds a call (and a watch) whose simple token names a raft
            # index it has not reached yet, until that index or the deadline
            # comes; the client then drops the token and logs in afresh.
            # And the new cluster's revisions are not the old one's: watching on
            # from the old revision would skip its first writes. The watch says so.
            with pytest.raises(EtcdClusterReset, match="re-read") as raised:
                await next_events(watch, 1)
            assert isinstance(raised.value, EtcdStale)
            assert raised.value.revision < raised.value.expected_revision

            with contextlib.suppress(EtcdTimeout):
                await client.get("/t/n")
            assert await client.get("/t/n") is None


async def test_auth_errors_are_typed(etcd_factory: StartEtcd) -> None:
    server = etcd_factory(auth_password="root-pw")
    async with EtcdTestClient([server.endpoint], user="root", password="wrong") as client:
        with pytest.raises(EtcdAuthError, match="authentication failed") as raised:
            await client.get("/t/k")
        assert not isinstance(raised.value, EtcdPermissionDenied)
        with pytest.raises(EtcdAuthError):
            async with client.watch_prefix("/t/") as watch:
                await next_events(watch, 1)
    async with EtcdTestClient([server.endpoint]) as anonymous:
        with pytest.raises(EtcdAuthError, match="user name is empty"):
            await anonymous.put("/t/k", b"v")
        # Status needs no login: it is what a health check can use.
        assert (await anonymous.status()).version

    server.add_user("moe", "moe-pw", readwrite_prefix="/moe/")
    async with EtcdTestClient([server.endpoint], user="moe", password="moe-pw") as limited:
        await limited.put("/moe/k", b"v")
        assert (await limited.get_prefix("/moe/")).items[0].value == b"v"
        with pytest.raises(EtcdPermissionDenied, match="permission denied"):
            await limited.put("/other/k", b"v")
        with pytest.raises(EtcdPermissionDenied):
            async with limited.watch_prefix("/other/") as watch:
                await next_events(watch, 1)


async def test_credentials_for_a_cluster_without_auth_are_refused(
    etcd_server: EtcdServer,
) -> None:
    async with EtcdTestClient([etcd_server.endpoint], user="root", password="pw") as client:
        with pytest.raises(EtcdAuthError, match="not enabled"):
            await client.get("/t/k")


async def test_a_dead_first_endpoint_fails_over_to_the_second(etcd_server: EtcdServer) -> None:
    dead = f"127.0.0.1:{free_port()}"
    async with EtcdTestClient([dead, etcd_server.endpoint]) as client:
        await client.put("/t/f", b"1")
        assert await client.get("/t/f") is not None
        assert (await client.status()).endpoint == etcd_server.endpoint
        start = await client.get_prefix("/t/")
        assert client.endpoints == (dead, etcd_server.endpoint)

    # A watch fails over too.
    async with (
        EtcdTestClient([dead, etcd_server.endpoint]) as watcher,
        watcher.watch_prefix("/t/", start.revision + 1) as watch,
    ):
        await eventually(lambda: etcd_client_put(etcd_server, "/t/g", b"2"))
        assert [e.key for e in await next_events(watch, 1)] == [b"/t/g"]


async def etcd_client_put(server: EtcdServer, key: str, value: bytes) -> int:
    async with EtcdTestClient([server.endpoint]) as client:
        return await client.put(key, value)


async def test_no_endpoint_alive_is_unavailable_at_once() -> None:
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    async with EtcdTestClient(dead, timeout=10) as client:
        started = time.monotonic()
        with pytest.raises(EtcdUnavailable) as raised:
            await client.get("/t/k")
        assert time.monotonic() - started < 5
        assert not isinstance(raised.value, EtcdTimeout)
        assert all(endpoint in str(raised.value) for endpoint in dead)


async def test_a_hung_etcd_hits_the_deadline_and_a_killed_one_is_unavailable(
    etcd_server: EtcdServer,
) -> None:
    async with EtcdTestClient([etcd_server.endpoint], timeout=0.5) as client:
        await client.put("/t/d", b"1")
        etcd_server.pause()
        try:
            started = time.monotonic()
            with pytest.raises(EtcdTimeout, match=r"DEADLINE_EXCEEDED|deadline"):
                await client.get("/t/d")
            assert time.monotonic() - started < 3
            with pytest.raises(EtcdTimeout):
                await client.put_if("/t/d", b"2", 0, timeout=0.2)
        finally:
            etcd_server.resume()
        assert await client.get("/t/d", timeout=5) is not None

        await asyncio.to_thread(etcd_server.kill)
        started = time.monotonic()
        with pytest.raises(EtcdUnavailable):
            await client.get("/t/d", timeout=5)
        assert time.monotonic() - started < 4


async def test_tls_with_the_test_ca(etcd_factory: StartEtcd) -> None:
    server = etcd_factory(tls=True)
    assert server.tls is not None
    tls = EtcdTls(ca=server.tls.ca.read_bytes())
    async with EtcdTestClient([server.endpoint], tls=tls) as client:
        await client.put("/t/tls", b"1")
        assert await client.get("/t/tls") is not None
    # Without the CA the server's certificate is not trusted.
    async with EtcdTestClient([server.endpoint], tls=EtcdTls(), timeout=3) as untrusting:
        with pytest.raises(EtcdUnavailable):
            await untrusting.get("/t/tls")
    # Plaintext to a TLS port does not answer either.
    async with EtcdTestClient([server.endpoint], timeout=3) as plaintext:
        with pytest.raises(EtcdUnavailable):
            await plaintext.get("/t/tls")


async def test_mutual_tls_from_an_etcds_url(etcd_factory: StartEtcd) -> None:
    server = etcd_factory(tls=True, client_cert_auth=True)
    assert server.tls is not None
    files = server.tls
    async with EtcdTestClient([server.endpoint], tls=EtcdTls(ca=files.ca.read_bytes())) as no_cert:
        with pytest.raises(EtcdUnavailable):
            await no_cert.get("/t/k", timeout=3)
    target = parse_etcd_url(
        f"etcds://{server.endpoint}/moe?cacert={files.ca}&cert={files.client_cert}"
        f"&key={files.client_key}&timeout=3"
    )
    async with EtcdTestClient.from_target(target) as client:
        await client.put(target.prefix + "k", b"1")
        assert (await client.get_prefix(target.prefix)).items[0].key == b"/moe/k"


async def test_a_closed_client_refuses_calls_and_ends_its_watches(
    etcd_server: EtcdServer,
) -> None:
    client = EtcdTestClient([etcd_server.endpoint])
    watch = client.watch_prefix("/t/")
    pending = asyncio.ensure_future(anext(watch, None))
    for _ in range(500):
        if watch.next_revision:  # etcd has answered: the stream is open
            break
        await asyncio.sleep(0.01)
    assert watch.next_revision
    await client.close()
    assert await asyncio.wait_for(pending, 10) is None
    with pytest.raises(EtcdClientClosed):
        await client.get("/t/k")
    await client.close()


def test_a_client_made_outside_any_loop_opens_its_channel_inside(
    etcd_server: EtcdServer,
) -> None:
    client = EtcdTestClient([etcd_server.endpoint])

    async def use() -> Versioned | None:
        async with client:
            await client.put("/t/lazy", b"1")
            return await client.get("/t/lazy")

    assert asyncio.run(use()) is not None


async def test_a_prefix_beyond_one_response_is_read_in_smaller_pages(
    etcd_server: EtcdServer,
) -> None:
    value = b"v" * 1_400_000
    async with EtcdTestClient([etcd_server.endpoint], timeout=30) as client:
        for i in range(50):  # 70 MB: more than the client's 64 MiB receive limit
            await client.put(f"/t/big/{i:02d}", value)
        pages = [page async for page in client.read_prefix("/t/big/", keys=1000)]
    # The first page was asked for again with fewer keys; nothing is lost or repeated.
    assert len(pages) > 1
    keys = [item.key for page in pages for item in page.items]
    assert keys == [f"/t/big/{i:02d}".encode() for i in range(50)]
    assert all(not page.too_large for page in pages)
    assert len({page.revision for page in pages}) == 1


async def test_a_value_beyond_one_response_is_named_not_read(etcd_factory: StartEtcd) -> None:
    # etcd takes requests this large only when told to.
    server = etcd_factory(extra_args=("--max-request-bytes=70000000",))
    async with EtcdTestClient([server.endpoint], timeout=30) as client:
        await client.put("/t/v/a", b"small")
        huge = await client.put("/t/v/b", b"x" * (65 << 20))
        await client.put("/t/v/c", b"small")
        pages = [page async for page in client.read_prefix("/t/v/", keys=10)]
        assert [item.key for page in pages for item in page.items] == [b"/t/v/a", b"/t/v/c"]
        assert [(kv.key, kv.mod_revision) for p in pages for kv in p.too_large] == [
            (b"/t/v/b", huge)
        ]
        with pytest.raises(EtcdRequestError) as raised:
            await client.get("/t/v/b")
        assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await client.revision_of("/t/v/b") == huge
        assert await client.revision_of("/t/v/none") == 0


async def test_a_watch_event_beyond_one_response_asks_for_a_re_read(
    etcd_factory: StartEtcd,
) -> None:
    server = etcd_factory(extra_args=("--max-request-bytes=70000000",))
    async with EtcdTestClient([server.endpoint], timeout=30) as client:
        start = await client.get_prefix("/t/w/")
        async with client.watch_prefix("/t/w/", start.revision + 1) as watch:
            small = await client.put("/t/w/a", b"small")
            assert [e.mod_revision for e in await next_events(watch, 1)] == [small]
            await client.put("/t/w/b", b"x" * (65 << 20))
            # Reconnecting would meet the same event again: the watch says so instead.
            with pytest.raises(EtcdEventTooLarge, match="re-read") as raised:
                await next_events(watch, 1)
            assert isinstance(raised.value, EtcdStale)
