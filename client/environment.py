"""The manager's own environment variables, checked as the manager will read them.

Every engine's plugin calls :func:`check_environment` when it acts, so a
malformed ``MOE_SIDECAR_*`` value stops the engine at start, naming it,
instead of failing at the first MoE layer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from moe_sidecar.client.backends import BACKENDS
from moe_sidecar.client.peer_loss import policy_from_environment
from moe_sidecar.core.defaults import (
    BOOLEAN_FORMS,
    EMBEDDED,
    ENV_BACKEND,
    ENV_GROUP,
    ENV_LOCAL_RANKS,
    ENV_PROPOSE_TIMEOUT,
    ENV_TARGET,
    parse_bool,
)
from moe_sidecar.core.errors import InvalidArgument
from moe_sidecar.core.limits import check_name
from moe_sidecar.wire.address import AddressError, parse_listen_address

__all__ = ["check_environment", "plugin_mode"]


def check_environment(environ: Mapping[str, str]) -> None:
    """Checks the variables the manager reads, as the manager will read them.

    Raises:
        InvalidArgument: the first malformed one, naming it, its value and
            what it takes.
    """
    target = environ.get(ENV_TARGET, "").strip()
    if target and target != EMBEDDED:
        try:
            parse_listen_address(target, ENV_TARGET)
        except AddressError as error:
            raise InvalidArgument(str(error), field=ENV_TARGET, value=target) from None
    local_ranks = environ.get(ENV_LOCAL_RANKS, "").strip()
    if local_ranks and not (local_ranks.isdigit() and int(local_ranks) >= 1):
        raise InvalidArgument.of(
            ENV_LOCAL_RANKS, local_ranks, "must be a whole number of ranks on this node, at least 1"
        )
    timeout = environ.get(ENV_PROPOSE_TIMEOUT, "").strip()
    if timeout:
        try:
            seconds = float(timeout)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0):
            raise InvalidArgument.of(
                ENV_PROPOSE_TIMEOUT, timeout, "must be a positive number of seconds, e.g. 120"
            )
    backend = environ.get(ENV_BACKEND, "").strip()
    if backend and backend not in BACKENDS:
        raise InvalidArgument.of(ENV_BACKEND, backend, f"must be one of {', '.join(BACKENDS)}")
    group = environ.get(ENV_GROUP, "").strip()
    if group:
        check_name(ENV_GROUP, group, allow_empty=False)
    policy_from_environment(environ)


def plugin_mode(environ: Mapping[str, str], switch: str, acts: str) -> str | None:
    """``"sidecar"``, ``"embedded"`` or None (leave the engine alone): an
    engine's plugin acts with a sidecar target, or embedded when its
    ``switch`` variable is true; a false ``switch`` leaves the engine alone
    even with a target. ``acts`` says what true does, for the error.

    Raises:
        InvalidArgument: ``switch`` is set to none of :data:`BOOLEAN_FORMS`.
    """
    text = environ.get(switch, "").strip()
    try:
        flag = parse_bool(text) if text else None
    except ValueError:
        raise InvalidArgument.of(
            switch, text, f"must be {BOOLEAN_FORMS} (true: {acts}; false: never), or unset"
        ) from None
    if flag is False:
        return None
    target = environ.get(ENV_TARGET, "").strip()
    if target and target != EMBEDDED:
        return "sidecar"
    if flag or target == EMBEDDED:
        return "embedded"
    return None
