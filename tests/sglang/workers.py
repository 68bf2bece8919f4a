"""What each rank of the SGLang tests runs: SGLang's own code, our plugin, a real sidecar.

One rank (of 2 on gloo), in order:

1. SGLang's ``load_plugins()``: it finds our ``sglang.srt.plugins`` entry point;
2. SGLang's ``ServerArgs`` for DeepSeek-V3 (a config.json only) with the
   FlashInfer all-to-all, DP attention over the EP group, NVFP4 dispatch,
   published as SGLang's scheduler does; MTP as ``NEXTN`` in its spec config;
3. the target's MoE layers built by SGLang's ``create_moe_dispatcher`` (NVFP4
   quant config, as ModelOpt's loader sets it), then our AFTER-load hook;
   then the draft's layer (``speculative_context``, bf16) and the hook again;
4. SGLang's own ``dispatch()`` and ``combine()`` of the draft's layer (bf16
   rows) on what the manager built (the reference backend);
5. a layer loaded with SGLang's startup overlap: sized for bf16 rows;
6. our BEFORE-graph-capture hook, then a target layer needing more: refused.

There is no ``ModelRunner`` (it loads weights): the hooks SGLang registered
on its methods are checked to be in place, and called with what they read
of a runner (its model's modules, model config, draft flag, startup overlap).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

TARGET_LAYERS = 3
TOKENS_PER_RANK = (5, 3)
"""Tokens each rank dispatches in the end-to-end step."""


def _server_args(model_dir: str, ep: int) -> Any:
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=model_dir,
        device="cpu",
        tp_size=ep,
        dp_size=ep,
        ep_size=ep,
        enable_dp_attention=True,
        moe_a2a_backend="flashinfer",
        moe_runner_backend="flashinfer_cutlass",
        chunked_prefill_size=256,
        disable_cuda_graph=True,
        skip_server_warmup=True,
    )


@contextlib.contextmanager
def _sglang_context(rank: int, model_dir: str, ep: int) -> Iterator[None]:
    import torch.distributed as dist
    from sglang.srt import runtime_context
    from sglang.srt.layers.moe.utils import initialize_moe_config

    runtime_context.publish(_server_args(model_dir, ep), role="scheduler")
    initialize_moe_config()
    # SGLang's tp group coordinator: the EP group's device group (gloo here)
    # and its CPU group.
    tp_group = SimpleNamespace(device_group=dist.group.WORLD, cpu_group=dist.group.WORLD)
    with (
        runtime_context.get_parallel().override(tp_group=tp_group, moe_ep_rank=rank, pp_rank=0),
        runtime_context.get_spec().override(speculative_algorithm="NEXTN"),
    ):
        yield


def _layers(dispatchers: list[Any]) -> Any:
    import torch

    class MoeLayer(torch.nn.Module):
        def __init__(self, dispatcher: Any) -> None:
            super().__init__()
            self.dispatcher = dispatcher

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(MoeLayer(d) for d in dispatchers)
    return model


def _runner(model: Any, model_dir: str, *, draft: bool) -> Any:
    config = SimpleNamespace(model_path=model_dir, quantization="modelopt_fp4")
    return SimpleNamespace(
        model=model, model_config=config, is_draft_worker=draft, startup_weight_load=None
    )


def _dispatchers(count: int, quant_config: dict[str, Any]) -> list[Any]:
    from sglang.srt.layers.moe.fused_moe_triton.layer import create_moe_dispatcher
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    from tests.sglang.model_config import HIDDEN, NUM_EXPERTS, TOP_K

    config = MoeRunnerConfig(
        num_experts=NUM_EXPERTS,
        num_local_experts=NUM_EXPERTS // 2,
        hidden_size=HIDDEN,
        top_k=TOP_K,
        num_fused_shared_experts=0,
    )
    made = [create_moe_dispatcher(config, None) for _ in range(count)]
    for dispatcher in made:
        dispatcher.set_quant_config(dict(quant_config))
    return made


def _groups() -> dict[str, dict[str, Any]]:
    from moe_sidecar.client.engines.sglang import plugin

    return {
        name: {
            "workspace_size": manager.workspace_bytes,
            "dispatch_bytes": manager.plan.capacities.dispatch_bytes_per_token,
            "combine_bytes": manager.plan.capacities.combine_bytes_per_token,
            "max_tokens": manager.plan.capacities.max_tokens,
            "generation": manager.generation,
            "builds": manager.counters.builds,
            "rebuilds": manager.counters.rebuilds,
        }
        for name, manager in plugin.workspaces().groups.items()
        if manager.plan is not None
    }


def _end_to_end(rank: int, dispatcher: Any) -> dict[str, Any]:
    """SGLang's dispatch() and combine() of a bf16 layer, the experts an identity."""
    import torch
    from sglang.srt.layers.dp_attention import set_dp_buffer_len
    from sglang.srt.layers.moe.token_dispatcher.flashinfer import FlashinferCombineInput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from moe_sidecar.client.backends.reference_alltoall import expert_owner
    from tests.sglang.model_config import HIDDEN, NUM_EXPERTS, TOP_K

    count = TOKENS_PER_RANK[rank]
    set_dp_buffer_len(sum(TOKENS_PER_RANK), count, False, global_num_tokens=list(TOKENS_PER_RANK))
    generator = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(count, HIDDEN, generator=generator).to(torch.bfloat16)
    ids = torch.stack(
        [torch.randperm(NUM_EXPERTS, generator=generator)[:TOP_K] for _ in range(count)]
    ).to(torch.int32)
    weights = torch.rand(count, TOP_K, generator=generator)
    routed = StandardTopKOutput(weights, ids, torch.zeros(count, NUM_EXPERTS))
    dispatched = dispatcher.dispatch(x, routed)
    received = dispatched.hidden_states
    combined = dispatcher.combine(FlashinferCombineInput(received.clone()))
    # FlashInfer's combine sums one expert output per distinct rank a token went to.
    ranks = expert_owner(ids, NUM_EXPERTS, dispatcher.ep_size)
    distinct = torch.tensor([len(set(row.tolist())) for row in ranks], dtype=torch.float32)
    expected = (x.to(torch.float32) * distinct.unsqueeze(1)).to(torch.bfloat16)
    return {
        "dispatch_rows": list(received.shape),
        "dispatch_dtype": str(received.dtype),
        "combined_equal": bool(torch.equal(combined, expected)),
        "combined_shape": list(combined.shape),
    }


