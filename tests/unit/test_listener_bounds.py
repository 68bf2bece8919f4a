"""The listener bounds of the config."""

from __future__ import annotations

import argparse
import math

import pytest

from moe_sidecar.config import (
    ConfigError,
    SidecarConfig,
    add_serve_arguments,
    config_from_flags,
)

pytestmark = pytest.mark.timeout(30)


def test_listener_bounds_have_defaults() -> None:
    config = SidecarConfig()
    assert (config.max_listener_connections, config.max_health_connections) == (256, 64)
    assert config.max_queued_rpcs == 16384
    assert (config.idle_connection_timeout, config.metrics_request_timeout) == (60.0, 5.0)
    assert config.stream_write_timeout == 10.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_listener_connections", 0),
        ("max_health_connections", -1),
        ("max_queued_rpcs", 1 << 21),
        ("max_listener_connections", True),
        ("idle_connection_timeout", 0.0),
        ("idle_connection_timeout", math.nan),
        ("metrics_request_timeout", -1.0),
        ("metrics_request_timeout", 1e9),
        ("stream_write_timeout", 0.0),
        ("stream_write_timeout", math.inf),
    ],
)
def test_a_bad_listener_bound_is_refused_naming_it(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}={value!r}: must be"):
        SidecarConfig(**{field: value})  # type: ignore[arg-type]


def _from_flags(argv: list[str], environ: dict[str, str]) -> SidecarConfig:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return config_from_flags(parser.parse_args(argv), environ)


def test_the_stream_write_timeout_is_read_from_its_flag_and_variable() -> None:
    assert _from_flags(["--stream-write-timeout", "2.5"], {}).stream_write_timeout == 2.5
    environ = {"MOE_SIDECAR_STREAM_WRITE_TIMEOUT": "0.25"}
    assert _from_flags([], environ).stream_write_timeout == 0.25


def test_a_bad_stream_write_timeout_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"--stream-write-timeout"):
        _from_flags(["--stream-write-timeout", "0"], {})
