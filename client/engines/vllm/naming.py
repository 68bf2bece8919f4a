"""vLLM's rule for the EP group's name (rule 3 of :mod:`moe_sidecar.client.naming`).

Inside vLLM (its model-parallel groups exist in this process) a group is
named by the model, its quantization, the TP/PP/DP/EP sizes and this rank's
pipeline stage, ``<model>:<quantization>/tp<T>-pp<P>-dp<D>-ep<E>/pp<stage>``
(``-pcp<C>`` is added when prefill context parallelism is on), e.g.
``deepseek-ai/DeepSeek-V3:fp8/tp1-pp1-dp8-ep8/pp0``. vLLM's name is the same
on every rank and node of one EP group and across restarts of the same
deployment.

Names longer than the sidecar accepts (256 characters) keep the end of the
model path and a hash of all of it; characters the sidecar refuses (not
printable) become ``?``. So nothing vLLM passes is refused.

vLLM is read only when it is already imported (never imported to find out).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moe_sidecar.client import naming
from moe_sidecar.core.limits import MAX_NAME_LENGTH

__all__ = ["VllmLayout", "group_name", "vllm_group_name", "vllm_group_name_of", "vllm_layout"]


@dataclass(frozen=True)
class VllmLayout:
    """What names an EP group inside vLLM."""

    model: str | None
    """``model_config.model`` (a Hugging Face id or a path); None when vLLM's
    config is not current or has no model."""
    quantization: str | None
    """``model_config.quantization`` (None: unquantized)."""
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    expert_parallel_size: int
    """The EP group's size (its CPU group's)."""
    pipeline_stage: int
    """This rank's pipeline stage: one EP group per stage."""
    prefill_context_parallel_size: int = 1


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in text)


def vllm_group_name(layout: VllmLayout) -> str:
    """The group name of rule 3 (see the module docstring); at most
    ``MAX_NAME_LENGTH`` characters, printable."""
    pcp = (
        f"-pcp{layout.prefill_context_parallel_size}"
        if layout.prefill_context_parallel_size > 1
        else ""
    )
    suffix = (
        f":{_printable(layout.quantization or 'unquantized')}"
        f"/tp{layout.tensor_parallel_size}-pp{layout.pipeline_parallel_size}"
        f"-dp{layout.data_parallel_size}-ep{layout.expert_parallel_size}{pcp}"
        f"/pp{layout.pipeline_stage}"
    )
    model = _printable(layout.model or "unknown-model")
    room = MAX_NAME_LENGTH - len(suffix)
    if len(model) > room:
        # The end of a model path names it best; the hash keeps two long
        # paths with the same end apart.
        digest = hashlib.sha256((layout.model or "").encode()).hexdigest()[:12]
        keep = max(room - len(digest) - 4, 0)
        model = f"...{model[len(model) - keep :]}#{digest}"
    return (model + suffix)[:MAX_NAME_LENGTH]


def vllm_layout(cpu_group: Any) -> VllmLayout | None:
    """vLLM's layout for the EP group ``cpu_group``, when this process runs
    vLLM's distributed state (rule 3); None otherwise.

    Reads vLLM's process groups (TP, PP, DP, and PCP where it has one) and,
    when vLLM's config is current (inside a vLLM worker it is, while the
    groups are built), the model and quantization. Never imports vLLM.
    """
    if "vllm.distributed.parallel_state" not in sys.modules:
        return None
    parallel_state: Any = sys.modules["vllm.distributed.parallel_state"]
    try:
        tp_size = int(parallel_state.get_tp_group().world_size)
        pp = parallel_state.get_pp_group()
        pp_size, stage = int(pp.world_size), int(pp.rank_in_group)
        dp_size = int(parallel_state.get_dp_group().world_size)
    except (AssertionError, AttributeError):
        return None  # vLLM is imported but its groups are not built here
    try:
        pcp_size = int(parallel_state.get_pcp_group().world_size)
    except (AssertionError, AttributeError):
        pcp_size = 1
    model: str | None = None
    quantization: str | None = None
    config_module = sys.modules.get("vllm.config")
    current = getattr(config_module, "get_current_vllm_config_or_none", None)
    config = current() if callable(current) else None
    model_config = getattr(config, "model_config", None)
    if model_config is not None:
        model = str(model_config.model)
        quantization = getattr(model_config, "quantization", None)
    return VllmLayout(
        model=model,
        quantization=None if quantization is None else str(quantization),
        tensor_parallel_size=tp_size,
        pipeline_parallel_size=pp_size,
        data_parallel_size=dp_size,
        expert_parallel_size=int(cpu_group.size()),
        pipeline_stage=stage,
        prefill_context_parallel_size=pcp_size,
    )


def vllm_group_name_of(cpu_group: Any) -> str | None:
    """Rule 3 for the EP group ``cpu_group``: vLLM's name of it, or None when
    this process runs no vLLM distributed state."""
    layout = vllm_layout(cpu_group)
    return None if layout is None else vllm_group_name(layout)


def group_name(
    explicit: str | None,
    environ: Mapping[str, str],
    layout: VllmLayout | None,
    global_ranks: Sequence[int],
    *,
    embedded: bool,
) -> str:
    """:func:`moe_sidecar.client.naming.group_name` with vLLM's layout (None:
    not inside vLLM) as rule 3. Pure.

    Raises:
        InvalidArgument: sidecar mode and no name from rules 1-3.
    """
    engine_name = None if layout is None else vllm_group_name(layout)
    return naming.group_name(explicit, environ, engine_name, global_ranks, embedded=embedded)
