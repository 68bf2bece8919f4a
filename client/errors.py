"""The errors a rank sees, and the one place gRPC status codes become them.

A caller catches the same classes in sidecar mode and in embedded mode: the
typed errors of :mod:`moe_sidecar.core.errors`, re-exported here, plus those only
the client raises (:class:`AgreementError`, :class:`BackendError`,
:class:`ViewFailed`).

:func:`error_from_rpc` is the only code that turns a ``grpc.RpcError`` into a
typed error; the gRPC error stays reachable as ``__cause__`` (the transport
raises ``... from rpc_error``), and :func:`rpc_status` reads its status code
and details back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import grpc

from moe_sidecar.core.defaults import DEFAULT_TARGET, ENV_TARGET
from moe_sidecar.core.errors import (
    AdminDisabled,
    CoordinatorError,
    CoordinatorUnavailable,
    ErrorCode,
    GroupNotFound,
    InternalError,
    InvalidArgument,
    PermissionDenied,
    PreconditionFailed,
    ResourceExhausted,
    RoundAborted,
    RoundTimedOut,
    error_for_code,
)

__all__ = [
    "AdminDisabled",
    "AgreementError",
    "BackendError",
    "CoordinatorError",
    "CoordinatorUnavailable",
    "ErrorCode",
    "GroupNotFound",
    "InternalError",
    "InvalidArgument",
    "PermissionDenied",
    "PreconditionFailed",
    "RankFailure",
    "RankLost",
    "ResourceExhausted",
    "RoundAborted",
    "RoundTimedOut",
    "RpcStatus",
    "SessionStatus",
    "SidecarNotAnswering",
    "ViewFailed",
    "error_from_rpc",
    "not_a_coordinator",
    "rpc_status",
]


@dataclass(frozen=True)
class RankFailure:
    """What one rank of the EP group reported in a failed agreement."""

    ep_rank: int
    layer: str
    detail: str
    """The rank's own error message, or its layer shape when shapes disagree."""


class AgreementError(PreconditionFailed):
    """Ranks of one EP group disagree on the layer shape.

    Found by the cross-rank all-gather (``top_k`` or ``num_experts`` differs
    between ranks in one round). A :class:`PreconditionFailed`, as the same
    disagreement found by one sidecar is, so one ``except`` serves both.
    ``failures`` holds every rank's shape, so the message names who differs.
    """

    def __init__(self, message: str, failures: tuple[RankFailure, ...] = ()) -> None:
        super().__init__(message)
        self.failures = failures


class RankLost(RoundAborted):
    """A rank of the EP group died while the others waited in a collective
    (the agreement or the post-build barrier).

    gloo only says that a connection closed; the sidecar knows which rank's
    session ended, so the message names it and its last layer when it can
    (in embedded mode nobody knows, and the message says so).
    ``ranks`` holds the ranks known to be gone.
    """

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


class ViewFailed(PreconditionFailed):
    """The membership view a rank was adopting FAILED: its members quiesced at
    different all-to-all round counts, or not all acknowledged it before its
    deadline. FAILED is final for the group's lifetime: every rank restarts.

    ``view`` is the view's number, ``cause`` the sidecar's words of why.
    """

    def __init__(self, message: str, view: int, cause: str) -> None:
        super().__init__(message)
        self.view = view
        self.cause = cause

    @classmethod
    def of(cls, group: str, view: int, cause: str) -> ViewFailed:
        """The error of view ``view`` of ``group`` failed for ``cause``."""
        return cls(
            f"EP group {group!r}: membership view {view} failed ({cause}): the group must "
            "restart (every rank)",
            view,
            cause,
        )


class SidecarNotAnswering(CoordinatorUnavailable):
    """The sidecar did not answer a call within the client's wait: it is
    stalled (stopped, throttled, in a long pause) or restarting. Not a round
    timeout (the sidecar names those itself) and not a death: the rank's
    session stays open, and no peer is told anything. Not retried again: the
    wait was the retry budget (``MOE_SIDECAR_STALL_BUDGET`` for calls that
    wait for no other rank, the propose deadline for a round).
    """


_VIEW_FAILED = re.compile(r"^view (\d+) failed \((.*)\): the group must restart$", re.DOTALL)
"""The core's refusal of an acknowledgement of a view that failed
(:func:`moe_sidecar.core.membership.acknowledge`)."""


class BackendError(RuntimeError):
    """An all-to-all backend cannot do what was asked.

    FlashInfer missing, a communicator split it cannot serve, a handle used
    after release. FlashInfer's own errors (and the reference backend's copies
    of them, e.g. ``workspace insufficient for combine payload region``) stay
    the ``RuntimeError`` FlashInfer raises.
    """


