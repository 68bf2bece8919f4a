"""Names and defaults both sides use, defined once.

The sidecar, the client library, the command line, the container image and
the Kubernetes example all read these; nothing else spells them.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "BOOLEAN_FORMS",
    "CLIENT_ENV_KEYS",
    "DEFAULT_TARGET",
    "EMBEDDED",
    "ENV_BACKEND",
    "ENV_GROUP",
    "ENV_KEY_DIR",
    "ENV_LOCAL_RANKS",
    "ENV_ON_PEER_LOSS",
    "ENV_PREFIX",
    "ENV_PROPOSE_TIMEOUT",
    "ENV_STALL_BUDGET",
    "ENV_TARGET",
    "PEER_LOSS_POLICIES",
    "parse_bool",
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
ENV_STALL_BUDGET: Final = "MOE_SIDECAR_STALL_BUDGET"
"""Seconds a rank's call that waits for no other rank (a commit, an
acknowledgement, a read) waits for a sidecar that does not answer (stalled)
or cannot be reached (restarting) before it raises; default 30."""
ENV_GROUP: Final = "MOE_SIDECAR_GROUP"
"""The EP group's name on the sidecar; overrides the name derived from the
engine's config or from the ranks (see :mod:`moe_sidecar.client.naming`)."""
ENV_BACKEND: Final = "MOE_SIDECAR_BACKEND"
"""The manager's all-to-all backend when none is passed in: ``flashinfer``
(the default) or ``reference`` (CPU, over gloo)."""
ENV_ON_PEER_LOSS: Final = "MOE_SIDECAR_ON_PEER_LOSS"
"""What a rank does when a peer of its EP group dies (sidecar mode):
``exit`` (the default) ends the process within 2 s, ``raise`` raises at its
next call into the manager, ``wait`` does nothing (see
:mod:`moe_sidecar.client.peer_loss`)."""
PEER_LOSS_POLICIES: Final = ("exit", "raise", "wait", "mask")
"""The values of ``MOE_SIDECAR_ON_PEER_LOSS``, the first the default: the
client's ``PeerLossPolicy`` and the tools' flags name them from here, so a
tool's ``--help`` lists them without importing the client's gRPC side."""
ENV_KEY_DIR: Final = "MOE_SIDECAR_KEY_DIR"
"""The directory where rank 0 of each EP group keeps the group's owner key
(default ``$XDG_STATE_HOME/moe-sidecar/keys``, else
``~/.local/state/moe-sidecar/keys``; see :mod:`moe_sidecar.client.owner_key`)."""
EMBEDDED: Final = "embedded"
"""A target that forces embedded mode whatever the environment says."""
DEFAULT_TARGET: Final = "127.0.0.1:50051"
"""Where ``moe-sidecar serve`` listens by default, and where ``groups`` looks."""

CLIENT_ENV_KEYS: Final = frozenset(
    {
        ENV_TARGET,
        ENV_LOCAL_RANKS,
        ENV_PROPOSE_TIMEOUT,
        ENV_STALL_BUDGET,
        ENV_GROUP,
        ENV_BACKEND,
        ENV_ON_PEER_LOSS,
        ENV_KEY_DIR,
    }
)
"""Keys with the project's prefix that the client library's manager reads;
the sidecar ignores them (and the engine rooms' own switches), so one
environment can serve both."""

_TRUE: Final = ("1", "true", "yes", "on")
_FALSE: Final = ("0", "false", "no", "off")
BOOLEAN_FORMS: Final = "1/0, true/false, yes/no or on/off"
"""What every boolean variable of the project accepts (any case)."""


def parse_bool(text: str) -> bool:
    """The one rule for boolean variables (an engine's plugin switch,
    ``MOE_SIDECAR_ENABLE_ADMIN``, ``MOE_SIDECAR_INSECURE``, ...): any of
    :data:`BOOLEAN_FORMS`, in any case, with surrounding space ignored.

    Raises:
        ValueError: ``text`` is none of them (the message lists the forms).
    """
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"expected {BOOLEAN_FORMS}")
