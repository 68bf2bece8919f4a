"""Names and defaults both sides use, defined once.

The sidecar, the client library, the command line, the container image and
the Kubernetes example all read these; nothing else spells them.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "CLIENT_ENV_KEYS",
    "DEFAULT_TARGET",
    "EMBEDDED",
    "ENV_LOCAL_RANKS",
    "ENV_PREFIX",
    "ENV_PROPOSE_TIMEOUT",
    "ENV_TARGET",
]

ENV_PREFIX: Final = "MOE_SIDECAR_"
"""Every environment variable of the project starts with it."""
ENV_TARGET: Final = "MOE_SIDECAR_TARGET"
"""Address of the node's sidecar for the ranks (and ``moe-sidecar groups``);
unset or empty means embedded mode."""
ENV_LOCAL_RANKS: Final = "MOE_SIDECAR_LOCAL_RANKS"
"""How many ranks of the EP group run on this node, when not passed in."""
ENV_PROPOSE_TIMEOUT: Final = "MOE_SIDECAR_PROPOSE_TIMEOUT"
"""Seconds a Propose may wait for its round; overrides the client's default."""
EMBEDDED: Final = "embedded"
"""A target that forces embedded mode whatever the environment says."""
DEFAULT_TARGET: Final = "127.0.0.1:50051"
"""Where ``moe-sidecar serve`` listens by default, and where ``groups`` looks."""

CLIENT_ENV_KEYS: Final = frozenset({ENV_TARGET, ENV_LOCAL_RANKS, ENV_PROPOSE_TIMEOUT})
"""Keys with the project's prefix that the client library reads; the sidecar
ignores them, so one environment can serve both."""
