"""cProfile of REUSE rounds through the sidecar's state holder, in process.

    .venv/bin/python bench/profile_reuse.py [--ranks 8] [--rounds 2000] [--out bench/results]

The rounds of ``bench_sidecar.py``'s state-holder figure (the Coordinator
with its SQLite store, JSON log lines at INFO to /dev/null and metrics; no
gRPC), every round after the first a REUSE of the same layer, under
cProfile. Writes ``reuse-profile.pstats`` (for ``snakeviz`` or
``python -m pstats``) and ``reuse-profile.txt`` (the top functions by own
time and by cumulative time, and the per-proposal cost with and without the
profiler) to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_sidecar import coordinator_rounds  # noqa: E402
from moe_sidecar import flashinfer as _flashinfer  # noqa: E402
from moe_sidecar.core import limits as _limits  # noqa: E402
from moe_sidecar.logs import configure_logging  # noqa: E402

CEILING = _limits.WorkspaceCeiling(_limits.DEFAULT_MAX_WORKSPACE_BYTES, _flashinfer.workspace_size)


def _parts(workdir: Path, ranks: int, repeats: int = 500) -> tuple[float, float, float]:
    """Microseconds per round: the store's save of the group (what a written
    round costs: a BUILD or REBUILD, or a REUSE before REUSE rounds stopped
    being written), the stored row's encode alone, and the core's
    ``policy.propose`` for the round's ``ranks`` proposals."""
    from bench.bench_sidecar import NEED
    from moe_sidecar.core import policy
    from moe_sidecar.core.group import GroupState, Proposal
    from moe_sidecar.store.row_codec import encode_group
    from moe_sidecar.store.sqlite import StateStore

    ep_size = max(ranks, 8)
    state: GroupState | None = None
    core_started = 0.0
    for rnd in range(1, repeats + 2):
        if rnd == 2:
            core_started = time.perf_counter()
        for rank in range(ranks):
            proposal = Proposal("parts", ep_size, rank, ranks, f"p-{rank}", rnd, NEED)
            state = policy.propose(state, proposal, float(rnd), 60.0, ceiling=CEILING).state
    core_us = (time.perf_counter() - core_started) / repeats * 1e6
    assert state is not None
    store = StateStore(workdir)
    try:
        started = time.perf_counter()
        for _ in range(repeats):
            store.save(state)
        save_us = (time.perf_counter() - started) / repeats * 1e6
    finally:
        store.close()
    started = time.perf_counter()
    for _ in range(repeats):
        encode_group(state)
    encode_us = (time.perf_counter() - started) / repeats * 1e6
    return save_us, encode_us, core_us


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with open(os.devnull, "w") as devnull, tempfile.TemporaryDirectory() as tmp:
        # What the per-round INFO line costs: the same rounds logged at WARNING.
        configure_logging("json", "WARNING", devnull)
        quiet = asyncio.run(coordinator_rounds(Path(tmp) / "quiet", args.ranks, args.rounds, 50))
        configure_logging("json", "INFO", devnull)
        plain = asyncio.run(coordinator_rounds(Path(tmp) / "plain", args.ranks, args.rounds, 50))
        save_us, encode_us, core_us = _parts(Path(tmp) / "parts", args.ranks)
        profiler = cProfile.Profile()
        profiler.enable()
        profiled = asyncio.run(
            coordinator_rounds(Path(tmp) / "profiled", args.ranks, args.rounds, 50)
        )
        profiler.disable()
    stats_path = args.out / "reuse-profile.pstats"
    profiler.dump_stats(stats_path)
    text = io.StringIO()
    text.write(
        f"$ python bench/profile_reuse.py --ranks {args.ranks} --rounds {args.rounds}    # "
        f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}\n"
    )
    text.write(
        f"state holder, {args.ranks} local ranks, REUSE rounds: "
        f"{plain.wall / plain.proposals * 1e6:.1f} us per proposal without the profiler, "
        f"{profiled.wall / profiled.proposals * 1e6:.1f} us under it; "
        f"round p50 {plain.pct(50) * 1e3:.3f} ms\n"
        f"  logged at WARNING (no per-round INFO line): "
        f"{quiet.wall / quiet.proposals * 1e6:.1f} us per proposal\n"
        f"  parts, per round of {args.ranks} proposals: the store's save of the group "
        f"{save_us:.1f} us (of which the row's encode {encode_us:.1f} us), the core alone "
        f"{core_us:.1f} us\n\n"
    )
    for key, title in (("tottime", "own time"), ("cumulative", "cumulative time")):
        text.write(f"--- top 40 by {title} ---\n")
        stats = pstats.Stats(profiler, stream=text)
        stats.strip_dirs().sort_stats(key).print_stats(40)
    (args.out / "reuse-profile.txt").write_text(text.getvalue())
    print(text.getvalue()[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
