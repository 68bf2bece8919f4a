"""A whole model's initialisation and its covered layers: through the sidecar,
embedded, and with no coordination at all, in one run, on the same ranks.

    .venv/bin/python bench/bench_model_init.py [--ranks 8] [--layers 62] [--repeats 5]

The model: ``--layers`` MoE layers shaped like DeepSeek-V3's (hidden 7168,
top_k 8, 256 experts, 16 tokens per rank), all NVFP4 but the last, a bf16
MTP layer: each run builds once (layer 0), passes the layers between as
*covered* (the built plan serves them) and rebuilds once (the MTP layer).
Ranks are real processes on gloo with the reference backend; one real
sidecar (``python -m moe_sidecar`` on a Unix socket) serves the run.

Each rank process runs every mode ``--repeats`` times, the modes' order
rotating per repeat, each run starting together behind one barrier on the
EP group, with a fresh group name (so every mode does the same builds):

* ``none``: no coordination at all (:class:`bench.uncoordinated.UncoordinatedRank`:
  the same sizing, union and builds, nothing proposed or agreed);
* ``embedded``: the in-process core and the cross-rank agreement per round;
* ``sidecar``: the node's sidecar over the rank's session stream (a covered
  round sends its proposal and goes on).

A layer's figure is the rank's own wall time inside ``initialize()``; the
whole model's is the sum over its layers plus the first
``get_communication()`` (where a rank reads what is still outstanding), the
slowest rank per run, the median over repeats. Per-layer p50/p99 pool every
rank's covered layers of every repeat.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.multiprocess.harness import run_ranks, running_sidecar  # noqa: E402

MODES = ("none", "embedded", "sidecar")
TARGET_COVERED_P50_S = 0.25e-3
"""A covered layer through the sidecar, 8 ranks, 2 cores: the rank's p50."""
TARGET_COVERED_VS_EMBEDDED = 0.5
"""The covered layers through the sidecar against embedded: at most this ratio."""
HIDDEN, TOP_K, EXPERTS, TOKENS = 7168, 8, 256, 16


