"""moe-sidecar client: the library inside each inference rank.

``WorkspaceManager`` sizes, builds, grows and frees one EP group's FlashInfer
MoE all-to-all workspace, deciding through the node's sidecar
(``MOE_SIDECAR_TARGET``) or, without one, through the same decision core
in-process. It is vLLM's room's manager (``engines.vllm.manager``): it takes
the ``initialize()`` arguments of every generation of vLLM's
``FlashInferNVLinkOneSidedManager`` (``engines.vllm.sizing``), and
``engines.vllm.plugin`` puts it in vLLM's place (the ``[vllm]`` extra's
``vllm.general_plugins`` entry point). The engine-neutral round protocol it
is built on is ``manager.AlltoAllManager``. ``sizing`` is FlashInfer's
workspace arithmetic in pure Python.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from moe_sidecar.client.lazy_names import lazy_names
from moe_sidecar.core.defaults import EMBEDDED, ENV_TARGET

if TYPE_CHECKING:
    from moe_sidecar.client import sizing
    from moe_sidecar.client.counters import ManagerCounters
    from moe_sidecar.client.engines.vllm.manager import WorkspaceManager
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

_NAMES = lazy_names(
    __name__,
    {
        "counters": ("ManagerCounters",),
        "errors": (
            "AdminDisabled",
            "AgreementError",
            "BackendError",
            "CoordinatorError",
            "CoordinatorUnavailable",
            "GroupNotFound",
            "InternalError",
            "InvalidArgument",
            "PermissionDenied",
            "PreconditionFailed",
            "RankLost",
            "ResourceExhausted",
            "RoundAborted",
            "RoundTimedOut",
        ),
        "engines.vllm.manager": ("WorkspaceManager",),
    },
)


def __getattr__(name: str) -> Any:
    """The public ``name``, from its module (imported now if it was not yet);
    ``sizing`` is the module itself.

    Raises:
        AttributeError: not a public name of this package.
    """
    # Lazy: importing a pure module of the client (sizing, naming, the tools'
    # commands) must not load torch, which only the manager needs.
    if name == "sizing":
        return importlib.import_module(f"{__name__}.sizing")
    return _NAMES(name)
