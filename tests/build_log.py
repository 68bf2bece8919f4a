"""The manager's build lines, as data, read from its log.

``WorkspaceManager`` logs every build and rebuild as ``group %s round %d
(%s): %s at %d bytes/rank, %d tokens, generation %d (%.3fs)``. Reading those
lines lets tests run vLLM's own test bodies verbatim (they keep no sizes)
and still check every workspace built.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

__all__ = ["BuildLog", "recording_builds"]


class BuildLog(logging.Handler):
    """Collects ``(action, workspace bytes per rank, max tokens)`` per build."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.builds: list[tuple[str, int, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "bytes/rank" in str(record.msg) and isinstance(record.args, tuple):
            args: tuple[Any, ...] = record.args
            _, _, _, action, workspace, tokens, _, _ = args
            self.builds.append((str(action), int(workspace), int(tokens)))


@contextlib.contextmanager
def recording_builds() -> Iterator[BuildLog]:
    """The builds of every manager in this process while the block runs."""
    log = BuildLog()
    logger = logging.getLogger("moe_sidecar.client.manager")
    level = logger.level
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    try:
        yield log
    finally:
        logger.removeHandler(log)
        logger.setLevel(level)
