"""The environment variable SGLang's room reads, defined once.

``MOE_SIDECAR_SGLANG`` is the plugin's switch. The sidecar leaves it to the
client: it is in ``moe_sidecar.config``'s ``ENGINE_ENV_KEYS`` (the daemon
cannot import the client; a test checks that the two agree).
"""

from __future__ import annotations

from typing import Final

__all__ = ["ENV_KEYS", "ENV_SGLANG"]

ENV_SGLANG: Final = "MOE_SIDECAR_SGLANG"
"""The SGLang plugin, as ``MOE_SIDECAR_VLLM`` for vLLM: ``1`` sizes SGLang's
FlashInfer dispatcher even without a sidecar (embedded mode), ``0`` never;
unset: exactly when ``MOE_SIDECAR_TARGET`` is set."""
ENV_KEYS: Final = frozenset({ENV_SGLANG})
"""The keys with the project's prefix that SGLang's room reads (beyond the
manager's own, ``moe_sidecar.core.defaults.CLIENT_ENV_KEYS``)."""
