"""A whole model's initialisation through the sidecar, against embedded mode.

Initialising a model (8 ranks x 62 MoE layers) through
the sidecar adds at most 0.1 s over embedded mode. Both modes run here, in
the same process, alternately, on the same CPU ranks::

    .venv/bin/python bench/bench_model_init.py [--ranks 8] [--layers 62] [--repeats 3]

The model: ``--layers`` MoE layers shaped like DeepSeek-V3's (hidden 7168,
top_k 8, 256 experts), all NVFP4 but the last, a bf16 MTP layer, so each
run builds once and rebuilds once. Ranks are real processes on gloo with the
reference backend (``moe-sidecar simulate`` without its dispatch+combine
checks). Each sidecar run uses a fresh group name, so both modes do the same
builds; the figure is rank 0's total time inside ``initialize()``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moe_sidecar.client.simulate import (  # noqa: E402
    ModelPreset,
    MoeLayer,
    SimulationConfig,
    SimulationResult,
    run_simulation,
)
from tests.multiprocess.harness import running_sidecar  # noqa: E402

TARGET_ADDED_S = 0.1


def _model(layers: int) -> ModelPreset:
    def layer(index: int, quant: str) -> MoeLayer:
        return MoeLayer(f"model.layers.{index}.mlp", quant, 7168, top_k=8, num_experts=256)  # type: ignore[arg-type]

    return ModelPreset(
        f"deepseek-like-{layers}",
        f"{layers - 1} NVFP4 MoE layers + 1 bf16 MTP layer",
        (*(layer(i, "nvfp4") for i in range(layers - 1)), layer(layers - 1, "bf16")),
    )


def _run(model: ModelPreset, ranks: int, target: str | None, group: str) -> SimulationResult:
    result = run_simulation(
        SimulationConfig(
            model=model,
            ranks=ranks,
            target=target,
            group=group,
            max_tokens=16,
            propose_timeout=None,
            timeout=600,
            check=False,
        )
    )
    if not result.ok:
        raise SystemExit(f"run failed: {result.error or result.failures}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--layers", type=int, default=62)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = _model(args.layers)
    load = os.getloadavg()[0]
    print(
        f"# bench_model_init: {args.ranks} ranks x {args.layers} MoE layers ({model.summary}), "
        f"{os.cpu_count()} CPUs, load average {load:.2f}, {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
    )
    totals: dict[str, list[float]] = {"embedded": [], "sidecar": []}
    rebuild_round: dict[str, list[float]] = {"embedded": [], "sidecar": []}
    reuse_p50: dict[str, list[float]] = {"embedded": [], "sidecar": []}
    with tempfile.TemporaryDirectory() as tmp, running_sidecar(Path(tmp) / "sidecar") as sidecar:
        for repeat in range(args.repeats):
            for mode, target in (("embedded", None), ("sidecar", sidecar.target)):
                result = _run(model, args.ranks, target, f"bench-init/{mode}/run{repeat}")
                seconds = [r.seconds for r in result.rounds]
                totals[mode].append(sum(seconds))
                rebuild_round[mode].extend(r.seconds for r in result.rounds if r.action != "reuse")
                reuse_p50[mode].append(
                    statistics.median(r.seconds for r in result.rounds if r.action == "reuse")
                )
                print(
                    f"  run {repeat} {mode:8s}: {sum(seconds):.3f} s in initialize() over "
                    f"{len(seconds)} rounds ({result.builds} build, {result.rebuilds} rebuild)"
                )
        # The warm restart: the same group again builds once, at the union.
        warm = _run(model, args.ranks, sidecar.target, "bench-init/sidecar/run0")
    embedded, through_sidecar = (
        statistics.median(totals["embedded"]),
        statistics.median(totals["sidecar"]),
    )
    added = through_sidecar - embedded
    print()
    print(f"model initialisation, rank 0's time in initialize() (median of {args.repeats}):")
    print(f"  embedded (in-process core + one all-gather per layer): {embedded:.3f} s")
    print(f"  sidecar  (one RPC per layer, node-local group):        {through_sidecar:.3f} s")
    print(
        f"  added by the sidecar: {added:+.3f} s (ratio {through_sidecar / embedded:.2f}); "
        f"target <= +{TARGET_ADDED_S} s: {'met' if added <= TARGET_ADDED_S else 'MISSED'}"
    )
    for mode in ("embedded", "sidecar"):
        print(
            f"  {mode:8s}: REUSE round p50 {statistics.median(reuse_p50[mode]) * 1e3:.2f} ms, "
            f"build/rebuild round p50 {statistics.median(rebuild_round[mode]) * 1e3:.2f} ms"
        )
    print(
        f"warm restart of run 0's group: {warm.builds} build, {warm.rebuilds} rebuilds, "
        f"{sum(r.seconds for r in warm.rounds):.3f} s in initialize()"
    )


if __name__ == "__main__":
    main()
