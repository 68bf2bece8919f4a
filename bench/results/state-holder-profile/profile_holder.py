"""Profiles exactly what bench_sidecar.py reports as "state holder at 8 ranks":
``coordinator_rounds(workdir, 8, rounds, warmup)`` with the bench's JSON logging to
/dev/null, under cProfile, for the tree whose bench/bench_sidecar.py is given.

Which moe_sidecar it profiles is what ``import moe_sidecar`` finds: the editable
install (this tree), or the before tree's packages put first with PYTHONPATH.

Usage: python profile_holder.py TREE_ROOT OUT_PREFIX [ROUNDS]
Writes OUT_PREFIX.pstats and OUT_PREFIX.txt (top by tottime and by cumtime, per
proposal call counts), and prints us/proposal measured with and without the profiler.
"""

from __future__ import annotations

import asyncio
import cProfile
import importlib.util
import io
import os
import pstats
import sys
import tempfile
from pathlib import Path

RANKS = 8
WARMUP = 10


def _load_bench(tree: Path):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_sidecar", tree / "bench/bench_sidecar.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_sidecar"] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    tree, prefix = Path(sys.argv[1]), Path(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
    bench = _load_bench(tree)
    import moe_sidecar

    devnull = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the run
    bench.configure_logging("json", "INFO", devnull)
    with tempfile.TemporaryDirectory() as tmp:
        plain = asyncio.run(bench.coordinator_rounds(Path(tmp) / "plain", RANKS, rounds, WARMUP))
        profiler = cProfile.Profile()
        profiler.enable()
        profiled = asyncio.run(bench.coordinator_rounds(Path(tmp) / "prof", RANKS, rounds, WARMUP))
        profiler.disable()
    proposals = RANKS * (rounds + WARMUP)
    profiler.dump_stats(f"{prefix}.pstats")
    out = io.StringIO()
    out.write(f"moe_sidecar from {Path(moe_sidecar.__file__).parent}\n")
    out.write(
        f"{RANKS} ranks x ({rounds} + {WARMUP} warmup) rounds = {proposals} proposals profiled\n"
    )
    out.write(
        f"us/proposal without profiler {plain.wall / plain.proposals * 1e6:.1f}, "
        f"with {profiled.wall / profiled.proposals * 1e6:.1f}\n\n"
    )
    stats = pstats.Stats(profiler, stream=out)
    total = stats.total_tt  # type: ignore[attr-defined]
    out.write(f"total profiled time per proposal: {total / proposals * 1e6:.1f} us\n\n")
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)
    prefix.with_suffix(".txt").write_text(out.getvalue())
    print(out.getvalue().split("\n\n")[0])
    print(out.getvalue().split("\n\n")[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
