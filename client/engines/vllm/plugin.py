"""The vLLM plugin: vLLM's own one-sided manager class, replaced by moe-sidecar's.

Installing the package with its ``vllm`` extra (from a checkout,
``pip install '.[vllm]'``) registers :func:`register` as the
``vllm.general_plugins`` entry point ``moe_sidecar``. vLLM calls it once in
every process it starts (``load_general_plugins()``; in a worker from
``WorkerWrapperBase.init_worker``, before ``init_device()`` builds the process
groups), so the replacement is in place before vLLM's ``CudaCommunicator``
runs ``from .all2all import FlashInferNVLinkOneSidedManager`` and constructs
the manager as ``FlashInferNVLinkOneSidedManager(cpu_group)``.

When it acts (:func:`plugin_mode`):

* ``MOE_SIDECAR_TARGET`` set (an address): sidecar mode;
* ``MOE_SIDECAR_VLLM`` true (or ``MOE_SIDECAR_TARGET=embedded``): embedded mode;
* otherwise, or with ``MOE_SIDECAR_VLLM`` false: it changes nothing (vLLM's
  ``VLLM_PLUGINS`` can also leave it out by name).

``MOE_SIDECAR_VLLM`` takes the project's one boolean rule
(:func:`moe_sidecar.core.defaults.parse_bool`). When it acts, it checks every
``MOE_SIDECAR_*`` variable the manager will read (:func:`check_environment`)
before it changes anything, so a malformed value stops vLLM at start with
one line naming the variable, not at the first MoE layer.

Before anything else it checks the installed releases against each other
(:mod:`moe_sidecar.client.engines.vllm.releases`): a FlashInfer release
without a row of the release table, or vLLM 0.34 with the ``MoeAlltoAll``
release, stops vLLM at start with one line naming both versions and the fix.

What it does: it reads which ``initialize()`` signature this vLLM's
``vllm.distributed.device_communicators.all2all.FlashInferNVLinkOneSidedManager``
has (PR #42976, 0.30 or 0.33: the parameter names, so forks that carry the
same code under other version numbers are served too), makes a **subclass
of that class** whose behaviour is :class:`WorkspaceManager`'s (vLLM 0.33
asserts ``isinstance(manager, FlashInferNVLinkOneSidedManager)``), puts it in
the module in place of vLLM's, and logs one line saying so.

In sidecar mode under ``MOE_SIDECAR_ON_PEER_LOSS=mask`` it also adds
``flashinfer_nvlink_one_sided`` to the backends vLLM 0.33's fault tolerance
accepts (:func:`~moe_sidecar.client.engines.vllm.fault_tolerance.extend_ft_backends`),
with one more line; the manager answers its hooks.

The subclass does not run vLLM's own ``__init__``: it asserts that FlashInfer's
``moe_ep`` API is importable, which only matters to vLLM's own
``initialize()``. It runs vLLM's ``All2AllManagerBase.__init__`` (``rank``,
``world_size``, ``dp_group``, ``internode``: a collective on ``cpu_group``,
at the same point on every rank as vLLM's) and then the manager's, so it
constructs on a CPU-only machine with the reference backend
(``MOE_SIDECAR_BACKEND=reference``) as on a GPU with FlashInfer's (the
default).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from collections.abc import Mapping
from typing import Any, ClassVar, Final

from moe_sidecar.client.engines.vllm.fault_tolerance import extend_ft_backends
from moe_sidecar.client.engines.vllm.manager import WorkspaceManager
from moe_sidecar.client.engines.vllm.releases import UnsupportedReleases, installed_releases
from moe_sidecar.client.engines.vllm.settings import ENV_VLLM
from moe_sidecar.client.engines.vllm.sizing import KEYWORDS, Generation
from moe_sidecar.client.environment import check_environment
from moe_sidecar.client.environment import plugin_mode as engine_plugin_mode
from moe_sidecar.client.peer_loss import PeerLossPolicy, policy_from_environment
from moe_sidecar.core.defaults import (
    ENV_BACKEND,
    ENV_TARGET,
)

__all__ = [
    "ALL2ALL_MODULE",
    "MANAGER_NAME",
    "PLUGIN_NAME",
    "UnsupportedReleases",
    "UnsupportedVllm",
    "VllmManager",
    "check_environment",
    "detect_generation",
    "manager_class",
    "plugin_mode",
    "register",
]

PLUGIN_NAME: Final = "moe_sidecar"
"""The entry point's name (what ``VLLM_PLUGINS`` lists to select it)."""
ALL2ALL_MODULE: Final = "vllm.distributed.device_communicators.all2all"
MANAGER_NAME: Final = "FlashInferNVLinkOneSidedManager"

# vLLM configures the "vllm" logger (handler, format, level, propagate=False)
# and nothing else: the line must be under it to appear in vLLM's log.
_log = logging.getLogger("vllm.plugins.moe_sidecar")


class UnsupportedVllm(RuntimeError):
    """This vLLM has no one-sided manager, or one whose ``initialize()`` none
    of the known generations matches; the plugin was asked to replace it."""