# Codes the sidecar sends on purpose, one per typed error (moe_sidecar.status is
# the other direction). Everything else comes from the transport itself.
_CODE_BY_STATUS: dict[grpc.StatusCode, ErrorCode] = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND: ErrorCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION: ErrorCode.FAILED_PRECONDITION,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED: ErrorCode.ABORTED,
    grpc.StatusCode.UNAVAILABLE: ErrorCode.UNAVAILABLE,
    grpc.StatusCode.PERMISSION_DENIED: ErrorCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INTERNAL: ErrorCode.INTERNAL,
    # The server cancels calls in flight when it stops: the sidecar went away.
    grpc.StatusCode.CANCELLED: ErrorCode.UNAVAILABLE,
}

# What grpc itself writes as details when the client's own deadline fires.
_LOCAL_DEADLINE_DETAILS = "Deadline Exceeded"


@dataclass(frozen=True)
class RpcStatus:
    """The gRPC status behind a typed error raised in sidecar mode."""

    code: grpc.StatusCode
    details: str


def _status_of(error: grpc.RpcError) -> RpcStatus:
    # Errors from a call (grpc.Call) carry code()/details(); a bare RpcError
    # (raised by some channel failures) has neither.
    code_fn = getattr(error, "code", None)
    details_fn = getattr(error, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    return RpcStatus(
        code=code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN,
        details=details if isinstance(details, str) else str(error),
    )


class SessionStatus(Exception):
    """The status a session message was answered with (a typed error's cause
    in session mode, as the ``grpc.RpcError`` is for a unary call)."""

    def __init__(self, status: RpcStatus) -> None:
        super().__init__(f"{status.code.name}: {status.details}")
        self.status = status

    @classmethod
    def named(cls, code_name: str, details: str) -> SessionStatus:
        """The status of a session's error reply (an unknown code name is UNKNOWN)."""
        code = grpc.StatusCode.__members__.get(code_name, grpc.StatusCode.UNKNOWN)
        return cls(RpcStatus(code=code, details=details))


def error_from_rpc(
    error: grpc.RpcError | SessionStatus,
    *,
    method: str,
    target: str,
    timeout: float | None = None,
) -> CoordinatorError:
    """The typed error for a failed RPC or session message; raise it ``from error``.

    The sidecar's own messages (a refused round, a timed-out round naming the
    missing ranks) pass through unchanged, so they read the same as in
    embedded mode. Failures of the transport itself (sidecar unreachable, the
    client's deadline, an unexpected status) get the method and target added.

    Args:
        error: what the gRPC call raised, or the status of a session's error reply.
        method: the RPC's name, e.g. ``"Propose"``.
        target: the sidecar address the channel was opened to.
        timeout: the deadline the call ran under, for the message.
    """
    status = error.status if isinstance(error, SessionStatus) else _status_of(error)
    code = _CODE_BY_STATUS.get(status.code, ErrorCode.INTERNAL)
    where = f"{method} to sidecar {target}"
    if status.code is grpc.StatusCode.DEADLINE_EXCEEDED and (
        status.details == _LOCAL_DEADLINE_DETAILS
    ):
        waited = f" for {timeout:g} s" if timeout is not None else ""
        return SidecarNotAnswering(
            f"the sidecar at {target} did not answer {method}{waited} (stalled or "
            "restarting; no rank is ended for it, and the rank's session stays open)"
        )
    elif status.code is grpc.StatusCode.UNIMPLEMENTED:
        message = f"{where}: {not_a_coordinator(target, status.details)}"
    elif status.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        message = f"{where}: {status.code.name}: {status.details}"
    elif status.code not in _CODE_BY_STATUS:
        message = f"{where} failed with unexpected status {status.code.name}: {status.details}"
    else:
        message = status.details
        failed = _VIEW_FAILED.match(message) if code is ErrorCode.FAILED_PRECONDITION else None
        if failed is not None:
            return ViewFailed(message, int(failed.group(1)), failed.group(2))
    return error_for_code(code, message)


def not_a_coordinator(target: str, details: str) -> str:
    """What an UNIMPLEMENTED answer of a coordinator method means: ``target``
    serves gRPC but not the coordinator, most likely the sidecar's health
    port (which serves only health checks and reflection)."""
    return (
        f"UNIMPLEMENTED ({details}): {target} is the sidecar's health port "
        f"(--health-port, 50052 by default) or another gRPC server, not the coordinator; "
        f"set {ENV_TARGET} to an address the sidecar's --listen serves (default {DEFAULT_TARGET})"
    )


def rpc_status(error: BaseException) -> RpcStatus | None:
    """The gRPC status behind ``error`` (its ``__cause__``), or None.

    None for errors raised in embedded mode, which never touch gRPC.
    """
    cause = error.__cause__
    if isinstance(cause, grpc.RpcError):
        return _status_of(cause)
    if isinstance(cause, SessionStatus):
        return cause.status
    return None
