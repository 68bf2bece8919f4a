"""Typed errors of the coordinator, shared by the sidecar and the client.

Each error carries an :class:`ErrorCode`. The sidecar maps codes to gRPC
status codes in exactly one place (``moe_sidecar.status``); the client maps them
back in exactly one place (``moe_sidecar.client.errors``), so a caller catches the same
exception types in sidecar mode and in embedded mode. This module imports
neither grpc nor torch.
"""

from __future__ import annotations

import enum
from typing import ClassVar, Final

__all__ = [
    "QUOTED_NAME_CHARACTERS",
    "AdminDisabled",
    "CoordinatorError",
    "CoordinatorUnavailable",
    "ErrorCode",
    "GroupNotFound",
    "InternalError",
    "InvalidArgument",
    "PermissionDenied",
    "PreconditionFailed",
    "ResourceExhausted",
    "RoundAborted",
    "RoundTimedOut",
    "UndecodableRequest",
    "error_for_code",
    "quote_name",
]

QUOTED_NAME_CHARACTERS: Final = 64
"""How much of a name an error message quotes; a longer name is cut (an
ellipsis and its length follow), so no message echoes a long group or
layer name whole."""


def quote_name(name: str, limit: int = QUOTED_NAME_CHARACTERS) -> str:
    """``name`` quoted for an error message: whole (as ``repr``) up to
    ``limit`` characters, else its first ``limit`` followed by an ellipsis
    and its length. Every message of the core, the servicer and the client
    quotes group and layer names through it."""
    if len(name) <= limit:
        return repr(name)
    return f"{name[:limit]!r}… ({len(name)} characters)"


class ErrorCode(enum.Enum):
    """What kind of failure an error is; one gRPC status code each."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    ABORTED = "ABORTED"
    UNAVAILABLE = "UNAVAILABLE"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    INTERNAL = "INTERNAL"


class CoordinatorError(Exception):
    """Base of every error the coordinator reports.

    ``message`` is the complete human-readable text; it names the fields,
    values, ranks and layers involved.
    """

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(CoordinatorError):
    """A request field is malformed or out of range."""

    code = ErrorCode.INVALID_ARGUMENT

    def __init__(self, message: str, *, field: str = "", value: object = None) -> None:
        super().__init__(message)
        self.field = field
        self.value = value

    @classmethod
    def of(cls, field: str, value: object, reason: str) -> InvalidArgument:
        """The error for ``field`` holding ``value``, with a message naming both."""
        return cls(f"{field}={value!r}: {reason}", field=field, value=value)

    @classmethod
    def of_name(cls, field: str, name: str, reason: str) -> InvalidArgument:
        """The error for ``field`` holding the name or label ``name``, quoted
        by :func:`quote_name`."""
        return cls(f"{field}={quote_name(name)}: {reason}", field=field, value=name)


class UndecodableRequest(InvalidArgument):
    """A request's bytes are not the method's message (INVALID_ARGUMENT, and
    counted and logged apart: it is a broken or hostile peer, not a rank)."""


class GroupNotFound(CoordinatorError):
    """The request names a group the sidecar does not know."""

    code = ErrorCode.NOT_FOUND

    @classmethod
    def named(cls, group: str) -> GroupNotFound:
        """The error for an unknown ``group``."""
        return cls(f"group={quote_name(group)}: no such group on this sidecar")


class PreconditionFailed(CoordinatorError):
    """The request is well formed but contradicts the group's state.

    Heterogeneous ``top_k``/``num_experts`` across layers, ranks disagreeing
    inside one round, a layout that differs from the group's, a round out of
    sequence.
    """

    code = ErrorCode.FAILED_PRECONDITION


class RoundTimedOut(CoordinatorError):
    """A round missed at least one local rank past its deadline."""

    code = ErrorCode.DEADLINE_EXCEEDED


class RoundAborted(CoordinatorError):
    """A round was abandoned: a rank of the group restarted mid-round."""

    code = ErrorCode.ABORTED


class CoordinatorUnavailable(CoordinatorError):
    """The sidecar is shutting down or cannot be reached; retry elsewhere/later."""

    code = ErrorCode.UNAVAILABLE


class PermissionDenied(CoordinatorError):
    """The caller may not do what it asked: a proposal or commit whose group
    proof does not match the group's ranks', or an admin call without
    ``--enable-admin`` (every PERMISSION_DENIED status becomes one)."""

    code = ErrorCode.PERMISSION_DENIED


class AdminDisabled(PermissionDenied):
    """An admin call reached a sidecar started without ``--enable-admin``."""


class ResourceExhausted(CoordinatorError):
    """A bounded resource is full (groups, watch streams); the message names the limit."""

    code = ErrorCode.RESOURCE_EXHAUSTED


class InternalError(CoordinatorError):
    """A bug or an unexpected failure inside the coordinator."""

    code = ErrorCode.INTERNAL


_BY_CODE: dict[ErrorCode, type[CoordinatorError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        GroupNotFound,
        PreconditionFailed,
        RoundTimedOut,
        RoundAborted,
        CoordinatorUnavailable,
        PermissionDenied,
        ResourceExhausted,
        InternalError,
    )
}


def error_for_code(code: ErrorCode, message: str) -> CoordinatorError:
    """Rebuilds the typed error for ``code`` from its message.

    Used where only the code and the text survive (a gRPC status, a stored
    round outcome): the result is an instance of the class that raised it.
    """
    return _BY_CODE[code](message)
