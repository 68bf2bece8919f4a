"""A peer killed between its dispatch and its combine, with and without the
peer-loss watcher, in one run (FlashInfer 0.7.2.post1's ``MoeAlltoAll``,
every rank on the one GPU: rank r on ``cuda:r % count``).

Per scenario: a real sidecar on a Unix socket, ``--ranks`` rank processes
(a gloo group, a ``WorkspaceManager`` through the sidecar, one bf16 layer
built), every rank dispatches, the victim (the last rank) stops before its
combine, the others enter combine and wait for it there; the driver
SIGKILLs the victim once every survivor said it is combining, then records
how each survivor ended and when (CLOCK_MONOTONIC from the kill):

* ``watcher``: ``MOE_SIDECAR_ON_PEER_LOSS=exit`` (the default): each
  survivor should exit with status 75 within 2 s, naming the victim;
* ``no-watcher``: ``MOE_SIDECAR_ON_PEER_LOSS=wait`` (the behaviour without
  the watcher): FlashInfer's own outcome, a trap minutes later or a hang,
  watched for ``--hang-cap`` seconds, then killed.

    python3 bench/peer_loss_gpu.py --out DIR [--ranks 4] [--hang-cap 360]
    python3 bench/peer_loss_gpu.py --backend reference --hang-cap 20   # the flow on CPU

Prints one line per survivor and a summary: the watcher's slowest survivor
against the time the others took without it (a ratio of the same run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
HIDDEN = 7168
"""DeepSeek-V3's hidden size, as in the recorded 304 s trap."""
TOP_K = 8
NUM_EXPERTS = 256
TOKENS = 128
EXIT_STATUS = 75
"""The status ``MOE_SIDECAR_ON_PEER_LOSS=exit`` ends a rank with."""
SCENARIOS = {"watcher": "exit", "no-watcher": "wait"}


def _say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "at": time.monotonic(), **fields}), flush=True)


