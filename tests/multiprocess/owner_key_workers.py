"""Rank processes of ``test_owner_key_refusal.py``: every rank initializes one
layer; rank 0's owner key directory is whatever the test gave it."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from tests.multiprocess.workers import failure_report, initialize, nvfp4_layer, reference_manager


def first_initialize_worker(rank: int, world: int, target: str, group: str) -> dict[str, Any]:
    """The rank's first ``initialize()``: its failure report, or ``{"ok": True}``."""
    cpu_group = dist.new_group(backend="gloo")
    manager = reference_manager(cpu_group, group, target)
    try:
        initialize(manager, nvfp4_layer("layer.1"))
    except Exception as error:
        return failure_report(error)
    return {"ok": True}
