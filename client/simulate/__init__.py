"""``moe-sidecar simulate``: a model's MoE layers on N CPU rank processes against a sidecar.

One module per job: :mod:`.presets` the models; :mod:`.records` the
configuration, what the ranks report and the result; :mod:`.rank` a rank
process; :mod:`.sidecars` the sidecars it reaches or starts (``--nodes``);
:mod:`.parent` the orchestration of the ranks; :mod:`.summary` the text at
the end; :mod:`.run` the command's run and :mod:`.command` its flags.

The names below load their module on first use, so that
``moe-sidecar simulate --help`` and the sidecar's own commands import no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_sidecar.client.lazy_names import lazy_names

if TYPE_CHECKING:
    from moe_sidecar.client.simulate.parent import run_simulation
    from moe_sidecar.client.simulate.presets import MODELS, ModelPreset, MoeLayer
    from moe_sidecar.client.simulate.records import (
        NodeView,
        RankReport,
        RoundRecord,
        SimulatedRankFailure,
        SimulationConfig,
        SimulationResult,
        resolve_target,
    )
    from moe_sidecar.client.simulate.run import run_cli
    from moe_sidecar.client.simulate.summary import format_summary

__all__ = [
    "MODELS",
    "ModelPreset",
    "MoeLayer",
    "NodeView",
    "RankReport",
    "RoundRecord",
    "SimulatedRankFailure",
    "SimulationConfig",
    "SimulationResult",
    "format_summary",
    "resolve_target",
    "run_cli",
    "run_simulation",
]

__getattr__ = lazy_names(
    __name__,
    {
        "parent": ("run_simulation",),
        "presets": ("MODELS", "ModelPreset", "MoeLayer"),
        "records": (
            "NodeView",
            "RankReport",
            "RoundRecord",
            "SimulatedRankFailure",
            "SimulationConfig",
            "SimulationResult",
            "resolve_target",
        ),
        "run": ("run_cli",),
        "summary": ("format_summary",),
    },
)
