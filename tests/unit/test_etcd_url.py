"""The pure parts of the etcd client (moe_sidecar.etcd.url, .errors, .transport): URL parsing, key ranges, error mapping."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from moe_sidecar.config import ConfigError, SidecarConfig
from moe_sidecar.etcd.client import (
    DEFAULT_PREFIX,
    DEFAULT_TIMEOUT,
    EtcdAuthError,
    EtcdClient,
    EtcdCompacted,
    EtcdPermissionDenied,
    EtcdRequestError,
    EtcdTarget,
    EtcdTimeout,
    EtcdUnavailable,
    EtcdUrlError,
    parse_etcd_url,
    prefix_range_end,
)
from moe_sidecar.etcd.errors import mapped_error, status_from_reason

pytestmark = pytest.mark.timeout(30)


def test_one_endpoint_with_a_prefix() -> None:
    assert parse_etcd_url("etcd://10.0.0.1:2379/moe/prod") == EtcdTarget(
        endpoints=("10.0.0.1:2379",), prefix="/moe/prod/"
    )


def test_several_endpoints_default_port_and_default_prefix() -> None:
    target = parse_etcd_url("etcd://a.example,b.example:12379,[::1]:2380,[fe80::1]")
    assert target.endpoints == ("a.example:2379", "b.example:12379", "[::1]:2380", "[fe80::1]:2379")
    assert target.prefix == DEFAULT_PREFIX
    assert not target.tls
    assert target.timeout == DEFAULT_TIMEOUT
    assert parse_etcd_url("etcd://h/").prefix == DEFAULT_PREFIX
    assert parse_etcd_url("etcd://h/a%20b//").prefix == "/a b/"


def test_tls_and_auth_options() -> None:
    target = parse_etcd_url(
        "etcds://h1:2379,h2:2379/moe?cacert=/etc/etcd/ca.pem&cert=/etc/c.pem&key=/etc/k.pem"
        "&user=moe&password-file=/run/secrets/etcd&server-name=etcd.internal&timeout=2.5"
    )
    assert target.tls
    assert target.ca_file == Path("/etc/etcd/ca.pem")
    assert (target.cert_file, target.key_file) == (Path("/etc/c.pem"), Path("/etc/k.pem"))
    assert (target.user, target.password_file) == ("moe", Path("/run/secrets/etcd"))
    assert target.server_name == "etcd.internal"
    assert target.timeout == 2.5
    # TLS with the system's roots needs no option at all.
    assert parse_etcd_url("etcds://h").tls


@pytest.mark.parametrize(
    ("url", "names"),
    [
        ("http://h:2379/p", "etcd:// or etcds://"),
        ("h:2379", "scheme"),
        ("etcd://", "empty"),
        ("etcd://a,,b", "empty"),
        ("etcd://a:2379,a:2379", "given twice"),
        ("etcd://:2379", "host is empty"),
        ("etcd://h:", "port after ':' is empty"),
        ("etcd://h:http", "'http' is not a number"),
        ("etcd://h:70000", "outside 1..65535"),
        ("etcd://h:0", "outside 1..65535"),
        ("etcd://::1:2379", "[ADDRESS]:PORT"),
        ("etcd://[::1", "[ADDRESS]:PORT"),
        ("etcd://[::1]x", "':PORT' after ']'"),
        ("etcd://root:pw@h:2379/p", "password is never written in the URL"),
        ("etcd://h/p#frag", "fragment"),
        ("etcd://h/p?cacert=/ca.pem", "needs TLS: use etcds://"),
        ("etcd://h/p?server-name=x", "needs TLS"),
        ("etcds://h/p?cert=/c.pem", "go together"),
        ("etcds://h/p?key=/k.pem", "go together"),
        ("etcd://h/p?user=root:pw", "bare name"),
        ("etcd://h/p?password-file=/pw", "needs 'user'"),
        ("etcd://h/p?usr=root", "unknown option 'usr'"),
        ("etcd://h/p?user=a&user=b", "given twice"),
        ("etcd://h/p?user=", "empty value"),
        ("etcd://h/p?timeout=soon", "not a number"),
        ("etcd://h/p?timeout=0", "must be in"),
        ("etcd://h/p?timeout=nan", "must be in"),
        ("etcd://h/p%0a", "control character"),
    ],
)
def test_malformed_urls_are_refused_naming_the_value(url: str, names: str) -> None:
    with pytest.raises(EtcdUrlError) as raised:
        parse_etcd_url(url)
    assert names in str(raised.value)
    assert repr(url) in str(raised.value)
    # The sidecar's configuration reports it as a ConfigError naming --store.
    with pytest.raises(ConfigError, match="store"):
        SidecarConfig(store=url)


def test_files_are_read_by_the_target_not_the_parser(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("s3cret\n")
    (tmp_path / "ca.pem").write_bytes(b"CA")
    target = parse_etcd_url(
        f"etcds://h/p?user=moe&password-file={tmp_path / 'pw'}&cacert={tmp_path / 'ca.pem'}"
    )
    assert target.password() == "s3cret"
    tls = target.tls_config()
    assert tls is not None
    assert tls.ca == b"CA"
    assert tls.cert is None
    assert EtcdClient.from_target(target).endpoints == ("h:2379",)
    assert parse_etcd_url("etcd://h").tls_config() is None

    missing = parse_etcd_url(f"etcds://h/p?cacert={tmp_path / 'nope.pem'}")
    with pytest.raises(EtcdUrlError, match=r"cacert=.*nope\.pem: cannot read it"):
        missing.tls_config()
    with pytest.raises(EtcdUrlError, match="needs a password"):
        EtcdClient.from_target(parse_etcd_url("etcd://h/p?user=moe"))
    assert EtcdClient.from_target(parse_etcd_url("etcd://h/p?user=moe"), password="pw")


def test_client_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="at least one"):
        EtcdClient([])
    with pytest.raises(ValueError, match="sequence"):
        EtcdClient("h:2379")
    with pytest.raises(ValueError, match="go together"):
        EtcdClient(["h:2379"], user="root")
    with pytest.raises(ValueError, match="timeout"):
        EtcdClient(["h:2379"], timeout=0)
    with pytest.raises(ValueError, match="start_revision"):
        EtcdClient(["h:2379"]).watch_prefix("/p/", -1)


@pytest.mark.parametrize(
    ("prefix", "end"),
    [
        (b"/moe/", b"/moe0"),
        (b"a", b"b"),
        (b"a\xff", b"b"),
        (b"a\xfe\xff\xff", b"a\xff"),
        (b"\xff\xff", b"\0"),
        (b"", b"\0"),
    ],
)
def test_prefix_range_end(prefix: bytes, end: bytes) -> None:
    assert prefix_range_end(prefix) == end


def test_watch_cancel_reasons_are_read_as_statuses() -> None:
    reason = "rpc error: code = PermissionDenied desc = etcdserver: permission denied"
    assert status_from_reason(reason) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "etcdserver: permission denied",
    )
    assert status_from_reason("something else") == (None, "something else")
    assert status_from_reason("rpc error: code = Bogus desc = x") == (None, "x")


@pytest.mark.parametrize(
    ("code", "text", "kind"),
    [
        (grpc.StatusCode.UNAVAILABLE, "etcdserver: no leader", EtcdUnavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", EtcdTimeout),
        (grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied", EtcdPermissionDenied),
        (grpc.StatusCode.UNAUTHENTICATED, "etcdserver: invalid auth token", EtcdAuthError),
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            "etcdserver: authentication failed, invalid user ID or password",
            EtcdAuthError,
        ),
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: user name is empty", EtcdAuthError),
        (
            grpc.StatusCode.FAILED_PRECONDITION,
            "etcdserver: authentication is not enabled",
            EtcdAuthError,
        ),
        (
            grpc.StatusCode.OUT_OF_RANGE,
            "etcdserver: mvcc: required revision has been compacted",
            EtcdCompacted,
        ),
        (
            grpc.StatusCode.OUT_OF_RANGE,
            "etcdserver: mvcc: required revision is a future revision",
            EtcdRequestError,
        ),
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: request is too large", EtcdRequestError),
    ],
)
def test_etcd_statuses_map_to_typed_errors(
    code: grpc.StatusCode, text: str, kind: type[Exception]
) -> None:
    error = mapped_error(code, text, what="get", endpoint="h:2379")
    assert type(error) is kind
    assert "h:2379" in str(error)
    assert text in str(error)
