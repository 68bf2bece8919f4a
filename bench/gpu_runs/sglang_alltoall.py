"""SGLang's sizing against the adapter's, on FlashInfer 0.7.2.post1, DeepSeek-V3 shapes.

Run by ``bench/gpu_runs/sglang.sh`` on the GPU machine (EP ranks share its
GPUs: rank r on ``cuda:r % count``). SGLang itself cannot travel there (see
docs/sglang.md), so its dispatcher objects are stood in for by
:class:`SglangLayer`: the attributes SGLang's ``FlashinferDispatcher.__init__``
sets and the adapter reads, with SGLang's own size from the pure rule. What
runs for real: the adapter's
:class:`~moe_sidecar.client.engines.sglang.workspaces.NamespaceWorkspaces`
(one manager per namespace, the namespace padding, embedded mode), FlashInfer's
``MoeAlltoAll`` built by the client's backend, and SGLang's call form on it
(``dispatch(topk_ids, payloads, runtime_max, invalid_token_expert_id=,
expert_id_payload_index=)``, ``combine(payload, runtime_max,
payload_in_workspace=False)``), checked exactly against a CPU prediction.
In the same run, FlashInfer's ``MoeAlltoAll`` at SGLang's own sizes, for the
device memory beside ours.

    python3 bench/gpu_runs/sglang_alltoall.py --ep 8 --tokens 4096 --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import start_processes

HIDDEN, TOP_K, EXPERTS = 7168, 8, 256
TARGET_LAYERS = 3
"""The target's MoE layers proposed (every one NVFP4: the first builds, the rest are covered)."""


class _SglangDispatchType(enum.Enum):
    BF16 = 0
    NVFP4 = 1


@dataclass
class SglangLayer:
    """What SGLang's ``FlashinferDispatcher.__init__`` sets that the adapter reads."""

    cpu_group: Any
    ep_size: int
    max_num_tokens: int
    quant_config: dict[str, Any]
    decode_a2a_namespace: int
    engine_workspace_size: int
    router_topk: int = TOP_K
    num_experts: int = EXPERTS
    hidden_size: int = HIDDEN
    dispatch_type: _SglangDispatchType = _SglangDispatchType.NVFP4
    sp_prefill_moe_a2a: Any = None
    moe_a2a: Any = field(default=None, repr=False)


def _free_bytes() -> int:
    if not torch.cuda.is_available():
        return 0  # --cpu: nothing to read
    return sum(torch.cuda.mem_get_info(d)[0] for d in range(torch.cuda.device_count()))


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _measured(ep: int, build: Any) -> tuple[Any, int]:
    """Runs ``build()`` on every rank; returns its value and the device bytes
    it took per rank (rank 0's reading of every GPU's free memory)."""
    _synchronize()
    dist.barrier()
    before = _free_bytes()
    dist.barrier()
    value = build()
    _synchronize()
    dist.barrier()
    after = _free_bytes()
    dist.barrier()
    return value, (before - after) // ep


def _routing(rank: int, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7 + rank)
    ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(count)])
    weights = torch.rand(count, TOP_K, generator=generator)
    return ids.to(torch.int32).to(device), weights.to(device)


