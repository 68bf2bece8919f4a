"""Device memory after growth: moe-sidecar's manager vs vLLM 0.33's own sequence (2 GPUs).

The same layers, vLLM 0.33's way (``initialize(..., dispatch_format=...)``):
an NVFP4 base MoE layer, then a bf16 MTP layer (DeepSeek-V3 shapes: hidden
7168, top_k 8, 256 experts, EP 2), at ``--tokens`` tokens per rank.

* **vLLM 0.33**: FlashInfer's ``flashinfer.moe_ep`` calls exactly as vLLM
  0.33's ``FlashInferNVLinkOneSidedManager.initialize`` makes them (its lines
  are quoted where they are mirrored; vLLM itself cannot travel to the GPU
  machine): ``create_communication`` for the first layer; for the growth,
  ``destroy()`` of the old object between two barriers, then
  ``create_communication`` again.
* **moe-sidecar**: ``WorkspaceManager`` (FlashInfer backend, embedded mode),
  ``initialize()`` with the same arguments, then ``get_communication()``.

Each runs in its own pair of processes (FlashInfer's workspace cache is
per process). Measured per rank: device memory taken outside PyTorch's
caching allocator (``cudaMemGetInfo`` minus PyTorch's reserved bytes) after
each layer, the entries left in ``MoeAlltoAll._WORKSPACE_CACHE``, the
workspace sizes FlashInfer computed (which must equal the manager's), and one
exact dispatch + combine of the bf16 layer after growth.

Run on a machine with 2 CUDA GPUs and flashinfer-python 0.7.2.post1, from the
repository root (README, "GPU tests" has the install line)::

    python3 bench/vllm_gpu_bench.py --out "$OUT"      # writes vllm-memory.{json,md} there

``--out`` defaults to ``$OUT``, else ``bench/results/gpu``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moe_sidecar.flashinfer.v0_7_2_post1 import workspace_size_per_rank  # noqa: E402
from tests.exchange import round_trip  # noqa: E402
from tests.gpu import workers  # noqa: E402
from tests.gpu.workers import world  # noqa: E402
from tests.multiprocess.harness import run_ranks  # noqa: E402

HIDDEN, TOP_K, NUM_EXPERTS = 7168, 8, 256
LAYERS = (("model.layers.3.mlp (NVFP4)", "NVFP4"), ("mtp.0.mlp (bf16)", "BF16"))
GiB = 1 << 30


def _cache() -> dict[Any, Any]:
    from flashinfer.comm.trtllm_moe_alltoall import MoeAlltoAll

    return MoeAlltoAll._WORKSPACE_CACHE  # type: ignore[no-any-return]


def _exact_bf16_step(communication: Any, rank: int, world_size: int, tokens: int) -> dict[str, Any]:
    import torch

    return round_trip(
        communication,
        rank=rank,
        ep_size=world_size,
        hidden=HIDDEN,
        top_k=TOP_K,
        num_experts=NUM_EXPERTS,
        tokens=min(tokens, 512),
        quantized=False,
        device=torch.device("cuda", rank),
    )


class Vllm033Manager:
    """vLLM 0.33's ``FlashInferNVLinkOneSidedManager`` (``all2all.py``), its
    ``initialize()`` line for line (quoted where mirrored; vLLM itself cannot
    travel to the GPU machine), over FlashInfer's ``flashinfer.moe_ep``.

    ``moe_ep``: the module whose ``BootstrapConfig``, ``MoEEpCommParams``,
    ``NVLinkOneSidedAlltoAll``, ``NVLinkOneSidedConfig`` and
    ``create_communication`` it calls (default: FlashInfer's, imported on
    first use); a CPU run may pass a stand-in with the same names.
    ``initialize()`` returns True when it made a new communication object
    (vLLM's returns None), False on vLLM's early return.
    """

    def __init__(self, cpu_group: Any, moe_ep: Any = None) -> None:
        import torch.distributed as dist

        self.cpu_group = cpu_group
        self.world_size = dist.get_world_size(cpu_group)
        self.rank = dist.get_rank(cpu_group)
        self._moe_ep = moe_ep
        self.initialized = False
        self.communication: Any = None
        self.top_k = 0
        self.num_experts = 0

    def initialize(
        self,
        max_num_tokens: int,
        top_k: int,
        num_experts: int,
        hidden_size: int,
        dispatch_format: Any = None,
        extra_payload_bytes_per_token: int = 0,
    ) -> bool:
        from dataclasses import replace

        import torch
        import torch.distributed as dist

        from moe_sidecar.client.backends.communicator import GroupCommunicator

        # vLLM: from flashinfer.moe_ep import BootstrapConfig, MoEEpCommParams,
        #     NVLinkOneSidedAlltoAll, NVLinkOneSidedConfig, create_communication
        moe_ep = self._moe_ep or importlib.import_module("flashinfer.moe_ep")
        if self.initialized:
            assert top_k == self.top_k, "heterogeneous top_k"
            assert num_experts == self.num_experts, "heterogeneous num_experts"
        if extra_payload_bytes_per_token < 0:
            raise ValueError("extra_payload_bytes_per_token must be non-negative")
        # params = MoEEpCommParams(num_experts=num_experts, top_k=top_k,
        #     max_tokens_per_rank=max_num_tokens, hidden_size=hidden_size,
        #     dtype=torch.bfloat16, dispatch_format=dispatch_format)
        params = moe_ep.MoEEpCommParams(
            num_experts=num_experts,
            top_k=top_k,
            max_tokens_per_rank=max_num_tokens,
            hidden_size=hidden_size,
            dtype=torch.bfloat16,
            dispatch_format=dispatch_format,
        )
        communication = self.communication
        if communication is not None:
            # previous_max = communication.params.max_tokens_per_rank
            # previous_extra = communication.config.extra_payload_bytes_per_token
            # previous_bytes = communication.params.dispatch_bytes_per_token + previous_extra
            # dispatch_bytes = params.dispatch_bytes_per_token + extra_payload_bytes_per_token
            previous_max = communication.params.max_tokens_per_rank
            previous_extra = communication.config.extra_payload_bytes_per_token
            previous_bytes = communication.params.dispatch_bytes_per_token + previous_extra
            dispatch_bytes = params.dispatch_bytes_per_token + extra_payload_bytes_per_token
            # if (max_num_tokens <= previous_max and hidden_size <= ...hidden_size
            #         and dispatch_bytes <= previous_bytes): return
            if (
                max_num_tokens <= previous_max
                and hidden_size <= communication.params.hidden_size
                and dispatch_bytes <= previous_bytes
            ):
                return False
            # if hidden_size < communication.params.hidden_size or (hidden_size ==
            #         communication.params.hidden_size and dispatch_bytes < previous_bytes):
            #     params = communication.params
            if hidden_size < communication.params.hidden_size or (
                hidden_size == communication.params.hidden_size and dispatch_bytes < previous_bytes
            ):
                params = communication.params
            # params = replace(params, max_tokens_per_rank=max(max_num_tokens, previous_max))
            # extra_payload_bytes_per_token = (max(dispatch_bytes, previous_bytes)
            #     - params.dispatch_bytes_per_token)
            params = replace(params, max_tokens_per_rank=max(max_num_tokens, previous_max))
            extra_payload_bytes_per_token = (
                max(dispatch_bytes, previous_bytes) - params.dispatch_bytes_per_token
            )
        # bootstrap = BootstrapConfig(world_size=self.world_size, rank=self.rank,
        #     device=torch.accelerator.current_device_index(), process_group=self.cpu_group)
        bootstrap = moe_ep.BootstrapConfig(
            world_size=self.world_size,
            rank=self.rank,
            device=torch.cuda.current_device() if torch.cuda.is_available() else None,
            process_group=self.cpu_group,
        )
        # config = NVLinkOneSidedConfig(extra_payload_bytes_per_token=extra_payload_bytes_per_token,
        #     use_low_precision_combine=envs.VLLM_FLASHINFER_MOE_A2A_LOW_PRECISION_COMBINE,
        #     comm_backend=CustomCommunicator(self.cpu_group))
        # (vLLM's CustomCommunicator, vllm/distributed/device_communicators/mnnvl_compat.py,
        # is the same mpi4py-like surface over the gloo group as GroupCommunicator.)
        config = moe_ep.NVLinkOneSidedConfig(
            extra_payload_bytes_per_token=extra_payload_bytes_per_token,
            use_low_precision_combine=False,
            comm_backend=GroupCommunicator(self.cpu_group),
        )
        if communication is not None:
            # torch.accelerator.synchronize(); dist.barrier(group=self.cpu_group)
            # self.cleanup()   # -> self.communication.destroy(); self.communication = None
            # dist.barrier(group=self.cpu_group)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            dist.barrier(group=self.cpu_group)
            self.cleanup()
            dist.barrier(group=self.cpu_group)
        # torch.accelerator.empty_cache()
        # with torch.device("cpu"):
        #     replacement = create_communication(bootstrap, params, backend=config)
        # assert isinstance(replacement, NVLinkOneSidedAlltoAll)
        torch.cuda.empty_cache()
        with torch.device("cpu"):
            replacement = moe_ep.create_communication(bootstrap, params, backend=config)
        assert isinstance(replacement, moe_ep.NVLinkOneSidedAlltoAll)
        self.communication = replacement
        self.top_k = top_k
        self.num_experts = num_experts
        self.initialized = True
        # dist.barrier(group=self.cpu_group)
        dist.barrier(group=self.cpu_group)
        return True

    def get_communication(self) -> Any:
        assert self.communication is not None, "One-sided communication not initialized"
        return self.communication

    def cleanup(self) -> None:
        # if self.communication is not None:
        #     self.communication.destroy(); self.communication = None
        # self.initialized = False
        if self.communication is not None:
            self.communication.destroy()
            self.communication = None
        self.initialized = False


def _vllm_rank(rank: int, world_size: int, tokens: int) -> dict[str, Any]:
    """vLLM 0.33's FlashInferNVLinkOneSidedManager.initialize, twice, with FlashInfer's API."""
    import torch.distributed as dist
    from flashinfer.fused_moe import QuantFormat

    workers.warm_up_cuda(rank)
    unit = workers.granularity()
    start = workers.memory_mark()
    manager = Vllm033Manager(world())
    steps = []
    for label, fmt in LAYERS:
        # The first layer creates; the second must grow (vLLM would return early otherwise).
        if not manager.initialize(
            tokens,
            TOP_K,
            NUM_EXPERTS,
            HIDDEN,
            dispatch_format=QuantFormat[fmt],
            extra_payload_bytes_per_token=0,
        ):
            raise AssertionError("the bf16 layer must grow the NVFP4 workspace")
        communication = manager.get_communication()
        steps.append(
            {
                "layer": label,
                "workspace": int(communication.alltoall.workspace_size_per_rank),
                "held": workers.held_bytes_change(start),
                "cache_entries": len(_cache()),
            }
        )
    exact = _exact_bf16_step(manager.get_communication(), rank, world_size, tokens)
    dist.barrier()
    return {"steps": steps, "granularity": unit, "exact_bf16_after_growth": exact}


def _ours_rank(rank: int, world_size: int, tokens: int) -> dict[str, Any]:
    """The same two layers through moe-sidecar's manager, vLLM 0.33's call style."""
    import torch.distributed as dist
    from flashinfer.fused_moe import QuantFormat
    from flashinfer.moe_ep import NVLinkOneSidedAlltoAll

    from moe_sidecar.client import WorkspaceManager

    workers.warm_up_cuda(rank)
    unit = workers.granularity()
    start = workers.memory_mark()
    manager = WorkspaceManager(world(), target="embedded", backend="flashinfer")
    steps = []
    for label, fmt in LAYERS:
        manager.initialize(
            max_num_tokens=tokens,
            top_k=TOP_K,
            num_experts=NUM_EXPERTS,
            hidden_size=HIDDEN,
            dispatch_format=QuantFormat[fmt],
            extra_payload_bytes_per_token=0,
            layer=label,
        )
        communication = manager.get_communication()
        assert isinstance(communication, NVLinkOneSidedAlltoAll)
        steps.append(
            {
                "layer": label,
                "workspace": int(communication.alltoall.workspace_size_per_rank),
                "manager_workspace": manager.workspace_size,
                "held": workers.held_bytes_change(start),
                "cache_entries": len(_cache()),
            }
        )
    exact = _exact_bf16_step(manager.get_communication(), rank, world_size, tokens)
    unreleased = manager.backend.unreleased  # type: ignore[attr-defined]
    manager.destroy()
    after_destroy = workers.held_bytes_change(start)
    dist.barrier()
    return {
        "steps": steps,
        "granularity": unit,
        "exact_bf16_after_growth": exact,
        "unreleased": unreleased,
        "held_after_destroy": after_destroy,
    }


def _expected(tokens: int, ep: int) -> tuple[int, int]:
    """NVFP4 and bf16 workspaces as vLLM 0.33 + FlashInfer size them (pure Python)."""
    nvfp4_row = (HIDDEN + 1) // 2 + (HIDDEN + 15) // 16
    nvfp4 = workspace_size_per_rank(ep, tokens, nvfp4_row + 8 * TOP_K, 2 * HIDDEN)
    bf16 = workspace_size_per_rank(ep, tokens, 2 * HIDDEN + 8 * TOP_K, 2 * HIDDEN)
    return nvfp4, bf16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 8192])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT") or ROOT / "bench" / "results" / "gpu"),
        help="directory for vllm-memory.json and vllm-memory.md (default: $OUT)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import flashinfer
    import torch

    machine = (
        f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
        f"flashinfer {flashinfer.__version__}"
    )
    print(machine)
    report: dict[str, Any] = {"machine": machine, "runs": []}
    ok = True
    for tokens in args.tokens:
        runs = {}
        for name, fn in (("vllm-0.33", _vllm_rank), ("moe-sidecar", _ours_rank)):
            with tempfile.TemporaryDirectory() as tmp:
                runs[name] = run_ranks(
                    fn,
                    2,
                    timeout=540,
                    tmp_path=Path(tmp),
                    args=(tokens,),
                    envs=[{"NCCL_NVLS_ENABLE": "0"}] * 2,
                )
        nvfp4, bf16 = _expected(tokens, 2)
        vllm, ours = runs["vllm-0.33"][0], runs["moe-sidecar"][0]
        unit = ours["granularity"]
        checks = {
            "sizes equal FlashInfer's, both sides": [s["workspace"] for s in vllm["steps"]]
            == [s["workspace"] for s in ours["steps"]]
            == [s["manager_workspace"] for s in ours["steps"]]
            == [nvfp4, bf16],
            "moe-sidecar holds the union only": ours["steps"][-1]["held"]
            == workers.aligned(bf16, unit),
            "vLLM 0.33 holds both workspaces": vllm["steps"][-1]["held"]
            == workers.aligned(nvfp4, unit) + workers.aligned(bf16, unit),
            "cache entries (ours, vLLM)": (
                ours["steps"][-1]["cache_entries"],
                vllm["steps"][-1]["cache_entries"],
            )
            == (1, 2),
            "both exact after growth": all(
                r["exact_bf16_after_growth"]["max_error"] == 0.0
                and r["exact_bf16_after_growth"]["bad_rows"] == 0
                for side in runs.values()
                for r in side
            ),
            "moe-sidecar frees everything on destroy()": ours["held_after_destroy"] == 0
            and ours["unreleased"] == 0,
        }
        ok &= all(checks.values())
        report["runs"].append(
            {"tokens": tokens, "expected": [nvfp4, bf16], "runs": runs, "checks": checks}
        )
        print(f"\n--- {tokens} tokens per rank, EP 2 ---")
        for side in ("vllm-0.33", "moe-sidecar"):
            for step in runs[side][0]["steps"]:
                print(
                    f"{side:12s} after {step['layer']:28s}: workspace {step['workspace']:>13,d} B, "
                    f"device memory held {step['held'] / 2**20:10.1f} MiB, "
                    f"{step['cache_entries']} cache entries"
                )
        kept = vllm["steps"][-1]["held"] - ours["steps"][-1]["held"]
        print(f"kept for nothing by vLLM 0.33's sequence: {kept / 2**20:.1f} MiB per GPU")
        for name, passed in checks.items():
            print(f"  [{'ok' if passed else 'FAILED'}] {name}")
    # The EP 8 figure, by the same arithmetic (no 8-GPU run here).
    nvfp4_ep8, _ = _expected(8192, 8)
    report["ep8_8192_tokens_superseded_bytes"] = nvfp4_ep8
    print(
        f"\nEP 8, 8192 tokens (arithmetic): the superseded NVFP4 workspace is {nvfp4_ep8:,d} B "
        f"= {nvfp4_ep8 / GiB:.2f} GiB per GPU"
    )
    (args.out / "vllm-memory.json").write_text(json.dumps(report, indent=2, default=str))
    lines = [
        "# Device memory after growth: moe-sidecar vs vLLM 0.33's sequence",
        "",
        f"Machine: {machine}. Command: `python3 bench/vllm_gpu_bench.py --out <dir>`.",
        "Layers (vLLM 0.33 call style): NVFP4 then bf16 MTP; hidden 7168, top_k 8, 256 experts, EP 2.",
        "",
        "| tokens/rank | side | after NVFP4: held | after bf16 MTP: held | cache entries | exact after growth |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for run in report["runs"]:
        for side in ("vllm-0.33", "moe-sidecar"):
            first, last = (s["held"] for s in run["runs"][side][0]["steps"])
            exact = run["runs"][side][0]["exact_bf16_after_growth"]["max_error"] == 0.0
            entries = run["runs"][side][0]["steps"][-1]["cache_entries"]
            lines.append(
                f"| {run['tokens']} | {side} | {first / 2**20:.1f} MiB | {last / 2**20:.1f} MiB "
                f"| {entries} | {'yes' if exact else 'NO'} |"
            )
    lines += [
        "",
        f"EP 8 at 8192 tokens (arithmetic): vLLM 0.33 keeps the superseded NVFP4 workspace, "
        f"{nvfp4_ep8:,d} B ({nvfp4_ep8 / GiB:.2f} GiB) per GPU.",
        "",
        "Checks: "
        + "; ".join(
            f"{name} at {run['tokens']}: {'ok' if passed else 'FAILED'}"
            for run in report["runs"]
            for name, passed in run["checks"].items()
        ),
    ]
    (args.out / "vllm-memory.md").write_text("\n".join(lines) + "\n")
    print(f"\nwrote {args.out / 'vllm-memory.json'} and {args.out / 'vllm-memory.md'}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
