"""The round of a requested death (``--kill-rank R --at-round N``), as each rank runs it.

After round N's ``initialize()`` every rank runs one step. Under ``exit``,
``raise`` and ``wait`` rank R stops between its dispatch and its combine and
tells the parent, which kills it (SIGKILL): its peers are in their combine,
waiting for it, as on a GPU. Under ``mask`` it stops between two steps
instead, the quiesced point a masked all-to-all goes on from (FlashInfer's
combine would wait for the dead rank's flags). Each survivor then gives its
library ``--loss-wait`` seconds to act as ``MOE_SIDECAR_ON_PEER_LOSS`` says:

* ``exit``: the watcher ends the process (status 75) with its line on stderr;
* ``raise``: the next call into the manager raises ``RankLost``;
* ``mask``: ``peer_fault()`` turns True; the survivor adopts the sidecar's
  next view and runs :data:`MASKED_STEPS` steps under its mask, each checked
  exactly against the routing without the dead rank's experts;
* ``wait`` (or embedded mode): no watcher; the failed combine is all there is.

What it saw goes to the parent (:mod:`moe_sidecar.client.simulate.death`).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from moe_sidecar.client import WorkspaceManager
from moe_sidecar.client.errors import CoordinatorError
from moe_sidecar.client.peer_loss import PeerLossPolicy, policy_from_environment
from moe_sidecar.client.simulate.death import AtKillPoint, MaskedStep, StepFailed, SurvivorReport
from moe_sidecar.client.simulate.presets import MoeLayer
from moe_sidecar.client.simulate.records import SimulationConfig
from moe_sidecar.client.simulate.steps import combine, dispatch, dropped_copies, exchange

__all__ = ["MASKED_STEPS", "run_kill_round"]

MASKED_STEPS = 3
"""Steps a survivor runs under the committed view (``mask``)."""
_POLL_S = 0.02
"""How often a survivor looks for the library's word while it waits for it."""


def _error_text(error: BaseException) -> str:
    """``Type: message``, its first line only."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first}"


def _step_error_text(error: BaseException) -> str:
    """``Type: message`` of a step's error, gloo's source location and advice left out."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().splitlines()[0] if str(error) else "")
    sentence = text.split(". ", 1)[0].rstrip(".")
    return f"{type(error).__name__}: {sentence}"


def _wait_to_be_killed(config: SimulationConfig) -> None:
    """The rank to be killed waits for the parent's SIGKILL (bounded by the run's timeout).

    Raises:
        RuntimeError: the kill did not come.
    """
    threading.Event().wait(config.timeout)
    raise RuntimeError(f"rank {config.kill_rank} was not killed within {config.timeout:g} s")


def _wait_for_raise(manager: WorkspaceManager, deadline: float) -> tuple[str, float]:
    """Calls into the manager until it raises (``raise``: ``RankLost``) or the deadline."""
    while time.monotonic() < deadline:
        try:
            manager.moe_alltoall  # noqa: B018 (a call into the manager is the point)
        except CoordinatorError as error:
            return _error_text(error), time.monotonic()
        time.sleep(_POLL_S)
    return "", 0.0


def _wait_for_fault(manager: WorkspaceManager, deadline: float) -> tuple[str, float]:
    """Looks at ``peer_fault()`` until it turns True (``mask``) or the deadline."""
    while time.monotonic() < deadline:
        if manager.peer_fault():
            return "peer_fault()", time.monotonic()
        time.sleep(_POLL_S)
    return "", 0.0


def _go_on_masked(
    manager: WorkspaceManager, config: SimulationConfig, layer: MoeLayer, heard: tuple[str, float]
) -> SurvivorReport:
    """``mask``: adopts the next view and runs steps under its mask, each checked."""
    try:
        view = manager.adopt_view(timeout_s=config.loss_wait)
    except CoordinatorError as error:
        return SurvivorReport(
            manager.ep_rank, True, heard[0], heard[1], view_error=_error_text(error)
        )
    adopted_at = time.monotonic()
    steps = []
    for number in range(1, MASKED_STEPS + 1):
        step = dispatch(manager, layer, config.max_tokens, seed=30_000 + number)
        difference = combine(manager, step, view.members)
        steps.append(
            MaskedStep(
                step=number,
                max_error=difference,
                dropped=dropped_copies(manager, step, view.members),
                copies=config.max_tokens * layer.top_k,
            )
        )
    return SurvivorReport(
        manager.ep_rank,
        True,
        heard[0],
        heard[1],
        view_number=view.number,
        view_members=tuple(view.members),
        view_mask=view.mask,
        view_at=adopted_at,
        steps=tuple(steps),
    )


def run_kill_round(
    manager: WorkspaceManager,
    config: SimulationConfig,
    layer: MoeLayer,
    round_number: int,
    send: Callable[[Any], None],
) -> None:
    """Round ``round_number``'s step with rank ``config.kill_rank`` killed in it;
    a survivor returns once its library acted (or the wait ran out) and it sent
    its :class:`SurvivorReport`.

    Raises:
        RuntimeError: (the rank to be killed) the kill did not come; a step
            every rank completed was not exact.
    """
    policy = policy_from_environment(os.environ)
    victim = manager.ep_rank == config.kill_rank
    seed = 20_000 + round_number
    if policy is PeerLossPolicy.MASK:
        if exchange(manager, layer, config.max_tokens, seed) != 0.0:
            raise RuntimeError(f"the step of round {round_number} was not exact")
        if victim:
            send(AtKillPoint(manager.ep_rank, round_number, "between two steps"))
            _wait_to_be_killed(config)
    else:
        step = dispatch(manager, layer, config.max_tokens, seed)
        if victim:
            send(AtKillPoint(manager.ep_rank, round_number, "between its dispatch and its combine"))
            _wait_to_be_killed(config)
        try:
            combine(manager, step, None)
        except Exception as error:  # the dead peer's broken connection, whatever gloo calls it
            send(StepFailed(manager.ep_rank, _step_error_text(error), time.monotonic()))
    watched = not manager.embedded and policy is not PeerLossPolicy.WAIT
    deadline = time.monotonic() + config.loss_wait
    if not watched:
        send(SurvivorReport(manager.ep_rank, False, "", 0.0))
    elif policy is PeerLossPolicy.EXIT:
        # The watcher ends this process; only a death it never heard of comes back here.
        threading.Event().wait(config.loss_wait)
        send(SurvivorReport(manager.ep_rank, True, "", 0.0))
    elif policy is PeerLossPolicy.RAISE:
        heard = _wait_for_raise(manager, deadline)
        send(SurvivorReport(manager.ep_rank, True, *heard))
    else:
        heard = _wait_for_fault(manager, deadline)
        if not heard[0]:
            send(SurvivorReport(manager.ep_rank, True, "", 0.0))
        else:
            send(_go_on_masked(manager, config, layer, heard))
