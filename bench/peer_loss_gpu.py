"""A peer killed between its dispatch and its combine, with and without the
peer-loss watcher, in one run, on either FlashInfer release's all-to-all
(every rank on the one GPU: rank r on ``cuda:r % count``):

* ``--backend flashinfer-moe-alltoall`` (the default): 0.7.2.post1's
  ``MoeAlltoAll`` (``manager.moe_alltoall``), dispatched and combined
  through its own calls;
* ``--backend flashinfer-moe-ep``: 0.7.4, stepped through its ``moe_ep``
  object ``NVLinkOneSidedAlltoAll`` (``manager.get_communication()``), as
  ``bench/masked_steps_gpu.py`` steps it (``bench/alltoall_steps.py``,
  shared by both). 0.7.4's platform vote refuses a single GPU; with one GPU
  visible it is stood in for, and each rank's ``ready`` event (and the
  driver's line for it) says so as ``vote_stood_in_for``;
* ``--backend reference`` / ``reference-moe-ep``: the same flow on CPU, the
  reference stepped either way.

Per scenario: a real sidecar on a Unix socket, ``--ranks`` rank processes
(a gloo group, a ``WorkspaceManager`` through the sidecar, one bf16 layer
built), every rank dispatches, the victim (the last rank) stops before its
combine, the others enter combine and wait for it there; the driver
SIGKILLs the victim once every survivor said it is combining, then records
how each survivor ended and when (CLOCK_MONOTONIC from the kill):

* ``watcher``: ``MOE_SIDECAR_ON_PEER_LOSS=exit`` (the default): each
  survivor should exit with status 75 within 2 s, naming the victim;
* ``no-watcher``: ``MOE_SIDECAR_ON_PEER_LOSS=wait`` (the behaviour without
  the watcher): FlashInfer's own outcome, watched for ``--hang-cap``
  seconds, then killed. On 0.7.2.post1 a trap minutes later or a hang; on
  0.7.4 the waits time out after ``NVLinkOneSidedConfig.timeout_sec``
  (default 300 s; a wait past it traps the kernel), so under a shorter cap
  the survivors are still hung at the cap, and the summary says so
  (capped, not a trap).

    python3 bench/peer_loss_gpu.py --out DIR [--ranks 4] [--hang-cap 360]
    python3 bench/peer_loss_gpu.py --backend flashinfer-moe-ep --hang-cap 60 --out DIR   # 0.7.4
    python3 bench/peer_loss_gpu.py --backend reference --hang-cap 20   # the flow on CPU
    python3 bench/peer_loss_gpu.py --backend reference-moe-ep --hang-cap 20   # 0.7.4's form, on CPU

Prints one line per survivor (its backend, whether the vote was stood in
for) and a summary naming the backend: the watcher's slowest survivor
against the time the others took without it (a ratio of the same run; a
lower bound when some were still hung at the cap).
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

if __package__ in (None, ""):  # run as a script: the repository's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import alltoall_steps as stepping
from bench.sidecar_process import unix_socket_sidecar

REPO = Path(__file__).resolve().parents[1]
HIDDEN = 7168
"""DeepSeek-V3's hidden size, as in the recorded 304 s trap."""
TOP_K = 8
NUM_EXPERTS = 256
TOKENS = 128
EXIT_STATUS = 75
"""The status ``MOE_SIDECAR_ON_PEER_LOSS=exit`` ends a rank with."""
SCENARIOS = {"watcher": "exit", "no-watcher": "wait"}
WATCHER_WITHIN_S = 2.0
"""How soon after the kill the watcher must have ended every survivor."""


def _say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "at": time.monotonic(), **fields}), flush=True)


