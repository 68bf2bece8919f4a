"""``moe-sidecar simulate``: a model's MoE layers on N CPU rank processes against a sidecar.

The implementation loads on first use of a name below, so that
``moe-sidecar simulate --help`` and the sidecar's own commands import no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moe_sidecar.client.simulate.simulation import (
        MODELS,
        ModelPreset,
        MoeLayer,
        NodeView,
        RankFailure,
        RankReport,
        RoundRecord,
        SimulationConfig,
        SimulationResult,
        format_summary,
        resolve_target,
        run_cli,
        run_simulation,
    )

__all__ = [
    "MODELS",
    "ModelPreset",
    "MoeLayer",
    "NodeView",
    "RankFailure",
    "RankReport",
    "RoundRecord",
    "SimulationConfig",
    "SimulationResult",
    "format_summary",
    "resolve_target",
    "run_cli",
    "run_simulation",
]

_IMPLEMENTATION = "moe_sidecar.client.simulate.simulation"


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(_IMPLEMENTATION), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
