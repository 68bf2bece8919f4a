"""The rank processes of a bench run, and the events they print.

A rank process reads its commands from stdin, one a line, and prints an
event as one stdout line: a prefix of its script (FlashInfer prints on
stdout too) and a JSON object with ``"event"`` naming it (:func:`say`).
:class:`RankProcesses` starts them, keeps each rank's latest event of each
kind (its other output in a log file), and wakes a waiting driver at each
event and when a rank's output ends (it exited). Used by
``bench/masked_steps_gpu.py`` and ``bench/rejoin_gpu.py``.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

__all__ = ["RankProcesses", "say"]

REPO = Path(__file__).resolve().parents[1]
"""Where the ranks run: the repository's packages importable."""


def say(prefix: str, event: str, **fields: Any) -> None:
    """Prints the event ``event`` with ``fields`` (a rank's side)."""
    print(prefix + json.dumps({"event": event, **fields}), flush=True)


class RankProcesses:
    """The rank processes of one run (the driver's side).

    Args:
        out: where each rank's stderr and other stdout go
            (``NAME.stderr``, ``NAME.stdout``).
        prefix: what starts an event line.
    """

    def __init__(self, out: Path, prefix: str) -> None:
        self.out, self.prefix = out, prefix
        self.processes: dict[int, subprocess.Popen[str]] = {}
        self.events: dict[int, dict[str, dict[str, Any]]] = {}
        """Each rank's latest event of each kind; read under :attr:`changed`."""
        self.changed = threading.Condition()

    def start(
        self, rank: int, command: list[str], name: str, env: dict[str, str] | None = None
    ) -> None:
        """Starts ``command`` as rank ``rank`` (a replacement takes the place,
        and a fresh event record, of the rank it replaces)."""
        with open(self.out / f"{name}.stderr", "w") as stderr:
            process = subprocess.Popen(
                command,
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        assert process.stdout is not None
        events: dict[str, dict[str, Any]] = {}
        with self.changed:
            self.processes[rank], self.events[rank] = process, events
        threading.Thread(
            target=self._read,
            args=(process.stdout, self.out / f"{name}.stdout", events),
            daemon=True,
        ).start()

    def _read(self, stdout: IO[str], log: Path, events: dict[str, dict[str, Any]]) -> None:
        with open(log, "w") as other:
            for line in stdout:
                if not line.startswith(self.prefix):
                    other.write(line)
                    continue
                event = json.loads(line[len(self.prefix) :])
                with self.changed:
                    events[event.pop("event")] = event
                    self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def send(self, ranks: Iterable[int], line: str) -> None:
        """Writes the command ``line`` to each of ``ranks``."""
        for rank in ranks:
            stdin = self.processes[rank].stdin
            assert stdin is not None
            with contextlib.suppress(BrokenPipeError):  # it ended already: its status says how
                stdin.write(line + "\n")
                stdin.flush()

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Waits (at most ``timeout_s`` s) until ``predicate``, called under
        :attr:`changed` at each event and exit, holds; whether it does."""
        with self.changed:
            return self.changed.wait_for(predicate, timeout=timeout_s)

    def ended(self, rank: int) -> bool:
        """Whether rank ``rank``'s process has exited."""
        return self.processes[rank].poll() is not None
