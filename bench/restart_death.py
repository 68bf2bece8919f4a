"""Death-to-action after a sidecar restart, beside the same figure without one.

Each trial starts ``--ranks`` rank processes of a fresh EP group on one
real sidecar (``python -m moe_sidecar`` on a Unix socket): each proposes its
first round through ``GrpcTransport`` (its Session stream), arms the
peer-loss watcher under the default policy ``exit``, says ``ready`` and
idles (no call: an engine between batches). Then, in a restart trial, the
sidecar is ``kill -9``ed and started again on the same state directory, and
the trial waits until its ``moe_sidecar_sessions`` and
``moe_sidecar_watchers`` gauges show every rank back (nobody calls: the
client reopens both by itself); a baseline trial skips that. Then the last
rank is SIGKILLed, and each survivor's death-to-action is the time from the
kill to its exit (status 75) as seen by a thread blocked in its ``wait()``
(CLOCK_MONOTONIC). Baseline and restart trials alternate, so both see the
same machine load.

Run: ``python -m bench.restart_death [--trials 50] [--ranks 4]``. It prints
p50/p99/max of the survivors' samples for both kinds, their ratio, and how
long the sessions took to come back after the restart.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.sidecar_process import metric_value
from tests.multiprocess.harness import REPO, Sidecar, free_port

PEER_LOSS_EXIT_STATUS = 75
"""What a survivor ends with under ``exit``."""
READY_S = 60.0
BACK_S = 30.0
EXIT_S = 30.0


def rank_main(target: str, group: str, rank: int, world: int) -> None:
    """One rank: its first round, its watcher, ``ready``, then idle."""
    from moe_sidecar.client.peer_loss import PeerLossPolicy, PeerLossWatch
    from moe_sidecar.client.transport import GrpcTransport
    from moe_sidecar.core.group import Proposal, Requirement
    from moe_sidecar.core.plan import Capacities

    lifetime = f"bench-{group}-{rank}-lifetime-token"
    transport = GrpcTransport(target)
    transport.propose(
        Proposal(
            group=group,
            ep_size=world,
            ep_rank=rank,
            local_ranks=world,
            lifetime=lifetime,
            round=1,
            requirement=Requirement(Capacities(16, 64, 128, 2, 8), "layer.0"),
        )
    )
    # Armed once the group is known (the round closed): subscribed on return.
    PeerLossWatch(target, PeerLossPolicy.EXIT).check(group, rank, lifetime, ep_size=world)
    print("ready", flush=True)
    time.sleep(3600)  # idle; the watcher ends the process


class Trial:
    """The rank processes of one trial and when each was seen to exit."""

    def __init__(self, target: str, group: str, world: int) -> None:
        self.processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.restart_death",
                    "rank",
                    target,
                    group,
                    str(r),
                    str(world),
                ],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,  # each survivor's one line naming the death
                text=True,
            )
            for r in range(world)
        ]
        self.ended_at = [0.0] * world
        self._waiters = [threading.Thread(target=self._wait, args=(r,)) for r in range(world)]
        for waiter in self._waiters:
            waiter.start()

    def _wait(self, rank: int) -> None:
        self.processes[rank].wait()
        self.ended_at[rank] = time.monotonic()

    def wait_ready(self) -> None:
        for rank, process in enumerate(self.processes):
            assert process.stdout is not None
            line = process.stdout.readline()  # "ready", or "" if it died
            if line.strip() != "ready":
                raise RuntimeError(f"rank {rank} did not start: exit {process.poll()}")

    def kill_last(self) -> list[float]:
        """SIGKILLs the last rank; each survivor's seconds from the kill to its exit."""
        last = len(self.processes) - 1
        killed_at = time.monotonic()
        os.kill(self.processes[last].pid, signal.SIGKILL)
        for waiter in self._waiters:
            waiter.join(EXIT_S)
        samples = []
        for rank, process in enumerate(self.processes[:last]):
            if process.returncode != PEER_LOSS_EXIT_STATUS:
                raise RuntimeError(f"rank {rank} ended {process.returncode}, not exit 75")
            samples.append(self.ended_at[rank] - killed_at)
        return samples

    def end(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(10)


def _wait_back(sidecar: Sidecar, world: int) -> float:
    """Seconds until the sidecar shows ``world`` sessions and watchers again."""
    started = time.monotonic()
    while True:
        sessions = metric_value(sidecar.metrics_port, "moe_sidecar_sessions")
        watchers = metric_value(sidecar.metrics_port, "moe_sidecar_watchers")
        if sessions >= world and watchers >= world:
            return time.monotonic() - started
        if time.monotonic() - started > BACK_S:
            raise RuntimeError(f"{sessions:g} sessions, {watchers:g} watchers after {BACK_S}s")
        time.sleep(0.01)  # the poll interval of a wait with a deadline


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50, help="trials of each kind (default 50)")
    parser.add_argument("--ranks", type=int, default=4, help="ranks per trial (default 4)")
    args = parser.parse_args()
    samples: dict[str, list[float]] = {"baseline": [], "restart": []}
    back: list[float] = []
    with tempfile.TemporaryDirectory(prefix="restart-death-") as directory:
        sidecar = Sidecar(Path(directory), round_timeout=20.0, metrics_port=free_port()).start()
        try:
            for trial in range(2 * args.trials):
                kind = "restart" if trial % 2 else "baseline"
                ranks = Trial(sidecar.target, f"bench-restart-death-{trial}", args.ranks)
                try:
                    ranks.wait_ready()
                    if kind == "restart":
                        _wait_back(sidecar, args.ranks)
                        sidecar.stop(kill=True)
                        sidecar.start()
                        back.append(_wait_back(sidecar, args.ranks))
                    samples[kind].extend(ranks.kill_last())
                finally:
                    ranks.end()
        finally:
            sidecar.stop()
    print(f"trials: {args.trials} of each kind, {args.ranks} ranks, {os.cpu_count()} cores")
    for kind, values in samples.items():
        print(
            f"{kind:>8}: death-to-action p50 {_percentile(values, 0.5) * 1e3:7.1f} ms, "
            f"p99 {_percentile(values, 0.99) * 1e3:7.1f} ms, max {max(values) * 1e3:7.1f} ms "
            f"({len(values)} survivor samples)"
        )
    ratio_p50 = statistics.median(samples["restart"]) / statistics.median(samples["baseline"])
    ratio_p99 = _percentile(samples["restart"], 0.99) / _percentile(samples["baseline"], 0.99)
    print(f"restart / baseline: p50 {ratio_p50:.2f}x, p99 {ratio_p99:.2f}x")
    print(
        f"sessions and watchers back after the restart: p50 {statistics.median(back) * 1e3:.0f} ms, "
        f"max {max(back) * 1e3:.0f} ms (from the sidecar's start being ready)"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        rank_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
