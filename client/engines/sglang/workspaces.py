"""The workspaces of one SGLang process: each namespace's group, sized after load.

SGLang constructs its ``FlashinferDispatcher`` objects (one per MoE layer)
while it builds the model, before any weight is loaded; the plugin's subclass
(:mod:`.dispatcher`) registers each here and allocates nothing. After
``ModelRunner.load_model`` (when each layer's quant config, hence the rows it
really dispatches, is known), :meth:`NamespaceWorkspaces.size_after_load`:

1. takes the dispatchers created since the last load, in creation order;
2. for each of a layer's namespaces (its decode or speculative workspace,
   and its SP-prefill one when enabled), proposes the layer to that
   namespace's :class:`~moe_sidecar.client.manager.AlltoAllManager`: one
   round per MoE layer, one sidecar group per namespace
   (:mod:`.naming`), built at the union, SGLang's namespace padding kept
   (:class:`.backend.PaddedBackend`);
3. puts each namespace's built ``MoeAlltoAll`` in every one of its
   dispatchers' ``moe_a2a`` (or ``sp_prefill_moe_a2a``), where SGLang's own
   ``dispatch()``/``combine()`` find it.

With SGLang's startup overlap (weights committed after CUDA graph capture) a
layer's quant config is not final at load, so every layer is sized for bf16
rows, as SGLang sizes it, and a warning says so.

:meth:`NamespaceWorkspaces.seal` runs before ``ModelRunner.init_cuda_graphs``:
captured graphs hold the workspace's pointers, so afterwards a layer that
needs more than a namespace holds is refused (:class:`WorkspaceSealed`)
before anything is proposed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from moe_sidecar.client.backends import AlltoAllBackend
from moe_sidecar.client.construction import backend_named
from moe_sidecar.client.engines.sglang.backend import PaddedBackend
from moe_sidecar.client.engines.sglang.naming import SglangLayout, sglang_group_name
from moe_sidecar.client.engines.sglang.sizing import (
    DispatchType,
    Namespace,
    NamespaceSize,
    effective_dispatch,
    namespace_padding,
    row_bytes,
)
from moe_sidecar.client.errors import PreconditionFailed
from moe_sidecar.client.layer_need import LayerNeed, Layout
from moe_sidecar.client.manager import AlltoAllManager
from moe_sidecar.core.layer import layer_capacities

__all__ = ["NamespaceWorkspaces", "WorkspaceSealed", "layer_rows"]

_log = logging.getLogger("sglang.srt.plugins.moe_sidecar")

_ATTRIBUTE = {Namespace.SP_PREFILL: "sp_prefill_moe_a2a"}
"""Where a dispatcher keeps a namespace's all-to-all (the others: ``moe_a2a``)."""


class WorkspaceSealed(PreconditionFailed):
    """A layer needs more than a namespace holds after CUDA graphs were captured."""


def layer_rows(dispatcher: Any) -> DispatchType:
    """The rows ``dispatcher`` sends at run time, from its loaded quant config
    (SGLang's ``_effective_dispatch_type()``)."""
    quant_config = dispatcher.quant_config or {}
    return effective_dispatch(
        DispatchType[dispatcher.dispatch_type.name],
        has_input_global_scale=quant_config.get("input_global_scale") is not None,
        uses_mxfp8=bool(quant_config.get("use_mxfp8", False)),
    )


def _namespaces_of(dispatcher: Any) -> list[Namespace]:
    namespaces = [Namespace(int(dispatcher.decode_a2a_namespace))]
    if dispatcher.sp_prefill_moe_a2a is not None:
        namespaces.append(Namespace.SP_PREFILL)
    return namespaces


@dataclass
class _NamespaceGroup:
    """One namespace's manager and the dispatchers it serves."""

    namespace: Namespace
    manager: AlltoAllManager
    members: list[Any] = field(default_factory=list)
    engine_bytes: int = 0
    sealed: bool = False

    def propose(self, dispatcher: Any, rows: DispatchType, layer: str) -> None:
        """One round: ``dispatcher``'s layer at ``rows``.

        Raises:
            WorkspaceSealed: sealed, and the layer needs more than is built.
            CoordinatorError, BackendError: as ``AlltoAllManager.initialize_layer``.
        """
        need = layer_capacities(
            dispatcher.max_num_tokens,
            dispatcher.router_topk,
            dispatcher.num_experts,
            dispatcher.hidden_size,
            row_bytes(dispatcher.hidden_size, rows),
        )
        plan = self.manager.plan
        if self.sealed and (plan is None or not plan.covers(need)):
            raise WorkspaceSealed(
                f"SGLang layer {layer} ({rows.name} rows) needs {need} but group "
                f"{self.manager.group!r} holds {plan} and CUDA graphs were already captured "
                "over its workspace; a growth now would leave the graphs on freed memory"
            )
        row = row_bytes(dispatcher.hidden_size, rows)
        layout = Layout(dispatcher.hidden_size, rows.value, rows.value, row, 0)
        self.manager.initialize_layer(LayerNeed(need, layout, layer))
        self.members.append(dispatcher)
        self.engine_bytes = max(
            self.engine_bytes, dispatcher.engine_workspace_size + namespace_padding(self.namespace)
        )

    def install(self) -> NamespaceSize:
        """Puts the built all-to-all in every member; returns the sizes."""
        handle = self.manager.moe_alltoall
        attribute = _ATTRIBUTE.get(self.namespace, "moe_a2a")
        for dispatcher in self.members:
            setattr(dispatcher, attribute, handle)
        return NamespaceSize(self.namespace, self.engine_bytes, self.manager.workspace_bytes)


