"""The listener bounds of the config."""

from __future__ import annotations

import math

import pytest

from moe_sidecar.config import ConfigError, SidecarConfig

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
