"""The environment variables vLLM's room reads, defined once.

``MOE_SIDECAR_VLLM`` is the plugin's switch; vLLM's own
``VLLM_FLASHINFER_MOE_A2A_LOW_PRECISION_COMBINE`` is read as vLLM 0.33's
manager reads it. The sidecar leaves the first to the client: it is in
``moe_sidecar.config``'s ``ENGINE_ENV_KEYS`` (the daemon cannot import the
client; a test checks that the two agree).
"""

from __future__ import annotations

import os
from typing import Final

from moe_sidecar.core.errors import InvalidArgument

__all__ = ["ENV_KEYS", "ENV_VLLM", "LOW_PRECISION_COMBINE", "low_precision_combine"]

ENV_VLLM: Final = "MOE_SIDECAR_VLLM"
"""The vLLM plugin: ``1`` replaces vLLM's manager even without a sidecar
(embedded mode); ``0`` leaves vLLM alone even with ``MOE_SIDECAR_TARGET`` set;
unset: replace it exactly when ``MOE_SIDECAR_TARGET`` is set. Any of
:data:`moe_sidecar.core.defaults.BOOLEAN_FORMS` is accepted, as for every
boolean variable."""
LOW_PRECISION_COMBINE: Final = "VLLM_FLASHINFER_MOE_A2A_LOW_PRECISION_COMBINE"
"""vLLM's own switch for FP8 combine (``bool(int(...))``, default 0)."""
ENV_KEYS: Final = frozenset({ENV_VLLM})
"""The keys with the project's prefix that vLLM's room reads (beyond the
manager's own, ``moe_sidecar.core.defaults.CLIENT_ENV_KEYS``)."""


def low_precision_combine() -> bool:
    """Whether vLLM combines in FP8, read from vLLM's own variable as vLLM
    0.33's manager reads it.

    Raises:
        InvalidArgument: the variable is set to neither 0 nor 1 (naming it).
    """
    flag = os.environ.get(LOW_PRECISION_COMBINE, "0").strip() or "0"
    try:
        return bool(int(flag))
    except ValueError as error:
        raise InvalidArgument.of(LOW_PRECISION_COMBINE, flag, "must be 0 or 1") from error
