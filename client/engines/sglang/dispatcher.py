"""SGLang's ``FlashinferDispatcher`` with its allocation deferred to the adapter.

:func:`dispatcher_class` makes a subclass of SGLang's own class (SGLang's
``FusedMoE`` and ``create_moe_dispatcher`` construct it once the plugin has
REPLACEd the class). Its ``__init__`` is SGLang's, run as it is, with two
names of SGLang's module standing in for FlashInfer while it runs:

* ``MoeAlltoAll``: :class:`DeferredAlltoAll`, which records what SGLang asked
  for (its workspace size per namespace) and allocates nothing;
* ``moe_a2a_get_workspace_size_per_rank``: the pure function that computes
  the size of SGLang's FlashInfer release byte for byte
  (:func:`moe_sidecar.flashinfer.v0_7_2_post1.workspace_size_per_rank`), so no CUDA
  module is loaded to size what is not built.

The new dispatcher then registers with the process's
:class:`~moe_sidecar.client.engines.sglang.workspaces.NamespaceWorkspaces`,
which builds each namespace's workspace through the manager after the model
is loaded and puts it in ``moe_a2a`` / ``sp_prefill_moe_a2a``. SGLang's
``dispatch()`` and ``combine()`` are not touched: they run on what was built.
Model construction is single-threaded in SGLang, so the two names are
swapped back before any other code can see them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from moe_sidecar.flashinfer.v0_7_2_post1 import workspace_size_per_rank

__all__ = ["DeferredAlltoAll", "NotBuiltYet", "dispatcher_class"]


class NotBuiltYet(RuntimeError):
    """A deferred workspace was used before the adapter built it."""


class DeferredAlltoAll:
    """What SGLang's ``__init__`` asked ``MoeAlltoAll`` for; allocates nothing."""

    def __init__(self, **kwargs: Any) -> None:
        self.requested: dict[str, Any] = kwargs
        self.workspace_size_per_rank: int = kwargs["workspace_size_per_rank"]
        self.max_num_tokens: int = kwargs["max_num_tokens"]

    def _refuse(self, *_args: Any, **_kwargs: Any) -> Any:
        raise NotBuiltYet(
            "moe-sidecar builds SGLang's FlashInfer all-to-all after the model is loaded "
            "(ModelRunner.load_model); it was used before that"
        )

    dispatch = combine = get_combine_payload_tensor_in_workspace = _refuse


def _pure_workspace_size(
    *,
    ep_size: int,
    max_num_tokens: int,
    total_dispatch_payload_size_per_token: int,
    combine_payload_size_per_token: int,
    eplb_stats_num_experts: int = 0,
) -> int:
    return workspace_size_per_rank(
        ep_size,
        max_num_tokens,
        total_dispatch_payload_size_per_token,
        combine_payload_size_per_token,
        eplb_stats_num_experts,
    )


@contextlib.contextmanager
def _deferred(module: ModuleType) -> Iterator[None]:
    names = {
        "MoeAlltoAll": DeferredAlltoAll,
        "moe_a2a_get_workspace_size_per_rank": _pure_workspace_size,
    }
    saved = {name: module.__dict__.get(name) for name in names}
    for name, stand_in in names.items():
        setattr(module, name, stand_in)
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(module, name, original)


def dispatcher_class(module: ModuleType, on_created: Any) -> type:
    """A subclass of ``module.FlashinferDispatcher`` (SGLang's
    ``token_dispatcher.flashinfer``) whose instances defer their allocation
    and are passed to ``on_created`` (``cpu_group`` is set on them first)."""
    base: type = module.FlashinferDispatcher

    class SidecarFlashinferDispatcher(base):  # type: ignore[misc]
        """SGLang's dispatcher; moe-sidecar builds its workspaces after load."""

        moe_sidecar_defers = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            with _deferred(module):
                super().__init__(*args, **kwargs)
            self.engine_workspace_size = self.workspace_size
            """What SGLang sized for this layer, before its namespace padding."""
            self.cpu_group = _cpu_group(module, self)
            on_created(self)

    SidecarFlashinferDispatcher.__qualname__ = base.__qualname__
    SidecarFlashinferDispatcher.__module__ = base.__module__
    return SidecarFlashinferDispatcher


def _cpu_group(module: ModuleType, dispatcher: Any) -> Any:
    """The EP group's CPU (gloo) group: SGLang's tp group's ``cpu_group``
    (SGLang's FlashInfer all-to-all runs on the tp group's device group)."""
    tp_group = module.get_parallel().tp_group
    cpu_group = getattr(tp_group, "cpu_group", None)
    if cpu_group is None:
        raise RuntimeError("SGLang's tp group has no cpu_group for the EP group's collectives")
    if cpu_group.size() != dispatcher.ep_size:
        raise RuntimeError(
            f"SGLang's tp cpu_group has {cpu_group.size()} ranks, its EP group {dispatcher.ep_size}"
        )
    return cpu_group
