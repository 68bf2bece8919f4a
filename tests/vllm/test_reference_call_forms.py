"""vLLM 0.34's call forms on the reference backend's ``moe_ep`` object, one
rank process (no vLLM needed): ``dispatch(..., runtime_max_tokens_per_rank=)``
beside 0.33's ``max_tokens_per_rank=``, and ``get_combine_input_buffer``
handing out a real ``[ep * tokens, hidden]`` buffer between a dispatch and
its combine, refused by name outside it (FlashInfer's words)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.multiprocess.harness import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

HIDDEN, TOKENS, TOP_K, EXPERTS = 32, 4, 2, 4


def _refusal(call: Any) -> str:
    try:
        call()
    except (RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from moe_sidecar.client.layer_need import LayerNeed, Layout
    from moe_sidecar.client.manager import AlltoAllManager
    from moe_sidecar.client.sizing import layer_capacities
    from tests.exchange import token_values

    world = dist.group.WORLD
    assert world is not None  # the process group is initialized above
    manager = AlltoAllManager(world, backend="reference")
    capacities = layer_capacities(world_size, TOKENS, TOP_K, EXPERTS, HIDDEN, 2 * HIDDEN, 0)
    manager.initialize_layer(
        LayerNeed(capacities, Layout(HIDDEN, None, None, 2 * HIDDEN, 0), "layer")
    )
    communication = manager.get_communication()
    x = token_values(torch.arange(TOKENS), HIDDEN)
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]], dtype=torch.int32)
    weights = torch.full((TOKENS, TOP_K), 0.5)
    out: dict[str, Any] = {
        "before_dispatch": _refusal(lambda: communication.get_combine_input_buffer(torch.bfloat16)),
        "names_differ": _refusal(
            lambda: communication.dispatch(
                x, ids, weights, max_tokens_per_rank=2, runtime_max_tokens_per_rank=3
            )
        ),
        "above_capacity": _refusal(
            lambda: communication.dispatch(x, ids, weights, runtime_max_tokens_per_rank=TOKENS + 1)
        ),
    }
    received = communication.dispatch(x, ids, weights, runtime_max_tokens_per_rank=TOKENS)
    buffer = communication.get_combine_input_buffer(torch.bfloat16)
    out["buffer"] = [list(buffer.shape), str(buffer.dtype)]
    out["same_buffer"] = (
        communication.get_combine_input_buffer(torch.bfloat16).data_ptr() == buffer.data_ptr()
    )
    out["too_wide"] = _refusal(lambda: communication.get_combine_input_buffer(torch.float32))
    # Every expert here scales by its token's weight: the combine sums them back.
    buffer.copy_((received.hidden_states.float() * received.topk_weights.sum(-1, True)).bfloat16())
    output = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16)
    communication.combine(buffer, output=output)
    out["error"] = float((output.float() - x.float()).abs().max())
    manager.cleanup()
    out["after_destroy"] = _refusal(lambda: communication.get_combine_input_buffer(torch.bfloat16))
    return out


def test_the_reference_object_takes_vllm_0_34s_call_forms(tmp_path: Path) -> None:
    [out] = run_ranks(
        _rank,
        1,
        timeout=150,
        tmp_path=tmp_path,
        envs=[{"MOE_SIDECAR_TARGET": "", "MOE_SIDECAR_VLLM": "", "MOE_SIDECAR_GROUP": ""}],
    )
    assert out["before_dispatch"] == (
        "RuntimeError: get_combine_input_buffer called before dispatch"
    )
    assert out["names_differ"].startswith(
        "ValueError: max_tokens_per_rank=2 and runtime_max_tokens_per_rank=3 differ"
    )
    assert out["above_capacity"] == (
        f"ValueError: runtime_max_tokens_per_rank={TOKENS + 1} must be in (0, {TOKENS}]"
    )
    assert out["buffer"] == [[TOKENS, HIDDEN], "torch.bfloat16"] and out["same_buffer"]
    assert out["too_wide"].startswith("ValueError: a torch.float32 combine input needs")
    assert out["error"] == 0.0
    assert out["after_destroy"] == "RuntimeError: NVLinkOneSidedAlltoAll has been destroyed"
