"""GPU figures for FlashInfer's MoeAlltoAll driven by moe-sidecar (2 GPUs).

Run on a machine with 2 CUDA GPUs and flashinfer-python 0.7.2.post1, from the
repository root (README's "GPU tests" section has the install line)::

    python3 bench/gpu_bench.py [--iterations 200] [--rounds 300]

It spawns 2 ranks and prints, from rank 0:

* the import of FlashInfer's all-to-all module, the first construction of a
  MoeAlltoAll in the process (loading the compiled module, the collective
  workspace allocation), both "warm": the JIT-compiled
  module on disk (the cold compile is timed by the sizing-parity run, see
  bench/results/gpu/sizing-parity.md);
* rebuild time at the union size, and the release of the superseded one;
* per-layer coordination overhead of a REUSE round: through the sidecar
  (Unix socket, node-local group: one RPC, no collective), in embedded mode
  (in-process core + the EP all-gather), next to the bare in-process
  decision (the pure core alone) measured in the same run, as ratios;
* dispatch + combine time of the NVFP4 layer on its own workspace and on the
  grown union workspace (ratio), and of the bf16 layer after growth.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moe_sidecar import flashinfer as _flashinfer  # noqa: E402
from moe_sidecar.core import limits as _limits  # noqa: E402
from moe_sidecar.flashinfer.v0_7_2_post1 import capacities_workspace_bytes  # noqa: E402
from tests.gpu import workers  # noqa: E402
from tests.gpu.workers import world  # noqa: E402
from tests.multiprocess.harness import run_ranks, running_sidecar  # noqa: E402

CEILING = _limits.WorkspaceCeiling(_limits.DEFAULT_MAX_WORKSPACE_BYTES, _flashinfer.workspace_size)

GROUP = "gpu-bench:nvfp4+bf16-mtp/ep2/pp0"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _time_round_trips(a2a: Any, layer: workers.Layer, rank: int, iterations: int) -> float:
    """Mean seconds of one dispatch + combine, CUDA-event timed."""
    import torch

    device = torch.device("cuda", rank)
    experts = workers.selected_experts(rank).to(device)
    weights = torch.full((workers.TOKENS, workers.TOP_K), 0.5, device=device)
    if layer.quantized:
        x = torch.randint(0, 255, (workers.TOKENS, workers.HIDDEN // 2), dtype=torch.uint8)
        sf = torch.randint(0, 255, (workers.TOKENS, workers.HIDDEN // 16), dtype=torch.uint8)
        payloads = [x.to(device), sf.to(device), experts, weights]
    else:
        payloads = [torch.ones(workers.TOKENS, workers.HIDDEN, dtype=torch.bfloat16, device=device)]
        payloads += [experts, weights]
    expert_out = torch.ones(2, workers.TOKENS, workers.HIDDEN, dtype=torch.bfloat16, device=device)

    def once() -> None:
        a2a.dispatch(experts, payloads, workers.TOKENS)
        a2a.combine(expert_out, workers.TOKENS)

    for _ in range(20):
        once()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        once()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / 1000.0 / iterations


def _reuse_round_seconds(manager: Any, rounds: int) -> list[float]:
    """Seconds of each REUSE initialize() (the NVFP4 layer, already covered)."""
    import torch.distributed as dist

    samples = []
    for i in range(rounds):
        dist.barrier()  # start every round together, as layers do
        started = time.perf_counter()
        manager.initialize(
            workers.TOKENS,
            workers.TOP_K,
            workers.NUM_EXPERTS,
            workers.HIDDEN,
            workers.NVFP4.x_bytes_per_token,
            workers.NVFP4.x_sf_bytes_per_token,
            layer=f"model.layers.{i}.mlp",
        )
        samples.append(time.perf_counter() - started)
    return samples


def _bare_core_seconds(rounds: int) -> list[float]:
    """The in-process decision alone: policy.propose for a 1-rank group."""
    from moe_sidecar.core import policy
    from moe_sidecar.core.group import GroupState, Proposal, Requirement
    from moe_sidecar.core.plan import Capacities

    requirement = Requirement(
        Capacities(workers.TOKENS, 100, 200, workers.TOP_K, workers.NUM_EXPERTS)
    )
    state: GroupState | None = None
    samples = []
    for n in range(1, rounds + 1):
        proposal = Proposal("bench", 2, 0, 1, "life", n, requirement)
        started = time.perf_counter()
        state = policy.propose(state, proposal, float(n), 60.0, ceiling=CEILING).state
        samples.append(time.perf_counter() - started)
    return samples


def _bench_rank(rank: int, world_size: int, target: str, iterations: int, rounds: int) -> Any:
    import torch.distributed as dist

    from moe_sidecar.client import WorkspaceManager, sizing
    from moe_sidecar.client.backends import BuildSpec
    from moe_sidecar.client.backends.flashinfer import FlashInferBackend

    workers.warm_up_cuda(rank)
    out: dict[str, Any] = {}

    def spec(layer: workers.Layer) -> BuildSpec:
        capacities = sizing.layer_capacities(
            world_size,
            workers.TOKENS,
            workers.TOP_K,
            workers.NUM_EXPERTS,
            workers.HIDDEN,
            layer.x_bytes_per_token,
            layer.x_sf_bytes_per_token,
        )
        return BuildSpec(
            world_size, rank, capacities, capacities_workspace_bytes(capacities, world_size)
        )

    def load_flashinfer() -> None:
        import flashinfer.comm.trtllm_moe_alltoall  # noqa: F401

    _, out["import_s"] = workers.timed(load_flashinfer)
    dist.barrier()
    backend = FlashInferBackend(world())
    small, first_build = workers.timed(lambda: backend.build(spec(workers.NVFP4)))
    out["first_construction_s"] = first_build

    out["nvfp4_on_nvfp4_workspace_s"] = _time_round_trips(small, workers.NVFP4, rank, iterations)
    dist.barrier()
    union, rebuild = workers.timed(lambda: backend.build(spec(workers.BF16_MTP)))
    dist.barrier()
    _, release = workers.timed(lambda: backend.release(small))
    out["rebuild_s"] = rebuild
    out["release_s"] = release
    out["nvfp4_on_union_workspace_s"] = _time_round_trips(union, workers.NVFP4, rank, iterations)
    out["bf16_on_union_workspace_s"] = _time_round_trips(union, workers.BF16_MTP, rank, iterations)
    backend.release(union)

    # Coordination overhead of a REUSE round, each mode after its first build.
    for mode, mode_target in (("sidecar", target), ("embedded", None)):
        manager = WorkspaceManager(
            world(), group=f"{GROUP}/{mode}", target=mode_target, backend="flashinfer"
        )
        for layer in (workers.NVFP4, workers.BF16_MTP):
            manager.initialize(
                workers.TOKENS,
                workers.TOP_K,
                workers.NUM_EXPERTS,
                workers.HIDDEN,
                layer.x_bytes_per_token,
                layer.x_sf_bytes_per_token,
                layer=layer.label,
            )
        before = manager.counters
        out[f"reuse_{mode}"] = _reuse_round_seconds(manager, rounds)
        after = manager.counters
        out[f"reuse_{mode}_rpcs_per_round"] = (after.rpcs - before.rpcs) / rounds
        out[f"reuse_{mode}_collectives_per_round"] = (
            after.collectives - before.collectives
        ) / rounds
        manager.cleanup()
    out["bare_core"] = _bare_core_seconds(rounds)
    dist.barrier()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200, help="dispatch+combine timed")
    parser.add_argument("--rounds", type=int, default=300, help="REUSE rounds timed per mode")
    args = parser.parse_args()

    import flashinfer
    import torch

    print(
        f"machine: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}; "
        f"torch {torch.__version__}; flashinfer {flashinfer.__version__}"
    )
    print(
        f"layers: hidden {workers.HIDDEN}, top_k {workers.TOP_K}, {workers.NUM_EXPERTS} experts, "
        f"{workers.TOKENS} tokens per rank, EP 2"
    )
    with tempfile.TemporaryDirectory() as tmp, running_sidecar(Path(tmp) / "sidecar") as sidecar:
        results = run_ranks(
            _bench_rank,
            2,
            timeout=600,
            tmp_path=Path(tmp) / "ranks",
            args=(sidecar.target, args.iterations, args.rounds),
        )
    r = results[0]
    ms = 1e3
    print(f"import of FlashInfer's all-to-all module:          {r['import_s'] * ms:.1f} ms")
    print(
        "first MoeAlltoAll construction in the process "
        f"(loads the compiled module): {r['first_construction_s'] * ms:.1f} ms"
    )
    print(f"rebuild at the union size:                       {r['rebuild_s'] * ms:.1f} ms")
    print(f"release of the superseded workspace:             {r['release_s'] * ms:.1f} ms")
    core = r["bare_core"]
    core_p50 = statistics.median(core)
    print(f"bare in-process decision (policy core): p50 {core_p50 * 1e6:.1f} us")
    for mode in ("sidecar", "embedded"):
        samples = r[f"reuse_{mode}"]
        p50, p99 = statistics.median(samples), _percentile(samples, 0.99)
        print(
            f"REUSE round, {mode:8s}: p50 {p50 * 1e6:8.1f} us  p99 {p99 * 1e6:8.1f} us  "
            f"({p50 / core_p50:.0f}x the bare decision); "
            f"{r[f'reuse_{mode}_rpcs_per_round']:.2f} RPC and "
            f"{r[f'reuse_{mode}_collectives_per_round']:.2f} collectives per round"
        )
    before, after = r["nvfp4_on_nvfp4_workspace_s"], r["nvfp4_on_union_workspace_s"]
    print(
        f"NVFP4 dispatch+combine: {before * 1e6:.1f} us on its own workspace, "
        f"{after * 1e6:.1f} us on the union workspace (ratio {after / before:.3f})"
    )
    print(
        f"bf16 MTP dispatch+combine on the union workspace: {r['bf16_on_union_workspace_s'] * 1e6:.1f} us"
    )


if __name__ == "__main__":
    main()