def rank_main(rank: int, world: int, init_method: str, group: str, backend: str) -> None:
    """One rank: build, dispatch, then combine (the victim stops before it)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from moe_sidecar.client import WorkspaceManager

    gpu = backend != "reference"
    if gpu:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=timedelta(hours=1)
    )
    world_group = dist.group.WORLD
    assert world_group is not None
    manager = WorkspaceManager(world_group, group=group, backend=backend, local_ranks=world)
    manager.initialize(TOKENS, TOP_K, NUM_EXPERTS, HIDDEN, HIDDEN * 2, 0, layer="mtp.0.mlp")
    a2a = manager.moe_alltoall
    assert a2a is not None
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    g = torch.Generator().manual_seed(1000 + rank)
    experts = torch.rand(TOKENS, NUM_EXPERTS, generator=g).argsort(dim=1)[:, :TOP_K]
    experts = experts.to(torch.int32).to(device)
    weights = torch.full((TOKENS, TOP_K), 0.5, dtype=torch.float32, device=device)
    hidden = torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16, device=device)
    _say("ready")
    recv = a2a.dispatch(experts, [hidden, experts, weights], TOKENS)
    if gpu:
        torch.cuda.synchronize()
    _say("dispatched")
    if rank == world - 1:
        time.sleep(3600)  # the victim: killed here, between its dispatch and its combine
    _say("combining")
    started = time.monotonic()
    try:
        a2a.combine((recv[0].float() * (1 + rank)).to(torch.bfloat16).contiguous(), TOKENS)
        if gpu:
            torch.cuda.synchronize()
    except Exception as error:
        _say("raised", error=f"{type(error).__name__}: {error}", seconds=time.monotonic() - started)
        os._exit(1)
    _say("combined")
    os._exit(0)


def _start_sidecar(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    socket = directory / "s.sock"
    target = f"unix://{socket}"
    log = open(directory / "sidecar.log", "wb")  # noqa: SIM115 (lives as long as the sidecar)
    command = [sys.executable, "-c", "import sys; from moe_sidecar.cli import main; "]
    command[-1] += "sys.exit(main(sys.argv[1:]))"
    command += ["serve", "--listen", target, "--state-dir", str(directory / "state")]
    command += ["--health-port", "0", "--metrics-port", "0", "--log-format", "text"]
    process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not socket.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(
                f"the sidecar did not start: {(directory / 'sidecar.log').read_text()}"
            )
        time.sleep(0.05)  # the poll interval of a wait with a deadline
    return process, target


def _reader(stdout: IO[str], events: list[dict[str, Any]], changed: threading.Condition) -> None:
    for line in stdout:
        if line.startswith("{"):
            with changed:
                events.append(json.loads(line))
                changed.notify_all()


def scenario(name: str, args: argparse.Namespace, out: Path) -> dict[int, dict[str, Any]]:
    """Runs one scenario; each survivor's outcome."""
    directory = Path(tempfile.mkdtemp(prefix=f"peer-loss-{name}-"))
    sidecar, target = _start_sidecar(directory)
    env = {**os.environ, "MOE_SIDECAR_TARGET": target, "MOE_SIDECAR_ON_PEER_LOSS": SCENARIOS[name]}
    init = f"file://{directory / 'rendezvous'}"
    group = f"peer-loss-{name}:bf16/tp1-ep{args.ranks}/pp0"
    events: list[list[dict[str, Any]]] = [[] for _ in range(args.ranks)]
    changed = threading.Condition()
    ranks = []
    for rank in range(args.ranks):
        with open(out / f"{name}-rank{rank}.stderr", "w") as stderr:
            command = [sys.executable, __file__, "rank", str(rank), str(args.ranks), init, group]
            ranks.append(
                subprocess.Popen(
                    [*command, args.backend],
                    cwd=REPO,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    text=True,
                )
            )
        assert ranks[-1].stdout is not None
        threading.Thread(
            target=_reader, args=(ranks[-1].stdout, events[rank], changed), daemon=True
        ).start()
    victim, survivors = args.ranks - 1, range(args.ranks - 1)

    def said(rank: int, event: str) -> bool:
        return any(e["event"] == event for e in events[rank])

    with changed:
        ok = changed.wait_for(
            lambda: said(victim, "dispatched") and all(said(r, "combining") for r in survivors),
            timeout=args.startup,
        )
    if not ok:
        raise SystemExit(f"{name}: the ranks did not reach their combine: {events}")
    time.sleep(0.5)  # the survivors' combine kernels are launched and waiting
    killed_at = time.monotonic()
    os.kill(ranks[victim].pid, signal.SIGKILL)
    outcomes: dict[int, dict[str, Any]] = {}
    deadline = killed_at + args.hang_cap
    while len(outcomes) < len(survivors) and time.monotonic() < deadline:
        for rank in survivors:
            code = ranks[rank].poll()
            if rank not in outcomes and code is not None:
                outcomes[rank] = {"status": code, "seconds": time.monotonic() - killed_at}
        time.sleep(0.005)  # the poll interval of a wait with a deadline
    for rank in survivors:
        if rank not in outcomes:
            outcomes[rank] = {"status": None, "seconds": None}  # still hung at the cap
            ranks[rank].kill()
        lines = (out / f"{name}-rank{rank}.stderr").read_text().strip().splitlines()
        outcomes[rank]["last_line"] = lines[-1] if lines else ""
        outcomes[rank]["events"] = [e["event"] for e in events[rank]]
    sidecar.send_signal(signal.SIGTERM)
    sidecar.wait(timeout=30)
    return outcomes


def _describe(outcome: dict[str, Any], cap: float) -> str:
    if outcome["status"] is None:
        return f"still hung {cap:g} s after the kill (killed)"
    return f"ended with status {outcome['status']} {outcome['seconds']:.3f} s after the kill"


def main(argv: list[str]) -> int:
    if argv and argv[0] == "rank":
        rank_main(int(argv[1]), int(argv[2]), argv[3], argv[4], argv[5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--hang-cap", type=float, default=360.0)
    parser.add_argument("--startup", type=float, default=240.0)
    parser.add_argument("--backend", default="flashinfer-moe-alltoall")
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="peer-loss-")))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {name: scenario(name, args, args.out) for name in SCENARIOS}
    for name, outcomes in results.items():
        for rank, outcome in outcomes.items():
            print(
                f"{name}: rank {rank} {_describe(outcome, args.hang_cap)}: {outcome['last_line']}"
            )
    (args.out / "peer-loss.json").write_text(json.dumps(results, indent=2))
    watched = [o["seconds"] for o in results["watcher"].values()]
    unwatched = [o["seconds"] or args.hang_cap for o in results["no-watcher"].values()]
    named = all(
        f"rank {args.ranks - 1} died" in o["last_line"] for o in results["watcher"].values()
    )
    all_ended = all(o["status"] == EXIT_STATUS for o in results["watcher"].values())
    slowest = max(s for s in watched if s is not None) if all_ended else float("inf")
    print(
        f"summary: with the watcher every survivor ended (status {EXIT_STATUS}, naming the dead "
        f"rank: {named}) within {slowest:.3f} s; without it the first survivor ended after "
        f"{min(unwatched):.1f} s and the last after {max(unwatched):.1f} s (cap "
        f"{args.hang_cap:g} s): {min(unwatched) / slowest:.0f}x"
    )
    return 0 if all_ended and named and slowest < 2.0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