def rank_main(rank: int, world: int, init_method: str, group: str, backend: str) -> None:
    """One rank: build, dispatch, then combine (the victim stops before it)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from moe_sidecar.client import WorkspaceManager

    device, stood_in = stepping.device(rank, backend)
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=timedelta(hours=1)
    )
    world_group = dist.group.WORLD
    assert world_group is not None
    manager = WorkspaceManager(
        world_group, group=group, backend=stepping.client_backend(backend), local_ranks=world
    )
    manager.initialize(TOKENS, TOP_K, NUM_EXPERTS, HIDDEN, HIDDEN * 2, 0, layer="mtp.0.mlp")
    moe_ep = stepping.is_moe_ep(backend)
    stepped = manager.get_communication() if moe_ep else manager.moe_alltoall
    assert stepped is not None
    g = torch.Generator().manual_seed(1000 + rank)
    experts = torch.rand(TOKENS, NUM_EXPERTS, generator=g).argsort(dim=1)[:, :TOP_K]
    experts = experts.to(torch.int32).to(device)
    weights = torch.full((TOKENS, TOP_K), 0.5, dtype=torch.float32, device=device)
    hidden = torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16, device=device)
    about = {"backend": backend, "stepped": type(stepped).__name__, "vote_stood_in_for": stood_in}
    # 0.7.4's waits give up after this (NVLinkOneSidedConfig); None: no such setting.
    about["wait_timeout_s"] = getattr(getattr(stepped, "config", None), "timeout_sec", None)
    _say("ready", **about)
    rows, _, _ = stepping.dispatch(stepped, moe_ep, hidden, experts, weights, TOKENS, None)
    if device.type == "cuda":
        torch.cuda.synchronize()
    _say("dispatched")
    if rank == world - 1:
        time.sleep(3600)  # the victim: killed here, between its dispatch and its combine
    _say("combining")
    started = time.monotonic()
    try:
        expert_out = (rows.float() * (1 + rank)).to(torch.bfloat16).contiguous()
        stepping.combine(stepped, moe_ep, expert_out, TOKENS, None)
        if device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as error:
        _say("raised", error=f"{type(error).__name__}: {error}", seconds=time.monotonic() - started)
        if device.type != "cuda" and os.environ.get("MOE_SIDECAR_ON_PEER_LOSS") == "exit":
            # On CPU gloo notices the closed sockets itself, at times before the
            # watcher acts (FlashInfer's kernels notice nothing): give the
            # watcher this rank runs the time it is allowed, so the CPU run
            # checks the watcher rather than a race.
            time.sleep(WATCHER_WITHIN_S)
        os._exit(1)
    _say("combined")
    os._exit(0)


def _reader(stdout: IO[str], events: list[dict[str, Any]], changed: threading.Condition) -> None:
    for line in stdout:
        if line.startswith("{"):
            with changed:
                events.append(json.loads(line))
                changed.notify_all()


def scenario(name: str, args: argparse.Namespace, out: Path) -> dict[int, dict[str, Any]]:
    """Runs one scenario against a sidecar of its own; each survivor's outcome.

    Raises:
        SystemExit: the sidecar did not start, or the ranks did not reach their combine.
    """
    directory = Path(tempfile.mkdtemp(prefix=f"peer-loss-{name}-"))
    with unix_socket_sidecar(directory) as (_, target):
        return _kill_mid_step(name, args, out, directory, target)


def _kill_mid_step(
    name: str, args: argparse.Namespace, out: Path, directory: Path, target: str
) -> dict[int, dict[str, Any]]:
    """Starts the ranks on ``target``, kills the victim mid-step; each survivor's outcome."""
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
        stderr_file = out / f"{name}-rank{rank}.stderr"
        outcomes[rank].update(_reported(stderr_file, events[rank]))
    return outcomes


