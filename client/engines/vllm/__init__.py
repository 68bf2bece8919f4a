"""vLLM's room: moe-sidecar's manager as vLLM's ``FlashInferNVLinkOneSidedManager``.

``manager`` (the drop-in, :class:`WorkspaceManager`, with vLLM's three
``initialize()`` call forms), ``plugin`` (the ``vllm.general_plugins`` entry
point, :func:`register`), ``sizing`` (each vLLM generation's arguments as
capacities), ``naming`` (the group name from vLLM's config), ``settings``
(the environment variables the room reads), ``fault_tolerance`` (vLLM
0.33's fault-tolerance hooks: its backend set, the support decision, the
mask in vLLM's convention; vLLM 0.34's ``update_mask`` against the view),
``releases`` (which FlashInfer release each vLLM release is served on,
checked at plugin load). Importing this package loads
nothing of torch or vLLM; the manager's module is imported when
:class:`WorkspaceManager` is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_sidecar.client.lazy_names import lazy_names

if TYPE_CHECKING:
    from moe_sidecar.client.engines.vllm.manager import WorkspaceManager
    from moe_sidecar.client.engines.vllm.plugin import register

__all__ = ["WorkspaceManager", "register"]

__getattr__ = lazy_names(__name__, {"manager": ("WorkspaceManager",), "plugin": ("register",)})
