"""The EP group's name on the sidecar: one rule, in one place.

A manager's group name, first match wins:

1. the ``group=`` argument, when the caller passes one;
2. ``MOE_SIDECAR_GROUP``, when set and not empty;
3. inside an engine whose room names groups (vLLM's:
   :mod:`moe_sidecar.client.engines.vllm.naming`), the name the engine's own
   config gives: model, quantization, parallel layout and pipeline stage;
4. embedded mode only: the EP group's global ranks,
   ``embedded/ep<E>/ranks<first>-<last>``.

In sidecar mode with none of 1-3 the manager refuses to start
(:class:`InvalidArgument` naming ``MOE_SIDECAR_GROUP``): a sidecar keeps each
group's plan across restarts, so two deployments must not share a name by
accident. An engine's name is the same on every rank and node of one EP
group and across restarts of the same deployment, which is what makes a
warm restart find its plan; two servers with the same model and layout
behind one sidecar need distinct ``MOE_SIDECAR_GROUP`` values.

The engine's rule is asked only when rules 1 and 2 give no name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

from moe_sidecar.core.defaults import ENV_GROUP
from moe_sidecar.core.errors import InvalidArgument

__all__ = ["EngineGroupName", "group_name", "ranks_group_name", "resolve"]

EngineGroupName = Callable[[], str | None]
"""Rule 3 of an engine's room: the group's name from the engine's config,
None when this process runs no such engine (or its config is not current)."""


def ranks_group_name(global_ranks: Sequence[int]) -> str:
    """The group name of rule 4: the EP group's size and global ranks."""
    return f"embedded/ep{len(global_ranks)}/ranks{min(global_ranks)}-{max(global_ranks)}"


def group_name(
    explicit: str | None,
    environ: Mapping[str, str],
    engine_name: str | None,
    global_ranks: Sequence[int],
    *,
    embedded: bool,
) -> str:
    """The group name by the rule of the module docstring. Pure.

    Args:
        explicit: the ``group=`` argument (None or empty: not given).
        environ: the environment (``MOE_SIDECAR_GROUP``).
        engine_name: the engine's name of the group (rule 3), else None.
        global_ranks: the EP group's global ranks.
        embedded: whether the manager runs without a sidecar.

    Raises:
        InvalidArgument: sidecar mode and no name from rules 1-3.
    """
    if explicit:
        return explicit
    from_env = environ.get(ENV_GROUP, "").strip()
    if from_env:
        return from_env
    if engine_name is not None:
        return engine_name
    if embedded:
        return ranks_group_name(global_ranks)
    raise InvalidArgument(
        f"sidecar mode needs the EP group's name: set {ENV_GROUP} (e.g. "
        "'deepseek-v3:fp4/tp1-ep8/pp0': model + parallel layout + pipeline stage) or pass "
        "group=...; inside vLLM it is derived from vLLM's config",
        field=ENV_GROUP,
        value=None,
    )


def resolve(
    explicit: str | None,
    engine_rule: EngineGroupName | None,
    global_ranks: Sequence[int],
    *,
    embedded: bool,
) -> str:
    """:func:`group_name` with this process's environment and the engine's
    rule (None: the manager runs in no engine that names groups).

    Raises:
        InvalidArgument: see :func:`group_name`.
    """
    named = explicit or os.environ.get(ENV_GROUP, "").strip()
    # The engine's config is read only when needed.
    engine_name = None if named or engine_rule is None else engine_rule()
    return group_name(explicit, os.environ, engine_name, global_ranks, embedded=embedded)
