"""A real etcd for tests: one member on free loopback ports, data in a temp dir.

Needs the ``etcd`` binary (Debian: ``apt-get install etcd-server``; CI's
``.ci/run`` installs it). Without it the fixtures skip, naming the package;
under ``CI=true`` they fail instead, so that CI never passes by skipping.

    def test_x(etcd_server: EtcdServer) -> None:
        client = EtcdClient([etcd_server.endpoint])
        ...
        etcd_server.kill()     # SIGKILL: an outage; the data dir stays
        etcd_server.start()    # again, on the same ports and data dir

``etcd_factory(auth_password=..., tls=...)`` starts more (one with auth
enabled, one serving TLS). Start, stop and kill are blocking; inside an
async test call them through ``asyncio.to_thread`` so the loop keeps running.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from moe_sidecar.etcd.client import EtcdClient, prefix_range_end
from moe_sidecar.etcd.transport import key_bytes
from moe_workspace.etcd.v3 import auth_pb2, rpc_pb2, rpc_pb2_grpc

__all__ = [
    "ETCD_PACKAGE",
    "EtcdServer",
    "EtcdStatus",
    "EtcdTestClient",
    "TlsFiles",
    "etcd_binary",
    "etcd_binary_or_skip",
    "etcd_factory",
    "etcd_server",
    "free_port",
    "make_tls_files",
]

ETCD_PACKAGE = "etcd-server"
"""The Debian package that has the ``etcd`` binary."""
START_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0
PORT_ATTEMPTS = 3
"""First starts tried on fresh ports when another process took a chosen one."""


def etcd_binary() -> str | None:
    """The etcd binary: ``$MOE_TEST_ETCD``, else ``etcd`` on PATH, else None."""
    return os.environ.get("MOE_TEST_ETCD") or shutil.which("etcd")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class TlsFiles:
    """A throwaway CA, a server certificate for 127.0.0.1/localhost and a client one."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """Makes a CA and two certificates it signs with the ``openssl`` CLI (P-256 keys).

    Raises:
        RuntimeError: openssl is missing or failed.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("openssl not found (Debian: apt-get install openssl)")
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        done = subprocess.run(
            [openssl, *args], cwd=directory, capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"openssl {' '.join(args)} failed: {done.stderr.strip()}")

    key_args = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    run(
        "req", "-x509", *key_args, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=moe-sidecar test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    for name, usage in (("server", "serverAuth,clientAuth"), ("client", "clientAuth")):
        (directory / f"{name}.ext").write_text(
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
            f"extendedKeyUsage={usage}\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
        )
        run(
            "req",
            *key_args,
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
        )
        run(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext",
        )  # fmt: skip
    return TlsFiles(
        ca=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
    )


class EtcdServer:
    """One etcd member. Ports and data dir are fixed at construction, so a
    restart after :meth:`stop` or :meth:`kill` is the same member with the same
    data on the same endpoint."""

    def __init__(
        self,
        workdir: Path,
        *,
        binary: str,
        tls: TlsFiles | None = None,
        client_cert_auth: bool = False,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        """``extra_args``: more flags for etcd (e.g. ``--max-request-bytes=N``)."""
        self.workdir = workdir
        self.name = f"moe-test-{uuid.uuid4().hex[:8]}"
        self.data_dir = workdir / f"{self.name}.etcd"
        self.log_path = workdir / f"{self.name}.log"
        self.binary = binary
        self.tls = tls
        self.client_cert_auth = client_cert_auth
        self.extra_args = extra_args
        self.client_port = free_port()
        self.peer_port = free_port()
        self.root_password: str | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._started = False  # once started, the ports (the endpoint) stay

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT``, what :class:`moe_sidecar.etcd.client.EtcdClient` takes."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        """The ``etcd://`` (or ``etcds://``) URL of this member, with prefix ``/test/``."""
        return f"{'etcds' if self.tls else 'etcd'}://{self.endpoint}/test"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _command(self) -> list[str]:
        scheme = "https" if self.tls else "http"
        client_url = f"{scheme}://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        command = [
            self.binary,
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster={self.name}={peer_url}",
            f"--initial-cluster-token={self.name}",
            "--initial-cluster-state=new",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        if self.tls is not None:
            command += [f"--cert-file={self.tls.server_cert}", f"--key-file={self.tls.server_key}"]
            if self.client_cert_auth:
                # etcd demands a client certificate as soon as it has a CA to check it with.
                command += ["--client-cert-auth", f"--trusted-ca-file={self.tls.ca}"]
        return command + list(self.extra_args)

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Starts etcd and returns once it has a leader and answers.

        Raises:
            RuntimeError: it is already running, exited, or did not answer in time
                (the message holds the tail of its log).
        """
        if self.running:
            raise RuntimeError(f"etcd {self.name} is already running (pid {self.pid})")
        for attempt in range(PORT_ATTEMPTS):
            with self.log_path.open("ab") as log:
                log.write(f"--- start {time.strftime('%H:%M:%S')}\n".encode())
                log.flush()
                self._process = subprocess.Popen(
                    self._command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                )
            self._paused = False
            try:
                self.wait_ready(timeout)
            except RuntimeError:
                # free_port() only saw the ports free: something may have taken
                # one before etcd bound it. A first start may move to new ports;
                # a restart keeps its endpoint, which clients already hold.
                this_start = self.log_path.read_text(errors="replace").rpartition("--- start")[2]
                lost_port = "address already in use" in this_start
                if self._started or not lost_port or attempt == PORT_ATTEMPTS - 1:
                    raise
                self.kill()
                shutil.rmtree(self.data_dir, ignore_errors=True)  # a member of the old ports
                self.client_port, self.peer_port = free_port(), free_port()
                continue
            self._started = True
            return

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Waits until etcd reports a leader (polling ``Maintenance.Status``).

        Raises:
            RuntimeError: etcd exited or did not answer within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        with self._channel() as channel:
            status = rpc_pb2_grpc.MaintenanceStub(channel).Status
            while time.monotonic() < deadline:
                if self._process is None or self._process.poll() is not None:
                    raise RuntimeError(
                        f"etcd {self.name} exited while starting:\n{self.log_tail()}"
                    )
                try:
                    if status(rpc_pb2.StatusRequest(), timeout=1.0).leader:
                        return
                    last = "no leader yet"
                except grpc.RpcError as error:
                    last = str(error)
                time.sleep(0.02)
        raise RuntimeError(f"etcd {self.name} not ready in {timeout}s ({last}):\n{self.log_tail()}")

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM, then waits for the exit (SIGKILL past ``timeout``)."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        if self._paused:
            self.resume()
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is flushed beyond what etcd has synced."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.kill()
        process.wait()
        self._paused = False

    def restart(self, timeout: float = START_TIMEOUT) -> None:
        """Stops (if running) and starts again, on the same ports and data dir."""
        self.stop()
        self.start(timeout)

    def wipe(self) -> None:
        """Kills etcd and deletes its data: the next start is a new, empty cluster."""
        self.kill()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.root_password = None

    def pause(self) -> None:
        """SIGSTOP: the ports stay open but nothing answers (a hung member)."""
        if self._process is None or self._process.poll() is not None:
            raise RuntimeError(f"etcd {self.name} is not running")
        os.kill(self._process.pid, signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self._process is not None and self._paused:
            os.kill(self._process.pid, signal.SIGCONT)
            self._paused = False

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # ---------------------------------------------------------------- admin calls

    @contextlib.contextmanager
    def _channel(self) -> Iterator[grpc.Channel]:
        if self.tls is None:
            channel = grpc.insecure_channel(self.endpoint)
        else:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=self.tls.ca.read_bytes(),
                private_key=self.tls.client_key.read_bytes(),
                certificate_chain=self.tls.client_cert.read_bytes(),
            )
            channel = grpc.secure_channel(self.endpoint, credentials)
        try:
            yield channel
        finally:
            channel.close()

    def _root_metadata(self, auth: rpc_pb2_grpc.AuthStub) -> tuple[tuple[str, str], ...] | None:
        if self.root_password is None:
            return None
        token = auth.Authenticate(
            rpc_pb2.AuthenticateRequest(name="root", password=self.root_password), timeout=10
        ).token
        return (("token", token),)

    def enable_auth(self, root_password: str) -> None:
        """Adds user ``root`` (role root) with ``root_password`` and turns auth on."""
        with self._channel() as channel:
            auth = rpc_pb2_grpc.AuthStub(channel)
            auth.UserAdd(
                rpc_pb2.AuthUserAddRequest(name="root", password=root_password), timeout=10
            )
            auth.UserGrantRole(
                rpc_pb2.AuthUserGrantRoleRequest(user="root", role="root"), timeout=10
            )
            auth.AuthEnable(rpc_pb2.AuthEnableRequest(), timeout=10)
        self.root_password = root_password

    def add_user(self, name: str, password: str, *, readwrite_prefix: str) -> None:
        """Adds a user whose one role may read and write keys under ``readwrite_prefix``."""
        with self._channel() as channel:
            auth = rpc_pb2_grpc.AuthStub(channel)
            metadata = self._root_metadata(auth)
            prefix = readwrite_prefix.encode()
            auth.RoleAdd(rpc_pb2.AuthRoleAddRequest(name=name), metadata=metadata, timeout=10)
            auth.RoleGrantPermission(
                rpc_pb2.AuthRoleGrantPermissionRequest(
                    name=name,
                    perm=auth_pb2.Permission(
                        permType=auth_pb2.Permission.READWRITE,
                        key=prefix,
                        range_end=prefix_range_end(prefix),
                    ),
                ),
                metadata=metadata,
                timeout=10,
            )
            auth.UserAdd(
                rpc_pb2.AuthUserAddRequest(name=name, password=password),
                metadata=metadata,
                timeout=10,
            )
            auth.UserGrantRole(
                rpc_pb2.AuthUserGrantRoleRequest(user=name, role=name),
                metadata=metadata,
                timeout=10,
            )


@dataclass(frozen=True)
class EtcdStatus:
    """What one member says about itself (``Maintenance.Status``)."""

    endpoint: str
    version: str
    leader: int
    member_id: int
    revision: int
    db_size: int


class EtcdTestClient(EtcdClient):
    """The product's client plus the calls only tests make: unconditional
    writes, deletes, compaction and a member's status. They go through the
    client's own transport (failover, deadline, login), as its reads do."""

    async def put(self, key: str | bytes, value: bytes, *, timeout: float | None = None) -> int:  # noqa: ASYNC109 (a gRPC deadline)
        """Writes ``value`` unconditionally; returns the key's new ``mod_revision``.

        Raises:
            EtcdError: as :meth:`EtcdClient.get` does.
        """
        request = rpc_pb2.PutRequest(key=key_bytes(key), value=value)
        _, response = await self.transport.call(
            "put", lambda s: s.kv.Put, request, deadline=self.transport.deadline(timeout)
        )
        return response.header.revision

    async def delete(self, key: str | bytes, *, timeout: float | None = None) -> bool:  # noqa: ASYNC109 (a gRPC deadline)
        """Deletes the key; True if it existed.

        Raises:
            EtcdError: as :meth:`EtcdClient.get` does.
        """
        request = rpc_pb2.DeleteRangeRequest(key=key_bytes(key))
        _, response = await self.transport.call(
            "delete", lambda s: s.kv.DeleteRange, request, deadline=self.transport.deadline(timeout)
        )
        return response.deleted > 0

    async def compact(self, revision: int, *, timeout: float | None = None) -> None:  # noqa: ASYNC109 (a gRPC deadline)
        """Discards the history before ``revision`` (returns once it is applied).

        Raises:
            EtcdCompacted: ``revision`` is already compacted.
            EtcdError: as :meth:`EtcdClient.get` does.
        """
        request = rpc_pb2.CompactionRequest(revision=revision, physical=True)
        await self.transport.call(
            "compact",
            lambda s: s.kv.Compact,
            request,
            deadline=self.transport.deadline(timeout),
            revision=revision,
        )

    async def status(self, *, timeout: float | None = None) -> EtcdStatus:  # noqa: ASYNC109 (a gRPC deadline)
        """What the endpoint that answers says about itself (needs no login).

        Raises:
            EtcdError: as :meth:`EtcdClient.get` does.
        """
        address, response = await self.transport.call(
            "status",
            lambda s: s.maintenance.Status,
            rpc_pb2.StatusRequest(),
            deadline=self.transport.deadline(timeout),
            authenticate=False,
        )
        return EtcdStatus(
            endpoint=address,
            version=response.version,
            leader=response.leader,
            member_id=response.header.member_id,
            revision=response.header.revision,
            db_size=response.dbSize,
        )


StartEtcd = Callable[..., EtcdServer]


def etcd_binary_or_skip() -> str:
    """The etcd binary; else the test skips (fails under CI, which installs it)."""
    binary = etcd_binary()
    if binary is not None:
        return binary
    reason = f"etcd not installed (Debian: apt-get install {ETCD_PACKAGE}; or set MOE_TEST_ETCD)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason}: CI must install it, see .ci/run")
    pytest.skip(reason)


@pytest.fixture
def etcd_factory(tmp_path: Path) -> Iterator[StartEtcd]:
    """Starts etcd members on demand; every one is killed at teardown.

    ``etcd_factory(auth_password="pw")`` enables auth (user ``root``);
    ``etcd_factory(tls=True)`` serves TLS with a throwaway CA
    (``server.tls`` has the files), ``client_cert_auth=True`` also demands a
    client certificate; ``extra_args`` are more flags for etcd.
    """
    binary = etcd_binary_or_skip()
    started: list[EtcdServer] = []

    def start(
        *,
        auth_password: str | None = None,
        tls: bool = False,
        client_cert_auth: bool = False,
        extra_args: tuple[str, ...] = (),
    ) -> EtcdServer:
        workdir = tmp_path / f"etcd{len(started)}"
        workdir.mkdir(mode=0o700)
        files = make_tls_files(workdir / "tls") if tls else None
        server = EtcdServer(
            workdir,
            binary=binary,
            tls=files,
            client_cert_auth=client_cert_auth,
            extra_args=extra_args,
        )
        started.append(server)
        server.start()
        if auth_password is not None:
            server.enable_auth(auth_password)
        return server

    yield start
    for server in started:
        server.kill()


@pytest.fixture
def etcd_server(etcd_factory: StartEtcd) -> EtcdServer:
    """One plain etcd member (no auth, no TLS), killed at teardown."""
    return etcd_factory()
