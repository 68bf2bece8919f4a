"""``moe-sidecar size --engine sglang``: what SGLang 0.5.23 maps by itself, beside the exact size.

Pure (no torch, no SGLang). The target model's layer kinds (``--dispatch``)
fill the decode namespace; a speculative draft's (``--draft-dispatch``, an
MTP/NEXTN head: SGLang's EAGLE family) fills the speculative one. SGLang's
dispatch type is the target's quantized kind (NVFP4 or MXFP8), else bf16;
with a draft it sizes bf16 rows everywhere (:mod:`.sizing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from moe_sidecar.client.engines.sglang.sizing import (
    SGLANG_VERSION,
    DispatchType,
    Namespace,
    NamespaceSize,
    engine_workspace_bytes,
    exact_workspace_bytes,
)
from moe_sidecar.flashinfer import v0_7_2_post1

__all__ = ["SGLANG_FLASHINFER", "SGLANG_KINDS", "EngineSizeError", "sglang_sizes"]

SGLANG_FLASHINFER: Final = v0_7_2_post1.RELEASE.name
"""The release whose all-to-all SGLang's pin matches file for file (its row
of :data:`moe_sidecar.flashinfer.RELEASES` serves SGLang's version too)."""

SGLANG_KINDS: Final = {
    "bf16": DispatchType.BF16,
    "nvfp4": DispatchType.NVFP4,
    "mxfp8": DispatchType.MXFP8,
}
"""The ``--dispatch`` kinds SGLang's FlashInfer dispatcher sends."""


class EngineSizeError(ValueError):
    """A flag SGLang's sizing cannot take; the message names it."""


def _kinds(flag: str, kinds: Sequence[str]) -> list[DispatchType]:
    unknown = [kind for kind in kinds if kind not in SGLANG_KINDS]
    if unknown:
        raise EngineSizeError(
            f"{flag}={unknown[0]!r}: SGLang {SGLANG_VERSION}'s FlashInfer dispatcher sends "
            f"{', '.join(SGLANG_KINDS)} rows only"
        )
    return [SGLANG_KINDS[kind] for kind in kinds]


def sglang_sizes(
    release: str,
    ep_size: int,
    max_num_tokens: int,
    hidden_size: int,
    top_k: int,
    target: Sequence[str],
    draft: Sequence[str],
) -> list[NamespaceSize]:
    """Each namespace's workspace per rank, SGLang's own and exact.

    Raises:
        EngineSizeError: another FlashInfer release, or a kind SGLang does not send.
    """
    if release != SGLANG_FLASHINFER:
        raise EngineSizeError(
            f"--engine sglang: SGLang {SGLANG_VERSION} builds FlashInfer's MoeAlltoAll "
            f"(--flashinfer {SGLANG_FLASHINFER}), not {release}"
        )
    target_rows = _kinds("--dispatch", target)
    draft_rows = _kinds("--draft-dispatch", draft)
    quantized = [row for row in target_rows if row is not DispatchType.BF16]
    dispatch_type = quantized[0] if quantized else DispatchType.BF16
    eagle = bool(draft_rows)
    namespaces = [(Namespace.DECODE, target_rows)]
    if draft_rows:
        namespaces.append((Namespace.SPECULATIVE, draft_rows))
    return [
        NamespaceSize(
            namespace,
            engine_workspace_bytes(
                ep_size, max_num_tokens, hidden_size, top_k, dispatch_type, namespace, eagle=eagle
            ),
            exact_workspace_bytes(
                ep_size, max_num_tokens, top_k, [(hidden_size, row) for row in rows], namespace
            ),
        )
        for namespace, rows in namespaces
    ]
