"""The sidecar group of one SGLang workspace namespace: one rule, in one place.

SGLang keeps one all-to-all workspace per namespace (decode, speculative, SP
prefill), so each namespace is its own EP group on the sidecar, named

``<model>:<quantization>/tp<T>-pp<P>-dp<D>-ep<E>/pp<stage>/<namespace>``

e.g. ``deepseek-ai/DeepSeek-V3:modelopt_fp4/tp8-pp1-dp8-ep8/pp0/decode``.
``MOE_SIDECAR_GROUP`` replaces everything before ``/<namespace>`` (the
namespaces stay apart). The SP-prefill workspace of a speculative draft is
``sp-prefill-draft``: the draft's model is loaded after the target's graphs
are captured, so it cannot grow the target's group. The name is the same on
every rank of the EP group and across restarts of one deployment. Pure.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from moe_sidecar.client.engines.sglang.sizing import Namespace
from moe_sidecar.core.defaults import ENV_GROUP
from moe_sidecar.core.limits import MAX_NAME_LENGTH

__all__ = ["SglangLayout", "namespace_label", "sglang_group_name"]


@dataclass(frozen=True)
class SglangLayout:
    """What names an EP group inside SGLang (its runtime context's topology)."""

    model: str
    """``model_config.model_path`` (a Hugging Face id or a path)."""
    quantization: str | None
    tp_size: int
    pp_size: int
    dp_size: int
    """Attention data parallelism (``attn_dp_size``)."""
    ep_size: int
    """``moe_ep_size``: the EP group's size."""
    pp_stage: int
    draft: bool
    """A speculative draft model's runner."""


def namespace_label(namespace: Namespace, *, draft: bool) -> str:
    """``decode``, ``speculative``, ``sp-prefill`` or ``sp-prefill-draft``."""
    label = namespace.name.lower().replace("_", "-")
    return f"{label}-draft" if draft and namespace is Namespace.SP_PREFILL else label


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in text)


def sglang_group_name(
    layout: SglangLayout, namespace: Namespace, environ: Mapping[str, str]
) -> str:
    """The group name of ``namespace`` (see the module docstring); at most
    ``MAX_NAME_LENGTH`` characters, printable."""
    suffix = "/" + namespace_label(namespace, draft=layout.draft)
    explicit = environ.get(ENV_GROUP, "").strip()
    if explicit:
        return (explicit[: MAX_NAME_LENGTH - len(suffix)]) + suffix
    trunk = (
        f":{_printable(layout.quantization or 'unquantized')}"
        f"/tp{layout.tp_size}-pp{layout.pp_size}-dp{layout.dp_size}-ep{layout.ep_size}"
        f"/pp{layout.pp_stage}{suffix}"
    )
    model = _printable(layout.model or "unknown-model")
    room = MAX_NAME_LENGTH - len(trunk)
    if len(model) > room:
        # The end of a model path names it best; the hash keeps two long
        # paths with the same end apart.
        digest = hashlib.sha256(layout.model.encode()).hexdigest()[:12]
        keep = max(room - len(digest) - 4, 0)
        model = f"...{model[len(model) - keep :]}#{digest}"
    return (model + trunk)[:MAX_NAME_LENGTH]
