"""What an engine's room tells the engine-neutral manager beyond a layer's need.

A room passes one :class:`EngineRules` to
:class:`~moe_sidecar.client.manager.AlltoAllManager`: how the engine names
the EP group (rule 3 of :mod:`moe_sidecar.client.naming`) and whether it
combines in low precision. :data:`NO_ENGINE` is the manager used alone (a
tool, a test, an engine with no room yet).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["NO_ENGINE", "EngineRules"]


def _no_name(cpu_group: Any) -> str | None:
    return None


def _full_precision() -> bool:
    return False


@dataclass(frozen=True)
class EngineRules:
    """An engine's rules the manager follows."""

    group_name: Callable[[Any], str | None] = _no_name
    """The EP group's name from the engine's own config, given the group's
    CPU group; None when this process runs no such engine. Asked only when
    neither ``group=`` nor ``MOE_SIDECAR_GROUP`` names the group."""
    low_precision_combine: Callable[[], bool] = _full_precision
    """Whether the engine combines in FP8 (FlashInfer's
    ``use_low_precision_combine``); read at every build and every
    communication object made.

    Raises:
        InvalidArgument: the engine's setting is malformed (naming it)."""


NO_ENGINE = EngineRules()
"""No engine: no name from an engine's config, bf16 combine."""