def _reported(stderr: Path, events: list[dict[str, Any]]) -> dict[str, Any]:
    """What a survivor said: its last stderr line (the watcher's), its events,
    what its ``ready`` event named (backend, object stepped, the vote, 0.7.4's
    wait timeout) and its combine's error, if it raised."""
    lines = stderr.read_text().strip().splitlines()
    ready = next((e for e in events if e["event"] == "ready"), {})
    raised = next((e for e in events if e["event"] == "raised"), None)
    return {
        "last_line": lines[-1] if lines else "",
        "events": [e["event"] for e in events],
        **{k: ready.get(k) for k in ("backend", "stepped", "vote_stood_in_for", "wait_timeout_s")},
        "raised": raised and {k: raised[k] for k in ("error", "seconds")},
    }


def _describe(name: str, rank: int, outcome: dict[str, Any], cap: float) -> str:
    """One survivor's line: its backend, what it stepped, and how it ended."""
    where = f"{outcome['backend']}, {outcome['stepped']}"
    where += f", vote_stood_in_for={outcome['vote_stood_in_for']}"
    if outcome["status"] is None:
        ended = f"still hung {cap:g} s after the kill (killed at the cap)"
    else:
        ended = f"ended with status {outcome['status']} {outcome['seconds']:.3f} s after the kill"
    if outcome["raised"]:
        ended += f" (its combine raised {outcome['raised']['error'][:100]!r})"
    return f"{name}: rank {rank} ({where}) {ended}: {outcome['last_line']}"


def summarize(
    backend: str, victim: int, cap: float, results: dict[str, dict[int, dict[str, Any]]]
) -> tuple[str, bool]:
    """The summary line (naming ``backend``); whether the watcher ended every
    survivor with status 75, naming the victim, within 2 s."""
    watched, unwatched = list(results["watcher"].values()), list(results["no-watcher"].values())
    named = all(f"rank {victim} died" in o["last_line"] for o in watched)
    exited = sum(o["status"] == EXIT_STATUS for o in watched)
    all_ended = exited == len(watched)
    slowest = max(o["seconds"] for o in watched) if all_ended else float("inf")
    ended = sorted(o["seconds"] for o in unwatched if o["status"] is not None)
    hung = len(unwatched) - len(ended)
    without = f"{len(ended)} of {len(unwatched)} survivors ended"
    if ended:
        without += f" (the first after {ended[0]:.1f} s, the last after {ended[-1]:.1f} s)"
    if hung:
        timeouts = sorted({o["wait_timeout_s"] for o in unwatched} - {None})
        waits = f"; a wait traps after timeout_sec={timeouts[0]:g} s" if timeouts else ""
        without += f", {hung} still hung at the {cap:g} s cap (capped, not a trap{waits})"
    # The first survivor without the watcher against the last with it; a lower
    # bound when none ended before the cap.
    first = ended[0] if ended else cap
    ratio = f"{'' if ended else 'at least '}{first / slowest:.0f}x" if all_ended else "no ratio"
    within = f", the last within {slowest:.3f} s" if all_ended else ""
    line = (
        f"summary ({backend}): with the watcher {exited} of {len(watched)} survivors exited "
        f"with status {EXIT_STATUS} (naming the dead rank: {named}){within}; without it "
        f"{without}: {ratio}"
    )
    return line, all_ended and named and slowest < WATCHER_WITHIN_S


def main(argv: list[str]) -> int:
    if argv and argv[0] == "rank":
        rank_main(int(argv[1]), int(argv[2]), argv[3], argv[4], argv[5])
        return 0
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--hang-cap", type=float, default=360.0)
    parser.add_argument("--startup", type=float, default=240.0)
    parser.add_argument("--backend", choices=stepping.BACKENDS, default="flashinfer-moe-alltoall")
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="peer-loss-")))
    args = parser.parse_args(argv)
    args.backend = stepping.resolve(args.backend)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {name: scenario(name, args, args.out) for name in SCENARIOS}
    for name, outcomes in results.items():
        for rank, outcome in outcomes.items():
            print(_describe(name, rank, outcome, args.hang_cap))
    (args.out / "peer-loss.json").write_text(json.dumps(results, indent=2))
    line, passed = summarize(args.backend, args.ranks - 1, args.hang_cap, results)
    print(line)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
