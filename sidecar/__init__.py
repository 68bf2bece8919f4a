"""moe-sidecar: the per-node daemon that decides MoE all-to-all workspace plans.

Imports neither torch nor flashinfer. Plans and their one join are in
:mod:`moe_sidecar.core.plan`, the pure decision core in :mod:`moe_sidecar.core.policy`;
errors shared with the client are in :mod:`moe_sidecar.core.errors`. The library
inside each inference rank is :mod:`moe_sidecar.client` (it needs torch).
"""

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
)
from moe_sidecar.core.group import Decision, Requirement
from moe_sidecar.core.plan import Action, Capacities, Plan

__all__ = [
    "Action",
    "AdminDisabled",
    "Capacities",
    "CoordinatorError",
    "CoordinatorUnavailable",
    "Decision",
    "ErrorCode",
    "GroupNotFound",
    "InternalError",
    "InvalidArgument",
    "PermissionDenied",
    "Plan",
    "PreconditionFailed",
    "Requirement",
    "ResourceExhausted",
    "RoundAborted",
    "RoundTimedOut",
]