def _round_trip(handle: Any, rank: int, ep: int, tokens: int, nvfp4: bool) -> bool:
    """SGLang's dispatch + combine on ``handle``; exact against the CPU prediction."""
    from moe_sidecar.client.backends.reference_alltoall import expert_owner

    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    ids, weights = _routing(rank, tokens, device)
    generator = torch.Generator().manual_seed(100 + rank)
    if nvfp4:  # NVFP4 rows as SGLang sends them: packed values and scales, uint8
        x = torch.randint(0, 256, (tokens, HIDDEN // 2), generator=generator, dtype=torch.uint8)
        sf = torch.randint(0, 256, (tokens, HIDDEN // 16), generator=generator, dtype=torch.uint8)
        payloads = [x.to(device), sf.to(device), ids, weights]
        index = 2
    else:
        x = torch.randn(tokens, HIDDEN, generator=generator).to(torch.bfloat16)
        payloads = [x.to(device), ids, weights]
        index = 1
    received = handle.dispatch(
        ids, payloads, tokens, invalid_token_expert_id=EXPERTS, expert_id_payload_index=index
    )
    owners = expert_owner(ids.cpu(), EXPERTS, ep)
    distinct = torch.tensor([len(set(r.tolist())) for r in owners], dtype=torch.float32)
    if nvfp4:
        # Expert output: (this rank + 1) in every row; a token gets the sum over its ranks.
        out = torch.full((ep, tokens, HIDDEN), float(rank + 1), dtype=torch.bfloat16, device=device)
        combined = handle.combine(out, tokens, payload_in_workspace=False)
        rank_sum = torch.tensor(
            [float(sum(set(r.tolist())) + len(set(r.tolist()))) for r in owners]
        )
        expected = rank_sum.unsqueeze(1).expand(tokens, HIDDEN).to(torch.bfloat16)
    else:
        combined = handle.combine(received[0].clone(), tokens, payload_in_workspace=False)
        expected = (x.to(torch.float32) * distinct.unsqueeze(1)).to(torch.bfloat16)
    return bool(torch.equal(combined.cpu(), expected))


def _adapter(rank: int, ep: int, tokens: int, backend_name: str) -> dict[str, Any]:
    """The adapter's namespaces built (target, then draft), measured, and round-tripped."""
    from moe_sidecar.client.engines.sglang.naming import SglangLayout
    from moe_sidecar.client.engines.sglang.sizing import Namespace
    from moe_sidecar.client.engines.sglang.workspaces import NamespaceWorkspaces

    def layer(namespace: Namespace, quant: dict[str, Any]) -> SglangLayer:
        return SglangLayer(
            dist.group.WORLD, ep, tokens, quant, int(namespace), _sglang_bytes(ep, tokens)
        )

    layout = SglangLayout("deepseek-ai/DeepSeek-V3", "modelopt_fp4", ep, 1, ep, ep, 0, draft=False)
    workspaces = NamespaceWorkspaces(environ={}, backend=backend_name)
    target = [
        layer(Namespace.DECODE, {"input_global_scale": torch.ones(1)}) for _ in range(TARGET_LAYERS)
    ]
    for d in target:
        workspaces.add(d)
    started = time.perf_counter()
    target_sizes, target_bytes = _measured(
        ep, lambda: workspaces.size_after_load(layout, {}, startup_overlap=False)
    )
    seconds = time.perf_counter() - started
    draft = layer(Namespace.SPECULATIVE, {})
    draft.dispatch_type = _SglangDispatchType.BF16
    workspaces.add(draft)
    draft_layout = dataclasses.replace(layout, draft=True)
    draft_sizes, draft_bytes = _measured(
        ep, lambda: workspaces.size_after_load(draft_layout, {}, startup_overlap=False)
    )
    workspaces.seal()
    exact = {
        "target_nvfp4": _round_trip(target[0].moe_a2a, rank, ep, tokens, nvfp4=True),
        "draft_bf16": _round_trip(draft.moe_a2a, rank, ep, tokens, nvfp4=False),
    }
    groups = list(workspaces.groups)
    workspaces.cleanup()
    (decode,) = target_sizes.values()
    (speculative,) = draft_sizes.values()
    return {
        "groups": groups,
        "target_bytes": decode.exact_bytes_per_rank,
        "draft_bytes": speculative.exact_bytes_per_rank,
        "measured": (target_bytes, draft_bytes),
        "exact": exact,
        "seconds": seconds,
    }


def _sglang_bytes(ep: int, tokens: int) -> int:
    from moe_sidecar.client.engines.sglang.sizing import (
        DispatchType,
        Namespace,
        engine_workspace_bytes,
    )

    return engine_workspace_bytes(
        ep, tokens, HIDDEN, TOP_K, DispatchType.NVFP4, Namespace.DECODE, eagle=True
    )


def _sglang_own(rank: int, ep: int, tokens: int, backend_name: str) -> tuple[int, bool]:
    """FlashInfer's MoeAlltoAll at SGLang's own sizes (decode and speculative):
    the device bytes per rank and whether SGLang's call form was exact on it."""
    from moe_sidecar.client.backends import BuildSpec, backend_for
    from moe_sidecar.core.layer import layer_capacities

    world = dist.group.WORLD
    assert world is not None
    backend = backend_for(backend_name, world)
    capacities = layer_capacities(tokens, TOP_K, EXPERTS, HIDDEN, 2 * HIDDEN)
    size = _sglang_bytes(ep, tokens)

    def build() -> list[Any]:
        return [backend.build(BuildSpec(ep, rank, capacities, size + 128 * ns)) for ns in (0, 1)]

    own, own_bytes = _measured(ep, build)
    exact = _round_trip(own[0], rank, ep, tokens, nvfp4=True)
    for handle in own:
        backend.release(handle)
    return own_bytes, exact


def _rank(rank: int, ep: int, tokens: int, init: str, out: str, backend_name: str) -> None:
    if backend_name == "flashinfer":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        torch.zeros(1, device="cuda")  # the CUDA context, before any reading
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ep)
    ours = _adapter(rank, ep, tokens, backend_name)
    own_bytes, own_exact = _sglang_own(rank, ep, tokens, backend_name)
    dist.barrier()
    if rank == 0:
        mib = 1 << 20
        target_bytes, draft_bytes = ours["measured"]
        result = {
            "ep": ep,
            "tokens_per_rank": tokens,
            "groups": ours["groups"],
            "adapter_target_bytes_per_rank": ours["target_bytes"],
            "adapter_draft_bytes_per_rank": ours["draft_bytes"],
            "sglang_bytes_per_rank_each": [_sglang_bytes(ep, tokens) + 128 * ns for ns in (0, 1)],
            "measured_device_mib_per_rank": {
                "adapter_target": target_bytes / mib,
                "adapter_draft": draft_bytes / mib,
                "adapter_total": (target_bytes + draft_bytes) / mib,
                "sglang_own_total": own_bytes / mib,
            },
            "saved_mib_per_rank_measured": (own_bytes - target_bytes - draft_bytes) / mib,
            "exact": ours["exact"],
            "sglang_own_exact": own_exact,
            "target_first_build_seconds": ours["seconds"],
        }
        print(json.dumps(result, indent=2))
        Path(out, f"sglang-{backend_name}-ep{ep}.json").write_text(json.dumps(result, indent=2))
    if not (all(ours["exact"].values()) and own_exact):
        raise SystemExit(f"rank {rank}: a combine differs from the CPU prediction")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument(
        "--cpu", action="store_true", help="the reference backend on CPU (a check of the script)"
    )
    args = parser.parse_args()
    init = f"file://{tempfile.mkdtemp()}/rendezvous"
    backend = "reference" if args.cpu else "flashinfer"
    start_processes(
        _rank,
        args=(args.ep, args.tokens, init, args.out, backend),
        nprocs=args.ep,
        start_method="spawn",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
