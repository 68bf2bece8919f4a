"""SidecarConfig from flags and environment; validation on construction."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from moe_sidecar.config import (
    ConfigError,
    SidecarConfig,
    SqliteStore,
    add_serve_arguments,
    check_environment,
    config_from_flags,
)
from moe_sidecar.etcd.url import EtcdTarget

pytestmark = pytest.mark.timeout(10)


def parse(argv: list[str], env: dict[str, str] | None = None) -> SidecarConfig:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return config_from_flags(parser.parse_args(argv), env or {})


def test_defaults() -> None:
    config = parse([])
    assert config == SidecarConfig()
    assert config.listen == ("127.0.0.1:50051",)
    assert config.health_port == 50052 and config.metrics_port == 9464
    assert config.state_dir == Path("/var/lib/moe-sidecar")
    assert config.round_timeout == 60.0 and config.grace_period == 5.0
    assert config.log_format == "auto" and config.log_level == "INFO"
    assert config.enable_admin is False


def test_every_flag() -> None:
    config = parse(
        [
            "--listen",
            "unix:///run/moe/s.sock",
            "--listen",
            "0.0.0.0:7000",
            "--health-port",
            "7001",
            "--metrics-port",
            "0",
            "--state-dir",
            "/tmp/state",
            "--round-timeout",
            "2.5",
            "--log-format",
            "text",
            "--log-level",
            "debug",
            "--grace-period",
            "0",
            "--enable-admin",
            "--insecure",
            "--max-groups",
            "10",
            "--max-watchers",
            "2",
            "--max-concurrent-rpcs",
            "300",
            "--max-streams-per-connection",
            "30",
            "--max-health-rpcs",
            "4",
            "--max-metrics-connections",
            "3",
            "--max-group-series",
            "5",
            "--max-page-size",
            "7",
            "--metrics-host",
            "127.0.0.1",
        ]
    )
    assert config.listen == ("unix:///run/moe/s.sock", "0.0.0.0:7000")
    assert config.listen_addresses[0].unix_path == Path("/run/moe/s.sock")
    assert (config.listen_addresses[1].host, config.listen_addresses[1].port) == ("0.0.0.0", 7000)
    assert config.health_port == 7001
    assert config.metrics_port is None  # 0 on the command line disables
    assert config.state_dir == Path("/tmp/state")
    assert config.round_timeout == 2.5 and config.grace_period == 0.0
    assert config.log_format == "text" and config.log_level == "DEBUG"
    assert config.enable_admin is True and config.insecure is True
    assert (config.max_groups, config.max_watchers, config.max_concurrent_rpcs) == (10, 2, 300)
    assert (config.max_streams_per_connection, config.max_health_rpcs) == (30, 4)
    assert (config.max_metrics_connections, config.max_group_series) == (3, 5)
    assert config.max_page_size == 7 and config.metrics_host == "127.0.0.1"


def test_every_env_key() -> None:
    env = {
        "MOE_SIDECAR_LISTEN": "unix:///run/moe/s.sock, 127.0.0.1:0",
        "MOE_SIDECAR_HEALTH_PORT": "0",
        "MOE_SIDECAR_METRICS_PORT": "9999",
        "MOE_SIDECAR_STATE_DIR": "/srv/state",
        "MOE_SIDECAR_ROUND_TIMEOUT": "30",
        "MOE_SIDECAR_LOG_FORMAT": "text",
        "MOE_SIDECAR_LOG_LEVEL": "warning",
        "MOE_SIDECAR_GRACE_PERIOD": "1.5",
        "MOE_SIDECAR_ENABLE_ADMIN": "true",
        "MOE_SIDECAR_TARGET": "unix:///belongs/to/the/client.sock",
        "MOE_SIDECAR_LOCAL_RANKS": "8",
        "MOE_SIDECAR_PROPOSE_TIMEOUT": "120",
    }
    config = parse([], env)
    assert config.listen == ("unix:///run/moe/s.sock", "127.0.0.1:0")
    assert config.health_port is None and config.metrics_port == 9999
    assert config.state_dir == Path("/srv/state")
    assert config.round_timeout == 30.0 and config.grace_period == 1.5
    assert config.log_format == "text" and config.log_level == "WARNING"
    assert config.enable_admin is True


def test_flags_win_over_env() -> None:
    env = {
        "MOE_SIDECAR_LISTEN": "127.0.0.1:1",
        "MOE_SIDECAR_ROUND_TIMEOUT": "30",
        "MOE_SIDECAR_ENABLE_ADMIN": "true",
    }
    config = parse(["--listen", "127.0.0.1:2", "--round-timeout", "3", "--no-enable-admin"], env)
    assert config.listen == ("127.0.0.1:2",)
    assert config.round_timeout == 3.0
    assert config.enable_admin is False


def test_auto_port_asks_the_os_for_one() -> None:
    config = parse(["--health-port", "auto"], {"MOE_SIDECAR_METRICS_PORT": "AUTO"})
    assert config.health_port == 0 and config.metrics_port == 0  # the config's "OS picks"


def test_unknown_env_key_is_named() -> None:
    with pytest.raises(ConfigError, match="MOE_SIDECAR_ROUND_TIMOUT='5'"):
        parse([], {"MOE_SIDECAR_ROUND_TIMOUT": "5"})


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("MOE_SIDECAR_STATEDIR", "MOE_SIDECAR_STATE_DIR"),
        ("MOE_SIDECAR_ROUND_TIMOUT", "MOE_SIDECAR_ROUND_TIMEOUT"),
        ("MOE_SIDECAR_TARGT", "MOE_SIDECAR_TARGET"),  # a client key is a candidate too
    ],
)
def test_an_unknown_env_key_gets_one_short_line_with_the_key_meant(key: str, meant: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_environment({key: "x"})
    message = str(info.value)
    assert message == f"unknown environment variable {key}='x'; did you mean {meant}?"


def test_an_unknown_env_key_like_no_other_says_how_keys_are_spelled() -> None:
    with pytest.raises(ConfigError) as info:
        check_environment(
            {"MOE_SIDECAR_ZZZ": "1", "MOE_SIDECAR_YYY": "2", "MOE_SIDECAR_TARGET": ""}
        )
    message = str(info.value)
    assert message.startswith("unknown environment variable MOE_SIDECAR_YYY='2'; each serve flag")
    assert "did you mean" not in message and message.endswith("(also unknown: MOE_SIDECAR_ZZZ)")
    assert len(message) < 200


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--state-dir", ""], {}, "--state-dir '': must name a path"),
        (["--state-dir", " "], {}, "--state-dir ' ': must name a path"),
        ([], {"MOE_SIDECAR_STATE_DIR": ""}, "MOE_SIDECAR_STATE_DIR='': must name a path"),
        (["--tls-cert", ""], {}, "--tls-cert '': must name a path"),
        ([], {"MOE_SIDECAR_STORE_KEY_FILE": ""}, "MOE_SIDECAR_STORE_KEY_FILE='': must name"),
    ],
)
def test_an_empty_path_is_refused_not_read_as_the_working_directory(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse(argv, env)
    assert str(info.value).startswith(message)
    assert "working directory" in str(info.value)


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--round-timeout", "0"], {}, "--round-timeout 0.0: must be in (0, 86400]"),
        (["--round-timeout", "nan"], {}, "--round-timeout nan"),
        (["--round-timeout", "soon"], {}, "--round-timeout 'soon': must be a number of seconds"),
        ([], {"MOE_SIDECAR_ROUND_TIMEOUT": "0"}, "MOE_SIDECAR_ROUND_TIMEOUT=0.0: must be"),
        (["--grace-period", "-1"], {}, "--grace-period -1.0"),
        (["--health-port", "70000"], {}, "--health-port '70000'"),
        (["--health-port", "abc"], {}, "--health-port 'abc': must be a port number"),
        (["--max-groups", "lots"], {}, "--max-groups 'lots': must be a whole number"),
        (["--max-groups", "0"], {}, "--max-groups 0: must be an integer in [1,"),
        (["--health-host", ""], {}, "--health-host '': must be an address to bind"),
        ([], {"MOE_SIDECAR_METRICS_HOST": "a b"}, "MOE_SIDECAR_METRICS_HOST='a b': must be"),
        ([], {"MOE_SIDECAR_METRICS_PORT": "http"}, "MOE_SIDECAR_METRICS_PORT='http'"),
        ([], {"MOE_SIDECAR_ENABLE_ADMIN": "maybe"}, "MOE_SIDECAR_ENABLE_ADMIN='maybe'"),
        ([], {"MOE_SIDECAR_LOG_FORMAT": "xml"}, "MOE_SIDECAR_LOG_FORMAT='xml'"),
        ([], {"MOE_SIDECAR_LISTEN": "127.0.0.1:1,,"}, "empty address"),
        (["--log-level", "loud"], {}, "--log-level 'LOUD'"),
        (["--listen", "localhost"], {}, "--listen='localhost'"),
        (["--listen", "unix://rel.sock"], {}, "--listen='unix://rel.sock': 'unix://' takes an"),
        ([], {"MOE_SIDECAR_LISTEN": "unix://rel.sock"}, "MOE_SIDECAR_LISTEN='unix://rel.sock'"),
        (["--listen", "127.0.0.1:99999"], {}, "port 99999"),
        (["--listen", "127.0.0.1:x"], {}, "port 'x'"),
        (["--listen", "unix://"], {}, "needs a path"),
        (["--listen", "unix:///" + "p" * 120], {}, "at most 107"),
        (["--listen", "127.0.0.1:5", "--listen", "127.0.0.1:5"], {}, "given twice"),
    ],
)
def test_bad_values_are_named(argv: list[str], env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(argv, env)
    assert needle in str(info.value)


def test_construction_validates() -> None:
    with pytest.raises(ConfigError, match=r"listen=\(\)"):
        SidecarConfig(listen=())
    with pytest.raises(ConfigError, match="health_port=-1"):
        SidecarConfig(health_port=-1)
    with pytest.raises(ConfigError, match="log_format='yaml'"):
        SidecarConfig(log_format="yaml")
    # Programmatic port 0 means "any free port" (tests use it).
    assert SidecarConfig(health_port=0, metrics_port=0).health_port == 0
    # Two ephemeral TCP ports are distinct listeners.
    assert len(SidecarConfig(listen=("127.0.0.1:0", "127.0.0.1:0")).listen_addresses) == 2


def test_log_format_flag_choices() -> None:
    with pytest.raises(SystemExit):
        parse(["--log-format", "xml"])


@pytest.mark.parametrize(
    "listen",
    [("0.0.0.0:50051",), ("10.1.2.3:50051",), ("[::]:50051",), ("node-7.cluster:50051",)],
)
def test_tcp_beyond_loopback_needs_tls_or_insecure(listen: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError, match="TCP beyond loopback needs TLS"):
        SidecarConfig(listen=listen)
    assert SidecarConfig(listen=listen, insecure=True).listen == listen


@pytest.mark.parametrize(
    "listen", [("127.0.0.1:50051",), ("[::1]:50051",), ("localhost:1",), ("unix:///tmp/x.sock",)]
)
def test_loopback_and_sockets_need_no_tls(listen: tuple[str, ...]) -> None:
    assert SidecarConfig(listen=listen).listen == listen


def test_tls_files(tmp_path: Path) -> None:
    cert, key, ca = (tmp_path / name for name in ("c.pem", "k.pem", "ca.pem"))
    for path in (cert, key, ca):
        path.write_text("x")
    config = SidecarConfig(listen=("0.0.0.0:50051",), tls_cert=cert, tls_key=key, tls_client_ca=ca)
    assert config.tls
    with pytest.raises(ConfigError, match="give both or neither"):
        SidecarConfig(tls_cert=cert)
    with pytest.raises(ConfigError, match="client certificates need"):
        SidecarConfig(tls_client_ca=ca)
    with pytest.raises(ConfigError, match=r"tls_key='.*missing\.pem': no such file"):
        SidecarConfig(tls_cert=cert, tls_key=tmp_path / "missing.pem")


@pytest.mark.parametrize("field", ["max_groups", "max_watchers", "max_page_size"])
@pytest.mark.parametrize("value", [0, -1, 1 << 21])
def test_limits_have_ranges(field: str, value: int) -> None:
    with pytest.raises(ConfigError, match=f"{field}={value}"):
        SidecarConfig(**{field: value})  # type: ignore[arg-type]


# --- the store and the node name -------------------------------------------------------


def test_the_default_store_is_the_sqlite_database_in_the_state_dir() -> None:
    config = parse(["--state-dir", "/srv/state"])
    assert config.store_target == SqliteStore(Path("/srv/state"))
    assert config.node_name == ""


def test_a_sqlite_store_url_names_the_state_dir() -> None:
    config = parse(["--store", "sqlite:///srv/plans"])
    assert config.state_dir == Path("/srv/plans")
    assert config.store_target == SqliteStore(Path("/srv/plans"))
    # The same directory twice is fine; two different ones are not.
    assert parse(["--store", "sqlite:///a", "--state-dir", "/a"]).state_dir == Path("/a")
    with pytest.raises(ConfigError, match="name two directories"):
        parse(["--store", "sqlite:///a", "--state-dir", "/b"])


def test_an_etcd_store_from_the_environment() -> None:
    env = {
        "MOE_SIDECAR_STORE": "etcds://e0:2379,e1/moe?cacert=/ca.pem&user=moe&password-file=/pw",
        "MOE_SIDECAR_NODE_NAME": "gpu-node-7",
        "MOE_SIDECAR_STATE_DIR": "/srv/state",
    }
    config = parse([], env)
    target = config.store_target
    assert isinstance(target, EtcdTarget)
    assert target.endpoints == ("e0:2379", "e1:2379") and target.prefix == "/moe/"
    assert target.tls and target.user == "moe" and target.ca_file == Path("/ca.pem")
    # With etcd, the node's SQLite stays where --state-dir says: the write-ahead record.
    assert config.state_dir == Path("/srv/state")
    assert config.node_name == "gpu-node-7"
    # The flag wins over the environment, as for every option.
    assert parse(["--node-name", "other"], env).node_name == "other"


@pytest.mark.parametrize(
    ("store", "needle"),
    [
        ("sqlite://relative", "sqlite:///ABSOLUTE/DIR"),
        ("sqlite:/x", "sqlite:///ABSOLUTE/DIR"),
        ("redis://h", "expected sqlite:///DIR"),
        ("etcd://h:0/p", "outside 1..65535"),
        ("etcd://user:pw@h/p", "credentials"),
        ("etcd://h/p?cacert=/ca", "needs TLS"),
    ],
)
def test_bad_store_urls_are_named(store: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(["--store", store])
    assert str(info.value).startswith("--store"), info.value
    assert needle in str(info.value)
    with pytest.raises(ConfigError) as info:
        parse([], {"MOE_SIDECAR_STORE": store})
    assert str(info.value).startswith("MOE_SIDECAR_STORE"), info.value


@pytest.mark.parametrize("name", [" padded", "tab\there", "n" * 254])
def test_bad_node_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="--node-name"):
        parse(["--node-name", name])


@pytest.mark.parametrize(
    ("text", "value"),
    [("1", True), ("true", True), ("Yes", True), (" on ", True), ("0", False), ("OFF", False)],
)
def test_every_boolean_variable_takes_the_one_rule(text: str, value: bool) -> None:
    config = parse([], {"MOE_SIDECAR_ENABLE_ADMIN": text, "MOE_SIDECAR_INSECURE": text})
    assert config.enable_admin is value and config.insecure is value


def test_health_and_metrics_bind_loopback_unless_told() -> None:
    assert parse([]).health_host == "127.0.0.1"
    assert parse([]).metrics_host == "127.0.0.1"
    config = parse(["--health-host", "0.0.0.0"], {"MOE_SIDECAR_METRICS_HOST": "::"})
    assert (config.health_host, config.metrics_host) == ("0.0.0.0", "::")
