"""What can go wrong talking to etcd: the typed errors, and etcd's statuses mapped to them.

Every error the etcd client and its watches raise is an :class:`EtcdError`;
:func:`mapped_error` is the one place an etcd gRPC status (or a watch's
``cancel_reason``) becomes one of them.
"""

from __future__ import annotations

import re

import grpc

__all__ = [
    "RETRYABLE_STREAM_CODES",
    "EtcdAuthError",
    "EtcdClientClosed",
    "EtcdClusterReset",
    "EtcdCompacted",
    "EtcdError",
    "EtcdEventTooLarge",
    "EtcdPermissionDenied",
    "EtcdRequestError",
    "EtcdStale",
    "EtcdTimeout",
    "EtcdUnavailable",
    "is_invalid_token",
    "is_too_large",
    "mapped_error",
    "status_from_reason",
]


class EtcdError(Exception):
    """Base of every error this module raises about etcd.

    ``message`` is the whole text; it names the call, the endpoint and what
    etcd said.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class EtcdUnavailable(EtcdError):
    """No endpoint answered: etcd is down, unreachable or has no leader.

    Retry later; nothing is known about whether a write took effect.
    """


class EtcdTimeout(EtcdUnavailable):
    """The call's deadline passed before etcd answered (outcome unknown)."""


class EtcdAuthError(EtcdError):
    """Authentication failed: a wrong user or password, credentials that a
    cluster without auth refuses, or none where the cluster requires them."""


class EtcdPermissionDenied(EtcdAuthError):
    """The authenticated user may not read or write the key."""


class EtcdStale(EtcdError):
    """Watching can no longer bring the caller's view up to date.

    The caller must re-read the current state (:meth:`EtcdClient.get_prefix`)
    and watch again from the revision that read returns, plus one.
    """


class EtcdCompacted(EtcdStale):
    """etcd has compacted the revision asked for: its history is gone."""

    def __init__(self, message: str, *, compact_revision: int, requested_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision
        """The oldest revision etcd still has."""
        self.requested_revision = requested_revision


class EtcdClusterReset(EtcdStale):
    """etcd's revision went backwards under a watch: the cluster was re-created
    empty or restored from an older backup, so its revisions mean other writes."""

    def __init__(self, message: str, *, revision: int, expected_revision: int) -> None:
        super().__init__(message)
        self.revision = revision
        """The store's revision now."""
        self.expected_revision = expected_revision
        """The revision the watch was to resume from."""


class EtcdEventTooLarge(EtcdStale):
    """A watch event is larger than one response this client receives (etcd
    was told to take values that large): the watch cannot deliver it, and
    would meet it again on every reconnect."""


class EtcdRequestError(EtcdError):
    """etcd refused the request for another reason (kept in ``code``)."""

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class EtcdClientClosed(EtcdError):
    """The client was used after :meth:`EtcdClient.close`."""


# --- etcd statuses -------------------------------------------------------------------

_INVALID_TOKEN = "invalid auth token"
_AUTH_FAILED_TEXTS = (
    "authentication failed",
    "user name is empty",
    "authentication is not enabled",
    "user name not found",
)
RETRYABLE_STREAM_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
"""Codes on which a broken watch stream is opened again rather than raised."""


def is_too_large(code: grpc.StatusCode | None, text: str) -> bool:
    """Whether this client refused a response over its receive limit."""
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in text


def is_invalid_token(code: grpc.StatusCode | None, text: str) -> bool:
    """Whether etcd refused a token it no longer knows (expired, or etcd restarted)."""
    return code == grpc.StatusCode.UNAUTHENTICATED and _INVALID_TOKEN in text


_REASON = re.compile(r"code = (\w+) desc = (.*)", re.DOTALL)


def status_from_reason(reason: str) -> tuple[grpc.StatusCode | None, str]:
    """The status code and text inside a watch's ``cancel_reason``.

    etcd writes a refused watch's reason as ``rpc error: code = PermissionDenied
    desc = etcdserver: permission denied``.
    """
    match = _REASON.search(reason)
    if match is None:
        return None, reason
    name = re.sub(r"(?<!^)(?=[A-Z])", "_", match.group(1)).upper()
    return getattr(grpc.StatusCode, name, None), match.group(2)


def mapped_error(
    code: grpc.StatusCode | None, text: str, *, what: str, endpoint: str, revision: int = 0
) -> EtcdError:
    """The typed error for etcd's status ``code`` with message ``text``."""
    name = code.name if code is not None else "UNKNOWN"
    message = f"etcd {what} on {endpoint}: {text or name} ({name})"
    if code == grpc.StatusCode.UNAVAILABLE:
        return EtcdUnavailable(message)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return EtcdTimeout(message)
    if code == grpc.StatusCode.PERMISSION_DENIED or "permission denied" in text:
        return EtcdPermissionDenied(message)
    if code == grpc.StatusCode.UNAUTHENTICATED or any(t in text for t in _AUTH_FAILED_TEXTS):
        return EtcdAuthError(message)
    if code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in text:
        return EtcdCompacted(
            f"{message}; re-read the keys and watch from the revision of that read",
            compact_revision=0,
            requested_revision=revision,
        )
    return EtcdRequestError(message, code=code)
