"""moe-sidecar: the per-node daemon that decides MoE all-to-all workspace plans.

Imports neither torch nor flashinfer. The pure decision core is
:mod:`moe_sidecar.policy`; errors shared with the client are in
:mod:`moe_sidecar.errors`.
"""

from moe_sidecar.errors import (
    AdminDisabled,
    CoordinatorError,
    CoordinatorUnavailable,
    ErrorCode,
    GroupNotFound,
    InternalError,
    InvalidArgument,
    PreconditionFailed,
    RoundAborted,
    RoundTimedOut,
)
from moe_sidecar.policy import Action, Decision, Plan, Requirement

__all__ = [
    "Action",
    "AdminDisabled",
    "CoordinatorError",
    "CoordinatorUnavailable",
    "Decision",
    "ErrorCode",
    "GroupNotFound",
    "InternalError",
    "InvalidArgument",
    "Plan",
    "PreconditionFailed",
    "Requirement",
    "RoundAborted",
    "RoundTimedOut",
]
