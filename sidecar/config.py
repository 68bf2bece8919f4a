"""The sidecar's configuration: one frozen dataclass, built from flags and env.

Every ``serve`` flag ``--some-flag`` can also come from the environment as
``MOE_SIDECAR_SOME_FLAG``; a flag given on the command line wins over the
environment. An unknown ``MOE_SIDECAR_*`` key is an error naming it (a typo
must not silently run with a default), except the keys of the client library
(:data:`CLIENT_ENV_KEYS`, e.g. ``MOE_SIDECAR_TARGET``).

The pieces live by job in three modules, whose public names are re-exported
here: :mod:`moe_sidecar.config_values` (the error, defaults, bounds, address
and store parsing; its bounds are for the sidecar's own modules), :mod:`moe_sidecar.config_model` (:class:`SidecarConfig` and
its validation) and :mod:`moe_sidecar.config_flags` (the option table, the
flags and the environment).
"""

from __future__ import annotations

from moe_sidecar.config_flags import add_serve_arguments, config_from_flags
from moe_sidecar.config_model import SidecarConfig
from moe_sidecar.config_values import (
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
    "config_from_flags",
    "parse_listen_address",
    "parse_store_url",
]
