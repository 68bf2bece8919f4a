"""The listener bounds of the config, and how error messages quote names."""

from __future__ import annotations

import math

import pytest

from moe_sidecar.config import ConfigError, SidecarConfig
from moe_sidecar.servicer import QUOTED_NAME_CHARACTERS, quote_name

pytestmark = pytest.mark.timeout(30)


def test_listener_bounds_have_defaults() -> None:
    config = SidecarConfig()
    assert (config.max_listener_connections, config.max_health_connections) == (256, 64)
    assert config.max_queued_rpcs == 16384
    assert (config.idle_connection_timeout, config.metrics_request_timeout) == (60.0, 5.0)


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
    ],
)
def test_a_bad_listener_bound_is_refused_naming_it(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}={value!r}: must be"):
        SidecarConfig(**{field: value})  # type: ignore[arg-type]


def test_a_short_name_is_quoted_whole() -> None:
    name = "n" * QUOTED_NAME_CHARACTERS
    assert quote_name(name) == repr(name)


def test_a_long_name_is_cut_with_an_ellipsis_and_its_length() -> None:
    quoted = quote_name("x" * 100_000)
    assert quoted == repr("x" * QUOTED_NAME_CHARACTERS) + "\u2026 (100000 characters)"
