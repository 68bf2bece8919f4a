"""The SGLang plugin: SGLang's FlashInfer dispatcher, sized exactly by moe-sidecar.

Installing the package registers :func:`register` as the ``sglang.srt.plugins``
entry point ``moe_sidecar``; SGLang's ``load_plugins()`` calls it early in
every process it starts, then applies the hooks registered.

When it acts (:func:`plugin_mode`), the vLLM plugin's rule with SGLang's switch:

* ``MOE_SIDECAR_TARGET`` set (an address): sidecar mode;
* ``MOE_SIDECAR_SGLANG`` true (or ``MOE_SIDECAR_TARGET=embedded``): embedded mode;
* otherwise, or with ``MOE_SIDECAR_SGLANG`` false: it changes nothing
  (``SGLANG_PLUGINS`` can also leave it out by name).

What it registers with SGLang's ``HookRegistry``:

* REPLACE of ``...token_dispatcher.flashinfer.FlashinferDispatcher`` by a
  subclass (:mod:`.dispatcher`) that defers the allocation; SGLang propagates
  the replacement to every module that imported the class;
* AFTER ``ModelRunner.load_model``: each namespace sized and built
  (:meth:`.workspaces.NamespaceWorkspaces.size_after_load`);
* BEFORE ``ModelRunner.init_cuda_graphs``: the namespaces built so far sealed.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping
from typing import Any, Final

from moe_sidecar.client.engines.sglang.naming import SglangLayout
from moe_sidecar.client.engines.sglang.settings import ENV_SGLANG
from moe_sidecar.client.engines.sglang.workspaces import NamespaceWorkspaces
from moe_sidecar.client.environment import check_environment
from moe_sidecar.client.environment import plugin_mode as engine_plugin_mode

__all__ = [
    "DISPATCHER",
    "ENV_SGLANG",
    "INIT_CUDA_GRAPHS",
    "LOAD_MODEL",
    "PLUGIN_NAME",
    "after_load_model",
    "before_cuda_graphs",
    "layer_names",
    "layout_of",
    "plugin_mode",
    "register",
    "workspaces",
]

PLUGIN_NAME: Final = "moe_sidecar"
"""The entry point's name (what ``SGLANG_PLUGINS`` lists to select it)."""
DISPATCHER_MODULE: Final = "sglang.srt.layers.moe.token_dispatcher.flashinfer"
DISPATCHER: Final = f"{DISPATCHER_MODULE}.FlashinferDispatcher"
LOAD_MODEL: Final = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
INIT_CUDA_GRAPHS: Final = "sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs"

_log = logging.getLogger("sglang.srt.plugins.moe_sidecar")
_WORKSPACES: NamespaceWorkspaces | None = None


def workspaces() -> NamespaceWorkspaces:
    """This process's namespaces (made on first use)."""
    global _WORKSPACES
    if _WORKSPACES is None:
        _WORKSPACES = NamespaceWorkspaces()
    return _WORKSPACES


def plugin_mode(environ: Mapping[str, str]) -> str | None:
    """``"sidecar"``, ``"embedded"`` or None (leave SGLang alone), from the environment.

    Raises:
        InvalidArgument: ``MOE_SIDECAR_SGLANG`` is set to none of the boolean forms.
    """
    return engine_plugin_mode(environ, ENV_SGLANG, "size SGLang's dispatcher")


def layout_of(runner: Any) -> SglangLayout:
    """The runner's topology, from SGLang's runtime context."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    model_config = runner.model_config
    return SglangLayout(
        model=str(getattr(model_config, "model_path", "") or ""),
        quantization=getattr(model_config, "quantization", None),
        tp_size=int(parallel.tp_size),
        pp_size=int(parallel.pp_size),
        dp_size=int(parallel.attn_dp_size),
        ep_size=int(parallel.moe_ep_size),
        pp_stage=int(parallel.pp_rank),
        draft=bool(getattr(runner, "is_draft_worker", False)),
    )


def layer_names(model: Any) -> dict[int, str]:
    """``id(dispatcher)`` -> the path of the module holding it, for errors and history."""
    return {
        id(module.dispatcher): name
        for name, module in model.named_modules()
        if getattr(module, "dispatcher", None) is not None
    }


def after_load_model(_result: Any, runner: Any, *_args: Any, **_kwargs: Any) -> None:
    """AFTER ``ModelRunner.load_model``: size and build the new layers' namespaces.

    Raises:
        WorkspaceSealed, CoordinatorError, BackendError: as
            :meth:`NamespaceWorkspaces.size_after_load`; SGLang's start fails.
    """
    workspaces().size_after_load(
        layout_of(runner),
        layer_names(runner.model),
        startup_overlap=getattr(runner, "startup_weight_load", None) is not None,
    )


def before_cuda_graphs(_runner: Any, *_args: Any, **_kwargs: Any) -> None:
    """BEFORE ``ModelRunner.init_cuda_graphs``: seal what is built."""
    workspaces().seal()


def register() -> None:
    """The entry point: registers the hooks when :func:`plugin_mode` says so.

    Raises:
        InvalidArgument: a malformed ``MOE_SIDECAR_*`` variable, naming it.
    """
    mode = plugin_mode(os.environ)
    if mode is None:
        return
    check_environment(os.environ)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from moe_sidecar.client.engines.sglang.dispatcher import dispatcher_class

    module = importlib.import_module(DISPATCHER_MODULE)
    if getattr(module.FlashinferDispatcher, "moe_sidecar_defers", False):
        return
    replacement = dispatcher_class(module, workspaces().add)
    HookRegistry.register(DISPATCHER, replacement, HookType.REPLACE)
    HookRegistry.register(LOAD_MODEL, after_load_model, HookType.AFTER)
    HookRegistry.register(INIT_CUDA_GRAPHS, before_cuda_graphs, HookType.BEFORE)
    _log.info("moe-sidecar (%s mode) sizes SGLang's FlashInfer all-to-all workspaces", mode)