def _layers(count: int) -> list[tuple[str, int, int]]:
    """(label, x bytes per token, x scale bytes per token), vLLM 0.30's call style."""
    nvfp4 = (HIDDEN // 2, HIDDEN // 16)
    bf16 = (HIDDEN * 2, 0)
    return [(f"model.layers.{i}.mlp", *nvfp4) for i in range(count - 1)] + [
        (f"model.layers.{count - 1}.mtp", *bf16)
    ]


def rank_worker(rank: int, world: int, target: str, layers: int, repeats: int) -> dict[str, Any]:
    """Every mode ``repeats`` times on this rank; returns per-run layer times."""
    import torch.distributed as dist

    from bench.uncoordinated import UncoordinatedRank
    from moe_sidecar.client import WorkspaceManager

    cpu_group = dist.new_group(backend="gloo")
    model = _layers(layers)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for repeat in range(repeats):
        order = MODES[repeat % len(MODES) :] + MODES[: repeat % len(MODES)]
        for mode in order:
            rank_object: Any
            if mode == "none":
                rank_object = UncoordinatedRank(cpu_group)
            else:
                rank_object = WorkspaceManager(
                    cpu_group,
                    group=f"bench-init/{mode}/run{repeat}",
                    target=target if mode == "sidecar" else "embedded",
                    backend="reference",
                    local_ranks=world if mode == "sidecar" else None,
                )
            dist.barrier(group=cpu_group)  # every mode's run starts together
            seconds = []
            for label, x_bytes, x_sf_bytes in model:
                started = time.perf_counter()
                rank_object.initialize(
                    TOKENS, TOP_K, EXPERTS, HIDDEN, x_bytes, x_sf_bytes, layer=label
                )
                seconds.append(time.perf_counter() - started)
            started = time.perf_counter()
            if mode != "none":
                rank_object.get_communication()  # reads every answer still outstanding
            settle = time.perf_counter() - started
            if mode == "none":
                builds = rank_object.builds
                covered = 0
            else:
                counters = rank_object.counters
                builds = counters.builds + counters.rebuilds
                covered = counters.covered
            runs[mode].append(
                {"seconds": seconds, "settle": settle, "builds": builds, "covered": covered}
            )
            rank_object.cleanup()
    return {"rank": rank, "runs": runs}


@contextlib.contextmanager
def sampling_sidecar(pid: int | None, out: Path | None) -> Iterator[None]:
    """py-spy samples ``pid`` (the sidecar) while the block runs, when ``out`` is set.

    Two recorders, one per output format (py-spy writes one format per run):
    the flame graph to look at and the folded stacks that
    :func:`summarize_samples` reads. Idle samples are left out, so the
    shares are of the sidecar's busy time.

    Raises:
        RuntimeError: py-spy is not installed or could not attach.
    """
    if out is None or pid is None:
        yield
        return
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise RuntimeError("--py-spy needs py-spy (pip install py-spy)")
    out.mkdir(parents=True, exist_ok=True)
    recorders = [
        subprocess.Popen(
            [
                py_spy,
                "record",
                "--pid",
                str(pid),
                "--rate",
                "1000",
                "--format",
                fmt,
                "-o",
                str(out / name),
                "--nonblocking",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for fmt, name in (("flamegraph", "sidecar-flame.svg"), ("raw", "sidecar-folded.txt"))
    ]
    try:
        yield
    finally:
        for recorder in recorders:
            recorder.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        for recorder in recorders:
            _, err = recorder.communicate(timeout=60)
            if recorder.returncode not in (0, -signal.SIGINT):
                raise RuntimeError(f"py-spy failed: {err.decode(errors='replace')}")


# Where a sidecar's busy time goes, by a sample's innermost frame of a known
# kind. grpc.aio's work is Cython that the event loop runs as callbacks: py-spy
# sees no frame of it, so a sample whose innermost frame is the loop's
# ``Handle._run`` is time in gRPC's compiled code (receiving, framing, sending).
_SAMPLE_KINDS = (
    ("gRPC's compiled code (grpc.aio callbacks)", ("Handle._run (asyncio/events.py",)),
    ("event loop polling (epoll)", ("EpollSelector.select",)),
    ("store (SQLite, row codec)", ("/store/", "store.py", "sqlite3")),
    ("decision core (sidecar/core)", ("/core/",)),
    ("state holder (state.py, waiters, observer)", ("state.py", "waiters.py", "observer.py")),
    ("wire codec and servicer", ("servicer.py", "/wire/", "_pb2")),
    ("logging", ("logging/", "logs.py", "json/")),
    ("other threads (native)", ("Thread.run (threading.py",)),
)


def summarize_samples(folded: Path) -> str:
    """Shares of the sampled busy time by kind of frame, from py-spy's folded stacks."""
    counts: dict[str, int] = {kind: 0 for kind, _ in _SAMPLE_KINDS}
    counts["other"] = 0
    total = 0
    for line in folded.read_text().splitlines():
        stack, _, number = line.rpartition(" ")
        if not number.isdigit():
            continue
        n = int(number)
        total += n
        for frame in reversed(stack.split(";")):  # from the leaf outwards
            kind = next((k for k, keys in _SAMPLE_KINDS if any(key in frame for key in keys)), None)
            if kind is not None:
                counts[kind] += n
                break
        else:
            counts["other"] += n
    lines = [f"sidecar busy samples (py-spy, 1 kHz): {total}; by the innermost frame's kind:"]
    for kind, n in sorted(counts.items(), key=lambda item: -item[1]):
        lines.append(f"  {kind:<45} {n:7d}  {n / max(1, total):6.1%}")
    return "\n".join(lines)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--layers", type=int, default=62)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        metavar="DIR",
        help="sample the sidecar process with py-spy during the run: DIR/sidecar-flame.svg, "
        "DIR/sidecar-folded.txt and a summary of where its time goes",
    )
    args = parser.parse_args()
    print(
        f"# bench_model_init: {args.ranks} ranks x {args.layers} MoE layers "
        f"({args.layers - 1} NVFP4 + 1 bf16 MTP: 1 build, {args.layers - 2} covered, 1 rebuild), "
        f"{args.repeats} repeats, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, "
        f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
    )
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_sidecar(Path(tmp) / "sidecar") as sidecar,
        sampling_sidecar(sidecar.pid, args.py_spy),
    ):
        results = run_ranks(
            rank_worker,
            args.ranks,
            timeout=1800,
            tmp_path=Path(tmp) / "ranks",
            args=(sidecar.target, args.layers, args.repeats),
        )
    if args.py_spy is not None:
        print(summarize_samples(args.py_spy / "sidecar-folded.txt"))
    covered = {mode: [] for mode in MODES}  # type: dict[str, list[float]]
    totals = {mode: [] for mode in MODES}  # type: dict[str, list[float]]
    covered_sums = {mode: [] for mode in MODES}  # type: dict[str, list[float]]
    for mode in MODES:
        for repeat in range(args.repeats):
            per_rank = [r["runs"][mode][repeat] for r in results]
            for run in per_rank:
                if run["builds"] != 2:
                    raise SystemExit(f"{mode} run {repeat}: {run['builds']} builds, expected 2")
                covered[mode].extend(run["seconds"][1:-1])
            totals[mode].append(max(sum(run["seconds"]) + run["settle"] for run in per_rank))
            covered_sums[mode].append(max(sum(run["seconds"][1:-1]) for run in per_rank))
    sidecar_covered = [r["runs"]["sidecar"][0]["covered"] for r in results]
    print(f"sidecar runs passed {sidecar_covered[0]} rounds per rank as covered (no wait)")
    print()
    print(
        f"covered layer, the rank's time in initialize() ({args.ranks} ranks x "
        f"{args.layers - 2} layers x {args.repeats} repeats per mode):"
    )
    print(f"  {'mode':<9} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for mode in MODES:
        values = covered[mode]
        print(
            f"  {mode:<9} {_pct(values, 50) * 1e3:8.3f} {_pct(values, 99) * 1e3:8.3f} "
            f"{statistics.fmean(values) * 1e3:8.3f}"
        )
    p50 = {mode: _pct(covered[mode], 50) for mode in MODES}
    p99 = {mode: _pct(covered[mode], 99) for mode in MODES}
    print(
        f"  sidecar / embedded: p50 {p50['sidecar'] / p50['embedded']:.3f}, "
        f"p99 {p99['sidecar'] / p99['embedded']:.3f}; "
        f"sidecar / none: p50 {p50['sidecar'] / p50['none']:.2f}, "
        f"p99 {p99['sidecar'] / p99['none']:.2f}"
    )
    print()
    print(
        f"the {args.layers - 2} covered layers together, slowest rank, median of {args.repeats} (s):"
    )
    sums = {mode: statistics.median(covered_sums[mode]) for mode in MODES}
    print("  " + ", ".join(f"{mode} {sums[mode]:.4f}" for mode in MODES))
    print(
        f"  sidecar / embedded {sums['sidecar'] / sums['embedded']:.3f}, "
        f"sidecar / none {sums['sidecar'] / sums['none']:.2f}"
    )
    print()
    whole = {mode: statistics.median(totals[mode]) for mode in MODES}
    print(
        f"whole-model init ({args.layers} layers + the first get_communication()), "
        f"slowest rank, median of {args.repeats} (s):"
    )
    print("  " + ", ".join(f"{mode} {whole[mode]:.4f}" for mode in MODES))
    print(
        f"  sidecar / embedded {whole['sidecar'] / whole['embedded']:.3f}, "
        f"sidecar / none {whole['sidecar'] / whole['none']:.3f}"
    )
    print("  where the time goes, medians over ranks and repeats (ms):")
    for mode in MODES:
        runs = [r["runs"][mode][repeat] for r in results for repeat in range(args.repeats)]
        first = statistics.median(run["seconds"][0] for run in runs)
        last = statistics.median(run["seconds"][-1] for run in runs)
        settle = statistics.median(run["settle"] for run in runs)
        print(
            f"    {mode:<9} build round {first * 1e3:8.2f}, rebuild round {last * 1e3:8.2f}, "
            f"first get_communication() {settle * 1e3:6.2f}"
        )
    print()
    print(f"targets (load average at the end {os.getloadavg()[0]:.2f}):")
    ok_p50 = p50["sidecar"] <= TARGET_COVERED_P50_S
    ratio = sums["sidecar"] / sums["embedded"]
    print(
        f"  covered layer through the sidecar, p50 {p50['sidecar'] * 1e3:.3f} ms "
        f"<= {TARGET_COVERED_P50_S * 1e3:g} ms: {'met' if ok_p50 else 'MISSED'}"
    )
    print(
        f"  {args.layers - 2} covered layers, sidecar / embedded {ratio:.3f} "
        f"<= {TARGET_COVERED_VS_EMBEDDED:g}: {'met' if ratio <= TARGET_COVERED_VS_EMBEDDED else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