def plugin_mode(environ: Mapping[str, str]) -> str | None:
    """``"sidecar"``, ``"embedded"`` or None (leave vLLM alone), from the environment.

    Raises:
        InvalidArgument: ``MOE_SIDECAR_VLLM`` is set to none of the boolean forms.
    """
    return engine_plugin_mode(environ, ENV_VLLM, "replace vLLM's manager")


def detect_generation(vllm_class: Any) -> Generation:
    """The generation whose ``initialize()`` parameters ``vllm_class`` has.

    Raises:
        UnsupportedVllm: none matches.
    """
    parameters = inspect.signature(vllm_class.initialize).parameters
    for generation, (first, second) in KEYWORDS.items():
        if first in parameters and second in parameters:
            return generation
    raise UnsupportedVllm(
        f"{vllm_class.__module__}.{vllm_class.__qualname__}.initialize{inspect.signature(vllm_class.initialize)} "
        "matches none of the signatures moe-sidecar serves ("
        + "; ".join(f"{g.value}: {', '.join(pair)}" for g, pair in KEYWORDS.items())
        + f"); unset {ENV_TARGET}/{ENV_VLLM} to run vLLM's own manager"
    )


class VllmManager(WorkspaceManager):
    """:class:`WorkspaceManager` constructed as vLLM constructs its manager.

    Not used alone: :func:`manager_class` combines it with vLLM's class,
    which comes after it in the method resolution order, so every method
    and attribute vLLM's callers use is the manager's.
    """

    vllm_base: ClassVar[Any]
    """vLLM's ``FlashInferNVLinkOneSidedManager`` this class replaces."""
    vllm_generation: ClassVar[Generation]
    """The generation of ``vllm_base.initialize()``."""

    def __init__(self, cpu_group: Any, tcp_store_group: Any = None) -> None:
        # vLLM's __init__ is skipped (see the module docstring); the class
        # after it in the MRO is All2AllManagerBase.
        after_vllm: Any = super(self.vllm_base, self)
        after_vllm.__init__(cpu_group, tcp_store_group)
        WorkspaceManager.__init__(self, cpu_group)


def manager_class(vllm_class: Any) -> type[VllmManager]:
    """The subclass of ``vllm_class`` that is moe-sidecar's manager.

    Raises:
        UnsupportedVllm: ``vllm_class``'s ``initialize()`` is of no known generation.
    """
    generation = detect_generation(vllm_class)
    cls = type(
        "MoeSidecarOneSidedManager",
        (VllmManager, vllm_class),
        {
            "__module__": __name__,
            "__doc__": f"moe-sidecar's manager in place of {vllm_class.__qualname__} "
            f"({generation.value} initialize()); see moe_sidecar.client.engines.vllm.plugin.",
            "vllm_base": vllm_class,
            "vllm_generation": generation,
        },
    )
    return cls


def _share_vllm_log() -> None:
    """The manager's own lines (builds, rebuilds, releases) go where vLLM's go."""
    ours = logging.getLogger("moe_sidecar")
    vllm_logger = logging.getLogger("vllm")
    if ours.handlers or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        ours.addHandler(handler)
    ours.setLevel(vllm_logger.getEffectiveLevel())
    ours.propagate = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point (see the module docstring).

    Idempotent: a second call in the same process changes nothing.

    Raises:
        InvalidArgument: a malformed ``MOE_SIDECAR_VLLM``, or (enabled) a
            malformed variable of :func:`check_environment`.
        UnsupportedReleases: enabled, but the installed FlashInfer has no row
            of the release table, or is of another API than this vLLM calls
            (:mod:`moe_sidecar.client.engines.vllm.releases`).
        UnsupportedVllm: enabled, but this vLLM's manager cannot be replaced.
    """
    mode = plugin_mode(os.environ)
    if mode is None:
        return
    check_environment(os.environ)
    releases = installed_releases()
    extend_ft_backends(mode, policy_from_environment(os.environ) is PeerLossPolicy.MASK)
    module = importlib.import_module(ALL2ALL_MODULE)
    current = getattr(module, MANAGER_NAME, None)
    if current is None:
        raise UnsupportedVllm(
            f"{ALL2ALL_MODULE} has no {MANAGER_NAME}: this vLLM predates the one-sided "
            f"all-to-all; unset {ENV_TARGET}/{ENV_VLLM}"
        )
    if isinstance(current, type) and issubclass(current, VllmManager):
        return
    replacement = manager_class(current)
    setattr(module, MANAGER_NAME, replacement)
    _share_vllm_log()
    target = os.environ.get(ENV_TARGET, "").strip()
    first, second = KEYWORDS[replacement.vllm_generation]
    _log.info(
        "moe-sidecar: vLLM %s's %s replaced by moe_sidecar's %s (initialize() takes %s and %s, "
        "as since %s; %s; %s mode%s, backend %s)",
        releases.vllm,
        MANAGER_NAME,
        replacement.__name__,
        first,
        second,
        replacement.vllm_generation.value,
        releases.describe(),
        mode,
        f", {ENV_TARGET}={target}" if mode == "sidecar" else "",
        os.environ.get(ENV_BACKEND, "").strip() or "flashinfer",
    )
