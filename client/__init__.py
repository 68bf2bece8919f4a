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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from moe_sidecar.core.defaults import EMBEDDED, ENV_TARGET

if TYPE_CHECKING:
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
        PermissionDenied,
        PreconditionFailed,
        RankLost,
        ResourceExhausted,
        RoundAborted,
        RoundTimedOut,
    )
    from moe_sidecar.client.manager import ManagerCounters, WorkspaceManager

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
    "PermissionDenied",
    "PreconditionFailed",
    "RankLost",
    "ResourceExhausted",
    "RoundAborted",
    "RoundTimedOut",
    "WorkspaceManager",
    "sizing",
]

_HOME = {
    "ManagerCounters": "moe_sidecar.client.manager",
    "WorkspaceManager": "moe_sidecar.client.manager",
}
"""Where each lazily loaded name lives; the rest are errors (``moe_sidecar.client.errors``)."""


def __getattr__(name: str) -> Any:
    # Lazy: importing a pure module of the client (sizing, naming, the tools'
    # commands) must not load torch, which only the manager needs.
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name == "sizing":
        return importlib.import_module("moe_sidecar.client.sizing")
    module = importlib.import_module(_HOME.get(name, "moe_sidecar.client.errors"))
    return getattr(module, name)
