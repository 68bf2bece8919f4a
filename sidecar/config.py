"""The sidecar's configuration: one frozen dataclass, built from flags and env.

Every ``serve`` flag ``--some-flag`` can also come from the environment as
``MOE_SIDECAR_SOME_FLAG``; a flag given on the command line wins over the
environment. An unknown ``MOE_SIDECAR_*`` key is an error naming it (a typo
must not silently run with a default), except the keys of the client library
(:data:`CLIENT_ENV_KEYS`, e.g. ``MOE_SIDECAR_TARGET``).

The pieces live by job in three modules, all re-exported here:
:mod:`moe_sidecar.config_values` (the error, defaults, bounds, address and
store parsing), :mod:`moe_sidecar.config_model` (:class:`SidecarConfig` and
its validation) and :mod:`moe_sidecar.config_flags` (the option table, the
flags and the environment).
"""

from __future__ import annotations

from moe_sidecar.config_flags import add_serve_arguments, config_from_flags
from moe_sidecar.config_model import SidecarConfig
from moe_sidecar.config_values import (
    DEFAULT_HEALTH_HOST,
    DEFAULT_LISTEN,
    DEFAULT_MAX_MERGED_GROUPS,
    DEFAULT_METRICS_HOST,
    DEFAULT_STATE_DIR,
    DEFAULT_STORE_MAX_DOCUMENT_BYTES,
    DEFAULT_STORE_MAX_EPOCH_LEAD,
    DEFAULT_STORE_MAX_GENERATION_LEAD,
    DEFAULT_STORE_PAGE_BYTES,
    LIMIT_FIELDS,
    LISTENER_TIMEOUT_FIELDS,
    LOG_FORMATS,
    LOG_LEVELS,
    MAX_LIMIT,
    MAX_NODE_NAME_LENGTH,
    MAX_SECONDS,
    MAX_STORE_PAGE_BYTES,
    MIN_STORE_DOCUMENT_BYTES,
    ConfigError,
    SqliteStore,
    StoreTarget,
    parse_listen_address,
    parse_store_url,
)

__all__ = [
    "DEFAULT_HEALTH_HOST",
    "DEFAULT_LISTEN",
    "DEFAULT_MAX_MERGED_GROUPS",
    "DEFAULT_METRICS_HOST",
    "DEFAULT_STATE_DIR",
    "DEFAULT_STORE_MAX_DOCUMENT_BYTES",
    "DEFAULT_STORE_MAX_EPOCH_LEAD",
    "DEFAULT_STORE_MAX_GENERATION_LEAD",
    "DEFAULT_STORE_PAGE_BYTES",
    "LIMIT_FIELDS",
    "LISTENER_TIMEOUT_FIELDS",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "MAX_LIMIT",
    "MAX_NODE_NAME_LENGTH",
    "MAX_SECONDS",
    "MAX_STORE_PAGE_BYTES",
    "MIN_STORE_DOCUMENT_BYTES",
    "ConfigError",
    "SidecarConfig",
    "SqliteStore",
    "StoreTarget",
    "add_serve_arguments",
    "config_from_flags",
    "parse_listen_address",
    "parse_store_url",
]
