"""moe-sidecar client: the library inside each inference rank.

``WorkspaceManager`` sizes, builds, grows and frees one EP group's FlashInfer
MoE all-to-all workspace, deciding through the node's sidecar
(``MOE_SIDECAR_TARGET``) or, without one, through the same decision core
in-process. It takes the ``initialize()`` arguments of every generation of
vLLM's ``FlashInferNVLinkOneSidedManager`` (``vllm_sizing``), and
``vllm_plugin`` puts it in vLLM's place (the ``[vllm]`` extra's
``vllm.general_plugins`` entry point). ``sizing`` is FlashInfer's workspace
arithmetic in pure Python.
"""

from moe_sidecar.client import sizing
from moe_sidecar.client.errors import (
    AdminDisabled,
    AgreementError,
    BackendError,
    CoordinatorError,
    CoordinatorUnavailable,
    GroupNotFound,
    InternalError,
    InvalidArgument,
    PreconditionFailed,
    RankLost,
    ResourceExhausted,
    RoundAborted,
    RoundTimedOut,
)
from moe_sidecar.client.manager import ManagerCounters, WorkspaceManager
from moe_sidecar.defaults import EMBEDDED, ENV_TARGET

__all__ = [
    "EMBEDDED",
    "ENV_TARGET",
    "AdminDisabled",
    "AgreementError",
    "BackendError",
    "CoordinatorError",
    "CoordinatorUnavailable",
    "GroupNotFound",
    "InternalError",
    "InvalidArgument",
    "ManagerCounters",
    "PreconditionFailed",
    "RankLost",
    "ResourceExhausted",
    "RoundAborted",
    "RoundTimedOut",
    "WorkspaceManager",
    "sizing",
]
