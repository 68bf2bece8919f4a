"""The sidecar's configuration: one frozen dataclass, built from flags and env
(every flag also an environment variable, unknown keys refused: see
:mod:`moe_sidecar.config.flags`).

The pieces live by job in three modules, whose public names are re-exported
here: :mod:`moe_sidecar.config.values` (the error, defaults, bounds, address
and store parsing; its bounds are for the sidecar's own modules),
:mod:`moe_sidecar.config.model` (:class:`SidecarConfig` and its validation)
and :mod:`moe_sidecar.config.flags` (the option table, the flags and the
environment).
"""

from __future__ import annotations

from moe_sidecar.config.flags import add_serve_arguments, check_environment, config_from_flags
from moe_sidecar.config.model import SidecarConfig
from moe_sidecar.config.values import (
    DEFAULT_HEALTH_HOST,
    DEFAULT_LISTEN,
    DEFAULT_METRICS_HOST,
    DEFAULT_STATE_DIR,
    LOG_FORMATS,
    ConfigError,
    SqliteStore,
    StoreTarget,
    parse_listen_address,
    parse_store_url,
)

__all__ = [
    "DEFAULT_HEALTH_HOST",
    "DEFAULT_LISTEN",
    "DEFAULT_METRICS_HOST",
    "DEFAULT_STATE_DIR",
    "LOG_FORMATS",
    "ConfigError",
    "SidecarConfig",
    "SqliteStore",
    "StoreTarget",
    "add_serve_arguments",
    "check_environment",
    "config_from_flags",
    "parse_listen_address",
    "parse_store_url",
]