ManagerFactory = Callable[[Any, str, AlltoAllBackend], AlltoAllManager]


def _manager(cpu_group: Any, group: str, backend: AlltoAllBackend) -> AlltoAllManager:
    return AlltoAllManager(cpu_group, group=group, backend=backend)


class NamespaceWorkspaces:
    """Every dispatcher of this process and each namespace's group (see the module docstring)."""

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        manager: ManagerFactory = _manager,
        backend: str | None = None,
    ) -> None:
        self._environ = os.environ if environ is None else environ
        self._manager = manager
        self._backend = backend
        self._pending: list[Any] = []
        self._groups: dict[str, _NamespaceGroup] = {}

    def add(self, dispatcher: Any) -> None:
        """Registers a dispatcher SGLang just constructed (creation order)."""
        self._pending.append(dispatcher)

    @property
    def groups(self) -> dict[str, AlltoAllManager]:
        """Each namespace group's name and manager."""
        return {name: group.manager for name, group in self._groups.items()}

    def _group(self, layout: SglangLayout, namespace: Namespace, cpu_group: Any) -> _NamespaceGroup:
        name = sglang_group_name(layout, namespace, self._environ)
        group = self._groups.get(name)
        if group is None:
            inner = backend_named(self._backend, cpu_group)
            padded = PaddedBackend(inner, namespace_padding(namespace))
            group = _NamespaceGroup(namespace, self._manager(cpu_group, name, padded))
            self._groups[name] = group
        return group

    def size_after_load(
        self,
        layout: SglangLayout,
        layer_names: Mapping[int, str],
        *,
        startup_overlap: bool,
    ) -> dict[str, NamespaceSize]:
        """Sizes and builds the namespaces of the dispatchers created since the
        last load; returns each touched group's sizes.

        Args:
            layout: the runner's topology (names the groups).
            layer_names: ``id(dispatcher)`` -> the module path of its layer.
            startup_overlap: weights arrive after graph capture: size bf16 rows.

        Raises:
            WorkspaceSealed: a layer needs more than a sealed namespace holds.
            CoordinatorError, BackendError: as ``AlltoAllManager.initialize_layer``.
        """
        pending, self._pending = self._pending, []
        if startup_overlap and pending:
            _log.warning(
                "moe-sidecar: SGLang's startup overlap loads weights after CUDA graph capture, "
                "so the layers' dispatch formats are not known yet: sizing %d MoE layers for "
                "bf16 rows, as SGLang does",
                len(pending),
            )
        touched: dict[str, _NamespaceGroup] = {}
        for index, dispatcher in enumerate(pending):
            rows = DispatchType.BF16 if startup_overlap else layer_rows(dispatcher)
            layer = layer_names.get(id(dispatcher), f"moe layer {index}")
            for namespace in _namespaces_of(dispatcher):
                group = self._group(layout, namespace, dispatcher.cpu_group)
                group.propose(dispatcher, rows, layer)
                touched[group.manager.group] = group
        sizes = {name: group.install() for name, group in touched.items()}
        for name, size in sizes.items():
            _log.info(
                "moe-sidecar: group %s: %d B per rank (SGLang alone: %d B; %.1f MiB left to "
                "the KV cache)",
                name,
                size.exact_bytes_per_rank,
                size.engine_bytes_per_rank,
                size.saved_bytes_per_rank / (1 << 20),
            )
        return sizes

    def seal(self) -> None:
        """Refuses any growth of the namespaces built so far (before graph capture)."""
        for group in self._groups.values():
            group.sealed = True

    def cleanup(self) -> None:
        """Frees every namespace's workspace (``AlltoAllManager.cleanup``)."""
        for group in self._groups.values():
            group.manager.cleanup()
