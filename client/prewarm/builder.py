"""One target built in a child process, with a timeout and a progress line.

The child (:mod:`moe_sidecar.client.prewarm.worker`) runs in its own session
so that a stop ends it and everything it started (ninja, nvcc); this process
never imports FlashInfer.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from moe_sidecar.client.prewarm.archs import ENV_ARCH_LIST, sorted_archs
from moe_sidecar.client.prewarm.build_plan import Target
from moe_sidecar.client.prewarm.cache import ENV_WORKSPACE_BASE
from moe_sidecar.client.prewarm.errors import BuildFailed

__all__ = ["TargetOutcome", "TargetResult", "build_target"]

_PROGRESS_EVERY_LOG = 10.0
_PROGRESS_EVERY_TTY = 1.0
_ERROR_TAIL_LINES = 40

TargetOutcome = Literal["built", "up-to-date", "already-built", "ahead-of-time", "failed"]


@dataclass
class TargetResult:
    """What happened to one target."""

    target: Target
    outcome: TargetOutcome
    seconds: float = 0.0
    library_bytes: int | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        """This target's entry in ``--json``'s ``targets``."""
        paths = self.target.paths
        return {
            "archs": [a.label for a in sorted_archs(self.target.archs)],
            "label": self.target.label,
            "outcome": self.outcome,
            "library": str(paths.library),
            "workspace_dir": str(paths.workspace_dir),
            "seconds": round(self.seconds, 3),
            "library_bytes": self.library_bytes,
            "error": self.error,
            "notes": self.notes,
        }


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Ends the worker and everything it started (ninja, nvcc): its own session."""
    if process.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(text: str, lines: int = _ERROR_TAIL_LINES) -> str:
    kept = text.rstrip().splitlines()
    if len(kept) <= lines:
        return "\n".join(kept)
    return "\n".join([f"[... {len(kept) - lines} lines ...]", *kept[-lines:]])


def _child_env(target: Target, env: Mapping[str, str]) -> dict[str, str]:
    child_env = dict(env)
    child_env[ENV_ARCH_LIST] = " ".join(a.label for a in sorted_archs(target.archs))
    child_env[ENV_WORKSPACE_BASE] = str(target.paths.base)
    # No GPU needed, and none touched: the targets come from the list above.
    child_env["CUDA_VISIBLE_DEVICES"] = ""
    child_env.pop("FLASHINFER_DISABLE_JIT", None)
    # The child imports what this process imports (this flashinfer, this torch).
    child_env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    return child_env


def _worker_command(
    target: Target, result_file: Path, verbose: bool, package_dir: Path | None
) -> list[str]:
    request: dict[str, object] = {
        "result": str(result_file),
        "library": str(target.paths.library),
        "verbose": verbose,
        "spec_factory": target.jit_module.spec_factory,
    }
    if package_dir is not None:
        request["package_dir"] = str(package_dir)
    code = "from moe_sidecar.client.prewarm.worker import main; main()"
    return [sys.executable, "-c", code, json.dumps(request)]


def _wait(
    process: subprocess.Popen[bytes],
    target: Target,
    *,
    started: float,
    timeout: float,
    progress: IO[str] | None,
    every: float,
    tty: bool,
) -> None:
    """Waits for the build process, writing a progress line every ``every`` seconds.

    On a terminal the line is rewritten in place and cleared at the end.

    Raises:
        BuildFailed: it ran past ``timeout``; it is stopped, with all it started.
    """
    try:
        next_line = started + every
        while True:
            now = time.monotonic()
            try:
                process.wait(timeout=max(0.05, min(next_line, started + timeout) - now))
                return
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if now - started >= timeout:
                _stop(process)
                raise BuildFailed(
                    f"{target.label}: the build ran past --timeout {timeout:.0f} s and was stopped"
                )
            if progress is not None and now >= next_line:
                module = target.jit_module.name
                line = f"  {target.label}: compiling {module} ... {now - started:.0f} s"
                progress.write(f"\r{line}" if tty else f"{line}\n")
                progress.flush()
                next_line += every
    except BaseException:
        _stop(process)
        raise
    finally:
        if tty and progress is not None:
            progress.write("\r\033[K")
            progress.flush()


def _outcome(
    target: Target, returncode: int, child: Mapping[str, Any], output: str, seconds: float
) -> TargetResult:
    """The result of a finished build process, from its exit status and its JSON result.

    Raises:
        BuildFailed: it failed (the error with the tail of its output).
    """
    if returncode != 0 or "error" in child:
        detail = child.get("error") or f"the build process exited with {returncode}"
        if output and output.strip() not in detail:
            detail += "\n" + _tail(output)
        raise BuildFailed(f"{target.label}: {_tail(detail)}")
    result = TargetResult(
        target=target,
        outcome="built" if child.get("compiled") else "up-to-date",
        seconds=seconds,
        library_bytes=child.get("library_bytes"),
    )
    for aot in child.get("aot") or []:
        result.notes.append(f"FlashInfer loads the ahead-of-time copy {aot} instead of this cache")
    return result


def build_target(
    target: Target,
    *,
    env: Mapping[str, str],
    verbose: bool = False,
    timeout: float = 1800.0,
    progress: IO[str] | None = None,
    progress_every: float | None = None,
    package_dir: Path | None = None,
) -> TargetResult:
    """Builds one target in a child process, printing elapsed time while it runs.

    Args:
        target: the target (its paths and its module: what is built where).
        env: the environment the child starts from (build variables included).
        verbose: let ninja/nvcc print to this process's stderr.
        timeout: seconds before the build is stopped.
        progress: where the progress line goes (None: nowhere).
        progress_every: seconds between progress lines (default: 1 on a
            terminal, where the line is rewritten in place, else 10).
        package_dir: the flashinfer package the plan was made for; the child
            checks it imports that one.

    Raises:
        BuildFailed: the build failed or ran past ``timeout``.
    """
    tty = progress is not None and progress.isatty()
    every = progress_every or (_PROGRESS_EVERY_TTY if tty else _PROGRESS_EVERY_LOG)
    with tempfile.TemporaryDirectory(prefix="moe-sidecar-prewarm-") as tmp:
        result_file = Path(tmp) / "result.json"
        log_file = Path(tmp) / "build.log"
        command = _worker_command(target, result_file, verbose, package_dir)
        started = time.monotonic()
        with open(log_file, "wb") as log:
            process = subprocess.Popen(
                command,
                env=_child_env(target, env),
                stdin=subprocess.DEVNULL,
                stdout=None if verbose else log,
                stderr=None if verbose else subprocess.STDOUT,
                start_new_session=True,
            )
            # With --verbose the compiler's own output is the progress.
            shown = None if verbose else progress
            _wait(
                process,
                target,
                started=started,
                timeout=timeout,
                progress=shown,
                every=every,
                tty=tty,
            )
        seconds = time.monotonic() - started
        output = "" if verbose else log_file.read_text(errors="replace")
        try:
            child: dict[str, Any] = json.loads(result_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            child = {}
    return _outcome(target, process.returncode, child, output, seconds)
