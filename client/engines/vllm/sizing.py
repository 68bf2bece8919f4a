"""What each vLLM generation's ``initialize()`` asks for, as capacities. Pure.

vLLM's ``FlashInferNVLinkOneSidedManager.initialize(max_num_tokens, top_k,
num_experts, hidden_size, ...)`` has taken three pairs of trailing arguments
(``vllm/distributed/device_communicators/all2all.py`` of each release):

==================  ==============================================  =====================================
generation          arguments after ``hidden_size``                 activation bytes per token (A)
==================  ==============================================  =====================================
PR #42976           ``dispatch_dtype_bytes_per_elem`` (0 NVFP4,     ``hidden // 2`` for 0, else
                    1 FP8, 2 bf16), ``dispatch_scale_bytes_per_     ``hidden * code``; plus the scale
                    token`` (defaults 0, 0)                         bytes
0.30.0              ``x_bytes_per_token``, ``x_sf_bytes_per_token``  their sum
                    (both required)
0.33.0              ``dispatch_format`` (FlashInfer ``QuantFormat``  FlashInfer's bytes of the format
                    or None = bf16 rows), ``extra_payload_bytes_     (table below) plus the extra
                    per_token`` (defaults None, 0)
==================  ==============================================  =====================================

Every generation then sizes the layer alike, by the one per-layer rule
(:func:`moe_sidecar.core.layer.layer_capacities`): dispatch bytes per token
``A + 4 * top_k + 4 * top_k`` (int32 expert ids, float32 weights), combine
bytes per token ``2 * hidden`` (bf16 rows; 0.33 computes
``hidden * max(bf16.itemsize, 2)``), and FlashInfer's
``moe_a2a_get_workspace_size_per_rank`` of those; :class:`Capacities` holds
exactly these numbers, so the derived workspace is byte-equal to what that
vLLM version computes for the layer.

:func:`classify_call` serves every call style of the three, keyword and
positional, and refuses (:class:`InvalidArgument`, naming the argument and the
keyword probably meant) what could build a workspace smaller than the layer
needs: values that fit no generation, two generations' keywords in one call,
and PR #42976's NVFP4 code without its scale bytes.

Nothing here imports torch or FlashInfer: a ``QuantFormat`` is read by its
``name``, as FlashInfer itself reads it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from moe_sidecar.client.layer_need import Layout
from moe_sidecar.core.errors import InvalidArgument
from moe_sidecar.core.layer import layer_capacities
from moe_sidecar.core.limits import MAX_BYTES_PER_TOKEN, check_capacities, check_count
from moe_sidecar.core.plan import Capacities
from moe_sidecar.core.sizing import bf16_row_bytes, routing_bytes_per_token

# vLLM 0.33 sizes a QuantFormat by the table of the FlashInfer release it pins
# (the room's default release); re-exported for the client's other modules.
from moe_sidecar.flashinfer.v0_7_2_post1 import DISPATCH_FORMAT_BYTES

__all__ = [
    "DISPATCH_FORMAT_BYTES",
    "KEYWORDS",
    "UNSET",
    "Generation",
    "LayerCall",
    "classify_call",
    "describe_activation",
    "dispatch_format_name",
    "pr42976_activation_bytes",
    "routing_bytes_per_token",
]


class Generation(enum.Enum):
    """Which vLLM ``initialize()`` signature a call follows."""

    PR42976 = "PR #42976"
    V0_30 = "vLLM 0.30"
    V0_33 = "vLLM 0.33"


KEYWORDS: Final[Mapping[Generation, tuple[str, str]]] = {
    Generation.PR42976: ("dispatch_dtype_bytes_per_elem", "dispatch_scale_bytes_per_token"),
    Generation.V0_30: ("x_bytes_per_token", "x_sf_bytes_per_token"),
    Generation.V0_33: ("dispatch_format", "extra_payload_bytes_per_token"),
}
"""The two trailing parameters of each generation, in positional order."""


class _Unset(enum.Enum):
    UNSET = "UNSET"


UNSET: Final = _Unset.UNSET
"""A keyword the caller did not pass (None is a value: 0.33's bf16 rows)."""

_PR_CODES: Final = {0: "NVFP4, hidden_size // 2 bytes", 1: "FP8", 2: "bf16/fp16"}


@dataclass(frozen=True)
class LayerCall:
    """One ``initialize()`` call, understood: its generation and what it needs."""

    generation: Generation
    capacities: Capacities
    layout: Layout


def dispatch_format_name(value: object, argument: str = "dispatch_format") -> str | None:
    """The ``QuantFormat`` name of ``value`` (None stays None: bf16 rows).

    Accepts a ``QuantFormat`` member (FlashInfer reads only its ``name``), any
    enum member of the same names, or the name itself.

    Raises:
        InvalidArgument: not a format FlashInfer's one-sided dispatch carries,
            naming ``argument``, the value and the keyword probably meant.
    """
    if value is None:
        return None
    if isinstance(value, int):  # bool included
        raise InvalidArgument.of(
            argument,
            value,
            "an integer is not a QuantFormat; a bytes-per-element code is PR #42976's "
            "dispatch_dtype_bytes_per_elem, bytes per token are vLLM 0.30's x_bytes_per_token",
        )
    name = value if isinstance(value, str) else getattr(value, "name", None)
    if isinstance(name, str) and name in DISPATCH_FORMAT_BYTES:
        return name
    raise InvalidArgument.of(
        argument,
        value,
        "must be None (bf16 rows) or a QuantFormat FlashInfer's one-sided dispatch carries: "
        + ", ".join(DISPATCH_FORMAT_BYTES),
    )


def pr42976_activation_bytes(hidden_size: int, dispatch_dtype_bytes_per_elem: int) -> int:
    """PR #42976's activation bytes per token (before scales): ``hidden // 2``
    for code 0 (NVFP4's packed nibbles), else ``hidden * code``."""
    if dispatch_dtype_bytes_per_elem == 0:
        return hidden_size // 2
    return hidden_size * dispatch_dtype_bytes_per_elem


def describe_activation(hidden_size: int, activation_bytes: int) -> tuple[str | None, int]:
    """The 0.33 description of ``activation_bytes`` per token at ``hidden_size``:
    ``(format name or None, extra bytes)`` with the largest format that fits
    (None, bf16 rows, when ``2 * hidden`` fits). Used to describe layers sized
    by PR #42976 or 0.30 arguments; a size below every format is described as
    NVFP4 with no extra (a description only: the workspace is sized by the
    capacities).
    """
    if activation_bytes >= bf16_row_bytes(hidden_size):
        return None, activation_bytes - bf16_row_bytes(hidden_size)
    best: tuple[str, int] | None = None
    for name, size in DISPATCH_FORMAT_BYTES.items():
        need = size(hidden_size)
        if need <= activation_bytes and (best is None or need > best[1]):
            best = (name, need)
    if best is None:
        return "NVFP4", 0
    return best[0], activation_bytes - best[1]


def _integer(argument: str, value: object, low: int, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        hint = ""
        if getattr(value, "name", None) in DISPATCH_FORMAT_BYTES or value is None:
            hint = "; a QuantFormat (or None) is vLLM 0.33's dispatch_format"
        raise InvalidArgument.of(argument, value, f"must be an integer{hint}")
    check_count(argument, value, low, MAX_BYTES_PER_TOKEN, why)
    return value


def _pr42976(hidden: int, code: object, scale: object) -> tuple[int, Layout]:
    name = KEYWORDS[Generation.PR42976][0]
    if isinstance(code, int) and not isinstance(code, bool) and code not in _PR_CODES:
        probably = (
            f"; {code} bytes per token is vLLM 0.30's x_bytes_per_token"
            if code >= hidden // 2
            else ""
        )
        raise InvalidArgument.of(
            name,
            code,
            "must be a bytes-per-element code: "
            + ", ".join(f"{c} ({what})" for c, what in _PR_CODES.items())
            + probably,
        )
    code = _integer(name, code, 0)
    scale = _integer(KEYWORDS[Generation.PR42976][1], scale, 0)
    if code == 0 and scale == 0:
        raise InvalidArgument.of(
            KEYWORDS[Generation.PR42976][1],
            scale,
            f"with {name}=0 (NVFP4) the layer's scale bytes are missing: NVFP4 carries "
            f"hidden_size // 16 = {hidden // 16} scale bytes per token, and a workspace sized "
            f"without them is too small (vLLM PR #44946); pass "
            f"dispatch_scale_bytes_per_token={hidden // 16}",
        )
    activation = pr42976_activation_bytes(hidden, code) + scale
    return activation, _described(hidden, activation)


def _v0_30(hidden: int, x_bytes: object, x_sf_bytes: object) -> tuple[int, Layout]:
    x_name, sf_name = KEYWORDS[Generation.V0_30]
    if x_sf_bytes is UNSET:
        raise InvalidArgument.of(
            sf_name,
            None,
            f"missing: vLLM 0.30's initialize() takes {x_name} and {sf_name} together "
            "(0 when the layer has no scales)",
        )
    if (
        isinstance(x_bytes, int)
        and not isinstance(x_bytes, bool)
        and 0 <= x_bytes < max(hidden // 2, 1)
    ):
        probably = (
            f"; {x_bytes} looks like PR #42976's bytes-per-element code "
            f"(dispatch_dtype_bytes_per_elem={x_bytes})"
            if x_bytes in _PR_CODES
            else ""
        )
        raise InvalidArgument.of(
            x_name,
            x_bytes,
            f"is below hidden_size // 2 = {hidden // 2}, the fewest bytes a token's "
            f"activations take (4-bit){probably}",
        )
    activation = _integer(x_name, x_bytes, 1) + _integer(sf_name, x_sf_bytes, 0)
    return activation, _described(hidden, activation)


def _v0_33(hidden: int, dispatch_format: object, extra: object) -> tuple[int, Layout]:
    format_name = dispatch_format_name(dispatch_format)
    extra_bytes = _integer(KEYWORDS[Generation.V0_33][1], extra, 0)
    # vLLM 0.33 builds MoEEpCommParams(dtype=torch.bfloat16, ...): None is bf16 rows.
    format_bytes = (
        bf16_row_bytes(hidden)
        if format_name is None
        else DISPATCH_FORMAT_BYTES[format_name](hidden)
    )
    layout = Layout(
        hidden_size=hidden,
        dispatch_format=dispatch_format,
        format_name=format_name,
        format_bytes=format_bytes,
        extra_payload_bytes_per_token=extra_bytes,
    )
    return layout.activation_bytes, layout


def _described(hidden: int, activation: int) -> Layout:
    name, extra = describe_activation(hidden, activation)
    size = bf16_row_bytes(hidden) if name is None else DISPATCH_FORMAT_BYTES[name](hidden)
    return Layout(
        hidden_size=hidden,
        dispatch_format=name,
        format_name=name,
        format_bytes=size,
        extra_payload_bytes_per_token=extra,
    )


_SIZING = {
    Generation.PR42976: _pr42976,
    Generation.V0_30: _v0_30,
    Generation.V0_33: _v0_33,
}
_DEFAULTS: Final[Mapping[Generation, tuple[object, object]]] = {
    Generation.PR42976: (0, 0),
    Generation.V0_30: (UNSET, UNSET),
    Generation.V0_33: (None, 0),
}


def _positional_generation(hidden: int, fifth: object) -> Generation:
    """The generation a positional 5th argument belongs to (no keywords given)."""
    if fifth is None or isinstance(fifth, (str, enum.Enum)):
        return Generation.V0_33
    if isinstance(fifth, bool) or not isinstance(fifth, int):
        raise InvalidArgument.of(
            "5th argument",
            fifth,
            "must be PR #42976's dispatch_dtype_bytes_per_elem (0, 1 or 2), vLLM 0.30's "
            "x_bytes_per_token (bytes per token) or vLLM 0.33's dispatch_format (a QuantFormat "
            "or None)",
        )
    is_code = fifth in _PR_CODES
    is_bytes = fifth >= max(hidden // 2, 1)
    if is_code and is_bytes:
        raise InvalidArgument.of(
            "5th argument",
            fifth,
            f"is ambiguous at hidden_size={hidden}: PR #42976's bytes-per-element code "
            f"(dispatch_dtype_bytes_per_elem={fifth}) or vLLM 0.30's bytes per token "
            f"(x_bytes_per_token={fifth}); pass it by keyword",
        )
    if is_code:
        return Generation.PR42976
    if is_bytes:
        return Generation.V0_30
    raise InvalidArgument.of(
        "5th argument",
        fifth,
        "is neither PR #42976's bytes-per-element code (dispatch_dtype_bytes_per_elem: "
        + ", ".join(f"{c} {what}" for c, what in _PR_CODES.items())
        + f") nor vLLM 0.30's bytes per token (x_bytes_per_token >= hidden_size // 2 = "
        f"{hidden // 2}); pass it by keyword",
    )


def classify_call(
    ep_size: int,
    max_num_tokens: int,
    top_k: int,
    num_experts: int,
    hidden_size: int,
    positional: tuple[object, ...],
    keywords: Mapping[str, object],
) -> LayerCall:
    """Understands one ``initialize()`` call of any vLLM generation.

    Args:
        ep_size: ranks of the EP group (to check the derived workspace).
        max_num_tokens, top_k, num_experts, hidden_size: the four leading
            arguments every generation shares.
        positional: the arguments passed positionally after ``hidden_size``.
        keywords: the trailing arguments passed by keyword, by name (only
            names of :data:`KEYWORDS`; a missing keyword is absent or
            :data:`UNSET`).

    The generation is the one whose keywords were used. Without keywords,
    the 5th positional argument decides: a ``QuantFormat`` or None is vLLM
    0.33's ``dispatch_format``; an integer 0, 1 or 2 is PR #42976's
    bytes-per-element code; an integer of at least ``hidden_size // 2`` is
    vLLM 0.30's bytes per token; the 6th is then that generation's second
    argument (scale bytes per token in both older generations). No trailing
    argument at all is vLLM 0.33's default: bf16 rows (the largest default of
    any generation; PR #42976's ``(0, 0)`` would be NVFP4 without scales).

    Raises:
        InvalidArgument: naming the argument, its value and the keyword
            probably meant: a value no generation accepts, an ambiguous
            positional value, two generations' keywords in one call, an
            argument given twice, a missing required one, or a range error.
    """
    check_count("hidden_size", hidden_size, 1, MAX_BYTES_PER_TOKEN)
    given = _given_keywords(keywords, positional)
    generation = _generation_of(hidden_size, positional, given)
    first, second = _trailing_arguments(generation, positional, given)
    activation, layout = _SIZING[generation](hidden_size, first, second)
    capacities = layer_capacities(max_num_tokens, top_k, num_experts, hidden_size, activation)
    check_capacities("layer", capacities, ep_size)
    return LayerCall(generation=generation, capacities=capacities, layout=layout)


def _given_keywords(
    keywords: Mapping[str, object], positional: tuple[object, ...]
) -> dict[str, object]:
    """The trailing keywords the caller passed (UNSET ones dropped).

    Raises:
        InvalidArgument: a keyword no generation has, or more than two
            trailing positional arguments.
    """
    given = {name: value for name, value in keywords.items() if value is not UNSET}
    unknown = sorted(set(given) - {k for pair in KEYWORDS.values() for k in pair})
    if unknown:
        raise InvalidArgument.of(unknown[0], given[unknown[0]], "is not an initialize() argument")
    if len(positional) > 2:
        raise InvalidArgument.of(
            "positional arguments",
            len(positional) + 4,
            "initialize() takes at most 6 (max_num_tokens, top_k, num_experts, hidden_size and "
            "one generation's two payload arguments)",
        )
    return given


def _generation_of(
    hidden_size: int, positional: tuple[object, ...], given: Mapping[str, object]
) -> Generation:
    """The generation whose keywords were used, else the one the 5th
    positional argument belongs to, else vLLM 0.33 (bf16 rows).

    Raises:
        InvalidArgument: keywords of two generations, or a 5th argument no
            generation (or more than one) accepts.
    """
    families = [g for g, pair in KEYWORDS.items() if any(k in given for k in pair)]
    if len(families) > 1:
        named = [(k, g) for g in families for k in KEYWORDS[g] if k in given]
        second = next(k for k, g in named if g is not families[0])
        raise InvalidArgument.of(
            second,
            given[second],
            "mixes keywords of two vLLM generations in one call: "
            + ", ".join(f"{k} ({g.value})" for k, g in named)
            + "; pass one generation's pair",
        )
    if families:
        return families[0]
    if positional:
        return _positional_generation(hidden_size, positional[0])
    return Generation.V0_33


def _trailing_arguments(
    generation: Generation, positional: tuple[object, ...], given: Mapping[str, object]
) -> tuple[object, object]:
    """The generation's two trailing arguments: positional, by keyword, or defaults.

    Raises:
        InvalidArgument: an argument given twice, or vLLM 0.30's required
            first one missing.
    """
    names = KEYWORDS[generation]
    values = list(_DEFAULTS[generation])
    for index, value in enumerate(positional):
        if names[index] in given:
            raise InvalidArgument.of(
                names[index],
                given[names[index]],
                f"given twice: as argument {index + 5} ({value!r}) and by keyword",
            )
        values[index] = value
    for index, name in enumerate(names):
        if name in given:
            values[index] = given[name]
    if generation is Generation.V0_30 and values[0] is UNSET:
        raise InvalidArgument.of(
            names[0],
            None,
            f"missing: vLLM 0.30's initialize() takes {names[0]} and {names[1]} together",
        )
    return values[0], values[1]