def sglang_rank(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    from sglang.srt.layers.moe.fused_moe_triton import layer as fused_moe_layer
    from sglang.srt.layers.moe.token_dispatcher import flashinfer as sglang_flashinfer
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.runtime_context import get_flags

    from moe_sidecar.client.engines.sglang import plugin
    from moe_sidecar.client.engines.sglang.workspaces import WorkspaceSealed

    replaced = sglang_flashinfer.FlashinferDispatcher
    result: dict[str, Any] = {
        "replaced": bool(getattr(replaced, "moe_sidecar_defers", False)),
        "factory_module_sees_it": fused_moe_layer.FlashinferDispatcher is replaced,
        "load_model_hooked": hasattr(ModelRunner.load_model, "__wrapped__"),
        "init_cuda_graphs_hooked": hasattr(ModelRunner.init_cuda_graphs, "__wrapped__"),
    }
    with _sglang_context(rank, model_dir, world_size):
        import torch

        target = _dispatchers(TARGET_LAYERS, {"input_global_scale": torch.ones(1)})
        result["target_is_ours"] = all(type(d) is replaced for d in target)
        result["sglang_target_size"] = target[0].workspace_size
        result["sglang_max_tokens"] = target[0].max_num_tokens
        target_runner = _runner(_layers(target), model_dir, draft=False)
        plugin.after_load_model(None, target_runner)
        result["after_target"] = _groups()
        with get_flags().moe.override(speculative_context=True):
            draft = _dispatchers(1, {"weight_dtype": torch.bfloat16})
        result["sglang_draft_size"] = draft[0].workspace_size
        result["draft_namespace"] = int(draft[0].decode_a2a_namespace)
        plugin.after_load_model(None, _runner(_layers(draft), model_dir, draft=True))
        result["groups"] = _groups()
        managers = plugin.workspaces().groups
        result["installed"] = sorted(
            name
            for name, manager in managers.items()
            for d in target + draft
            if d.moe_a2a is manager.moe_alltoall
        )
        result["end_to_end"] = _end_to_end(rank, draft[0])

        # SGLang's startup overlap (weights after graph capture): an NVFP4
        # layer is sized for bf16 rows. Its own group, by MOE_SIDECAR_GROUP.
        os.environ["MOE_SIDECAR_GROUP"] = "overlap"
        overlapped = _runner(
            _layers(_dispatchers(1, {"input_global_scale": torch.ones(1)})), model_dir, draft=False
        )
        overlapped.startup_weight_load = object()
        plugin.after_load_model(None, overlapped)
        del os.environ["MOE_SIDECAR_GROUP"]
        result["before_seal"] = _groups()
        result["overlap"] = result["before_seal"].get("overlap/decode")

        plugin.before_cuda_graphs(target_runner)
        wider = _dispatchers(1, {})
        try:
            plugin.after_load_model(None, _runner(_layers(wider), model_dir, draft=False))
            result["sealed_refusal"] = None
        except WorkspaceSealed as error:
            result["sealed_refusal"] = str(error)
        result["after_refusal"] = _groups()
        plugin.workspaces().cleanup()
    result["pid"] = os.getpid()
    return result
