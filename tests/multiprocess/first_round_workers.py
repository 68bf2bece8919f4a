"""Rank processes of ``test_first_round.py``: a rank that reaches its first
``initialize()`` only once the test lets it (a file appears), or that dies
while its peers share the group's proof."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tests.multiprocess.workers import (
    failure_report,
    initialize,
    nvfp4_layer,
    reference_manager,
)

DEATH_STATUS = 19
"""The exit status of the rank that dies at its first round."""


def _wait_for_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.02)  # the poll interval of a wait with a deadline


def late_rank_worker(
    rank: int, world: int, target: str, group: str, late: int, release: str
) -> dict[str, Any]:
    """Every rank initializes one layer; rank ``late`` only once ``release`` exists.

    Returns the rank's failure report (with ``started``/``at`` on
    CLOCK_MONOTONIC), or ``{"ok": True}``.
    """
    cpu_group = dist.new_group(backend="gloo")
    manager = reference_manager(cpu_group, group, target)
    if rank == late:
        _wait_for_file(Path(release), timeout=120)
    started = time.monotonic()
    try:
        initialize(manager, nvfp4_layer("layer.1"))
    except Exception as error:
        return {**failure_report(error), "started": started}
    finally:
        manager._transport.close()
    return {"ok": True, "started": started, "at": time.monotonic()}


def dying_arrival_worker(
    rank: int, world: int, target: str, group: str, dying: int, arrived: str, release: str
) -> dict[str, Any] | None:
    """Rank ``dying`` arrives and dies (``os._exit``) once ``arrived`` exists
    (the test saw it arrive); the others initialize once ``release`` exists."""
    cpu_group = dist.new_group(backend="gloo")
    manager = reference_manager(cpu_group, group, target)
    if rank == dying:

        def die() -> None:
            _wait_for_file(Path(arrived), timeout=120)
            os._exit(DEATH_STATUS)

        threading.Thread(target=die, daemon=True).start()
        initialize(manager, nvfp4_layer("layer.1"))
        return None
    _wait_for_file(Path(release), timeout=120)
    try:
        initialize(manager, nvfp4_layer("layer.1"))
    except Exception as error:
        return failure_report(error)
    return {"ok": True}


def _first_call(rank: int, target: str, group: str) -> dict[str, Any]:
    """Constructs rank ``rank``'s manager and initializes one layer: its first
    call, timed from before the construction (``waited``, seconds)."""
    started = time.monotonic()
    try:
        manager = reference_manager(dist.group.WORLD, group, target)
        try:
            initialize(manager, nvfp4_layer("layer.1"))
        finally:
            manager._transport.close()
    except Exception as error:
        return {**failure_report(error), "waited": time.monotonic() - started}
    return {"ok": True, "waited": time.monotonic() - started}


def peer_absent_worker(
    rank: int, world: int, target: str, group: str, how: str, late_s: float, done: str
) -> dict[str, Any] | None:
    """Rank 0 makes its first call at once and writes ``done`` once it ended;
    rank 1 is absent from it, as ``how`` says:

    - ``"late"``: it makes its first call once ``done`` exists, or after
      ``late_s`` seconds;
    - ``"never"``: it waits the same way, then returns without a call;
    - ``"killed"``: it exits (``os._exit``) before any call.
    - ``"on_time"``: it makes its first call ``late_s`` seconds late.
    """
    dist.barrier()  # both ranks are up: lateness is counted from here
    if rank == 0:
        report = _first_call(rank, target, group)
        Path(done).touch()
        return report
    if how == "killed":
        os._exit(DEATH_STATUS)
    if how == "on_time":
        time.sleep(late_s)  # the lateness under test, shorter than the round timeout
        return _first_call(rank, target, group)
    with contextlib.suppress(TimeoutError):  # late by ``late_s``: rank 0 still waits
        _wait_for_file(Path(done), timeout=late_s)
    return _first_call(rank, target, group) if how == "late" else {"never": True}
