"""The ``flashinfer.moe_ep`` objects that describe one EP rank's all-to-all, built in one place.

Both FlashInfer backends describe what they build to FlashInfer's ``moe_ep``
API with the same three objects, as vLLM 0.33 builds them
(``all2all.py``, ``FlashInferNVLinkOneSidedManager.initialize``)::

    params = MoEEpCommParams(num_experts=..., top_k=..., max_tokens_per_rank=...,
        hidden_size=..., dtype=torch.bfloat16, dispatch_format=...)
    bootstrap = BootstrapConfig(world_size=..., rank=...,
        device=torch.accelerator.current_device_index(), process_group=cpu_group)
    config = NVLinkOneSidedConfig(extra_payload_bytes_per_token=...,
        use_low_precision_combine=..., comm_backend=CustomCommunicator(cpu_group))

plus ``enable_rank_mask=True`` for an all-to-all built to take membership
masks (left out otherwise, as vLLM leaves it).

The ``MoeAlltoAll`` backend wraps its own ``MoeAlltoAll`` with them; the
``moe_ep`` backend builds ``NVLinkOneSidedAlltoAll`` from them, with the
config fields only its release has (``eplb_stats_num_experts``, ``cft``,
``lamport``) passed as ``config_fields``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["MoeEpObjects", "moe_ep_objects"]


@dataclass(frozen=True)
class MoeEpObjects:
    """FlashInfer's ``MoEEpCommParams``, ``BootstrapConfig`` and ``NVLinkOneSidedConfig``."""

    params: Any
    bootstrap: Any
    config: Any


def moe_ep_objects(
    moe_ep: Any,
    quant_format: Any,
    *,
    group: dist.ProcessGroup,
    ep_size: int,
    ep_rank: int,
    num_experts: int,
    top_k: int,
    max_tokens_per_rank: int,
    hidden_size: int,
    dispatch_format_name: str | None,
    extra_payload_bytes_per_token: int,
    use_low_precision_combine: bool,
    comm_backend: object,
    config_fields: Mapping[str, object] | None = None,
    enable_rank_mask: bool = False,
) -> MoeEpObjects:
    """The three objects for one rank of the EP group ``group``.

    ``moe_ep`` is the imported ``flashinfer.moe_ep``, ``quant_format``
    FlashInfer's ``QuantFormat`` (``dispatch_format_name`` None: bf16 rows);
    ``comm_backend`` the communicator FlashInfer's handle exchange runs on;
    ``enable_rank_mask`` compiles the active-rank mask into the kernels.

    Raises:
        KeyError: a ``dispatch_format_name`` FlashInfer's ``QuantFormat`` lacks.
    """
    params = moe_ep.MoEEpCommParams(
        num_experts=num_experts,
        top_k=top_k,
        max_tokens_per_rank=max_tokens_per_rank,
        hidden_size=hidden_size,
        dtype=torch.bfloat16,
        dispatch_format=None
        if dispatch_format_name is None
        else quant_format[dispatch_format_name],
    )
    bootstrap = moe_ep.BootstrapConfig(
        world_size=ep_size,
        rank=ep_rank,
        device=torch.cuda.current_device(),
        process_group=group,
    )
    config = moe_ep.NVLinkOneSidedConfig(
        extra_payload_bytes_per_token=extra_payload_bytes_per_token,
        use_low_precision_combine=use_low_precision_combine,
        comm_backend=comm_backend,
        **({"enable_rank_mask": True} if enable_rank_mask else {}),
        **(config_fields or {}),
    )
    return MoeEpObjects(params=params, bootstrap=bootstrap, config=config)
