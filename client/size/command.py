"""The ``moe-sidecar size`` subcommand (entry point group ``moe_sidecar.commands``).

Its flags, and a run that loads the answer (:mod:`.answer`) only when it
starts. Pure like the answer: it runs where neither torch nor FlashInfer is
installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from moe_sidecar.client.size.releases import DISPATCH_KINDS, RELEASES

if TYPE_CHECKING:
    from moe_sidecar.client.engines.sglang.sizing import NamespaceSize
    from moe_sidecar.client.size.answer import SizeAnswer

__all__ = [
    "DISPATCH_KINDS",
    "RELEASES",
    "add_command",
    "answer_as_json",
    "default_release",
    "dispatch_kind",
    "engine_as_json",
    "flag_out_of_range",
    "format_answer",
    "format_engine",
    "run",
]


def default_release() -> str:
    """The installed FlashInfer's release when the client supports it, else the newest."""
    try:
        installed = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return RELEASES[-1]
    return installed if installed in RELEASES else RELEASES[-1]


def dispatch_kind(text: str) -> str:
    """A ``--dispatch`` value as ``size`` names it: a kind of :data:`DISPATCH_KINDS`
    or the FlashInfer ``QuantFormat`` name it stands for (``NVFP4``,
    ``FP8PerTensor``, ``QuantFormat.NVFP4``), in any case, as the library takes
    them; anything else as given (an integer, or an error the answer names).
    """
    folded = text.strip().lower().removeprefix("quantformat.")
    for kind, quant_format in DISPATCH_KINDS.items():
        if folded in (kind, quant_format.lower()):
            return kind
    return text


def add_command(subparsers: Any) -> None:
    """Adds ``size`` to ``moe-sidecar``'s subcommands."""
    parser = subparsers.add_parser(
        "size",
        help="per-rank all-to-all workspace of a model at an EP size (no GPU, no FlashInfer)",
        description=(
            "Capacity planning: the FlashInfer MoE all-to-all workspace one rank maps for a "
            "model whose MoE layers dispatch the given kinds, at an EP size, for a FlashInfer "
            "release, computed in pure Python as that release computes it. The answer is the "
            "union of the layer kinds (what the client builds). Exit status: 0 answered, 2 a bad "
            "flag, or a configuration the release, the sidecar or the client refuses (the sizes "
            "are still printed, each refusal named)."
        ),
    )
    parser.add_argument(
        "--flashinfer",
        choices=RELEASES,
        default=None,
        help=f"FlashInfer release (default: the installed one when supported, else {RELEASES[-1]})",
    )
    parser.add_argument("--ep", type=int, required=True, help="ranks in the EP group")
    parser.add_argument(
        "--tokens", type=int, required=True, help="most tokens one rank dispatches per step"
    )
    parser.add_argument("--hidden", type=int, required=True, help="hidden size")
    parser.add_argument("--top-k", type=int, required=True, help="experts per token")
    parser.add_argument("--experts", type=int, required=True, help="experts of the model")
    parser.add_argument(
        "--dispatch",
        action="append",
        required=True,
        type=dispatch_kind,
        metavar="KIND",
        help=f"a layer kind of the model (repeat for each): {', '.join(DISPATCH_KINDS)} or "
        f"FlashInfer's QuantFormat name ({', '.join(DISPATCH_KINDS.values())}; any case), or an "
        "integer: the activation plus scale bytes one token sends, routing excluded",
    )
    parser.add_argument(
        "--eplb-experts", type=int, default=0, help="experts whose EPLB statistics are gathered"
    )
    parser.add_argument(
        "--extra-bytes", type=int, default=0, help="extra dispatch bytes per token of every layer"
    )
    parser.add_argument("--json", action="store_true", help="the answer as a JSON object")
    parser.add_argument(
        "--engine",
        choices=("sglang",),
        default=None,
        help="also print what this engine maps by itself for the same model, per workspace "
        "namespace (sglang: SGLang 0.5.23's FlashInfer dispatcher)",
    )
    parser.add_argument(
        "--draft-dispatch",
        action="append",
        default=[],
        metavar="KIND",
        help="with --engine sglang: a layer kind of the speculative draft (MTP/NEXTN) model, "
        "which gets its own workspace (repeat for each)",
    )
    parser.set_defaults(run=run)


def answer_as_json(answer: SizeAnswer) -> dict[str, Any]:
    """The ``--json`` object (``ok`` false: someone refuses it, see ``refusals``)."""
    return {
        "ok": not answer.refusals,
        "flashinfer": answer.flashinfer,
        "ep_size": answer.ep_size,
        "workspace_bytes_per_rank": answer.workspace_bytes_per_rank,
        "gpu_total_bytes": answer.gpu_total_bytes,
        "kept_superseded_bytes_per_rank": answer.kept_superseded_bytes_per_rank,
        "capacities": asdict(answer.capacities),
        "layers": [asdict(layer) for layer in answer.layers],
        "described_as": None if answer.described_as is None else asdict(answer.described_as),
        "refusals": list(answer.refusals),
    }


def _mib(value: int) -> str:
    return f"{value:,} B ({value / (1 << 20):,.1f} MiB)"


def format_answer(answer: SizeAnswer) -> str:
    """The answer for a terminal."""
    c = answer.capacities
    lines = [
        f"FlashInfer {answer.flashinfer}, EP {answer.ep_size}: {c.max_tokens} tokens/rank, "
        f"top_k {c.top_k}, {c.num_experts} experts, eplb {c.eplb_experts}",
        f"  workspace per rank:     {_mib(answer.workspace_bytes_per_rank)}  (FlashInfer's "
        "size, before its allocator rounds it)",
        f"  GPUs of the group:      {_mib(answer.gpu_total_bytes)}  (one workspace on each; "
        "every rank maps all of them)",
        f"  never freeing growth:   {_mib(answer.kept_superseded_bytes_per_rank)} per rank "
        "(a manager that keeps superseded workspaces, growing in --dispatch order)",
        f"  union: dispatch {c.dispatch_bytes_per_token} B/token, combine "
        f"{c.combine_bytes_per_token} B/token",
    ]
    if answer.described_as is not None:
        d = answer.described_as
        lines.append(
            f"  built as: hidden_size={d.hidden_size}, dispatch_format={d.dispatch_format}, "
            f"extra_payload_bytes_per_token={d.extra_payload_bytes_per_token}"
        )
    for layer in answer.layers:
        lines.append(
            f"  layer {layer.dispatch:>12}: dispatch {layer.dispatch_bytes_per_token} B/token, "
            f"alone {_mib(layer.workspace_bytes_per_rank)}"
        )
    for refusal in answer.refusals:
        lines.append(f"  refused by {refusal}")
    return "\n".join(lines)


_INT32_MAX = (1 << 31) - 1
"""The largest value of every integer flag: FlashInfer takes each as an int32."""


def flag_out_of_range(args: argparse.Namespace) -> str:
    """The first integer flag (or integer ``--dispatch``) beyond an int32, as
    one line naming it; "" when every one is in range. Larger values would
    overflow the sizing arithmetic's own checks before a release could refuse
    them by name."""
    flags: list[tuple[str, int]] = [
        ("--ep", args.ep),
        ("--tokens", args.tokens),
        ("--hidden", args.hidden),
        ("--top-k", args.top_k),
        ("--experts", args.experts),
        ("--eplb-experts", args.eplb_experts),
        ("--extra-bytes", args.extra_bytes),
    ]
    flags += [("--dispatch", int(kind)) for kind in args.dispatch if kind.strip().isdigit()]
    for flag, value in flags:
        if abs(value) > _INT32_MAX:
            return (
                f"{flag}={value}: must be at most {_INT32_MAX} in magnitude (FlashInfer takes "
                "it as an int32)"
            )
    return ""


def run(args: argparse.Namespace) -> int:
    """Runs ``moe-sidecar size``; returns the exit status."""
    from moe_sidecar.client.size.answer import SizeError, plan_sizes

    release = args.flashinfer or default_release()
    beyond = flag_out_of_range(args)
    if beyond:
        print(f"moe-sidecar size: {beyond}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": False, "error": beyond}))
        return 2
    try:
        answer = plan_sizes(
            release,
            args.ep,
            args.tokens,
            args.hidden,
            args.top_k,
            args.experts,
            tuple(args.dispatch),
            eplb_experts=args.eplb_experts,
            extra_bytes=args.extra_bytes,
        )
    except SizeError as error:
        print(f"moe-sidecar size: {error}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": False, "error": str(error)}))
        return 2
    engine: list[NamespaceSize] = []
    if args.engine == "sglang":
        from moe_sidecar.client.engines.sglang.size import EngineSizeError, sglang_sizes

        try:
            engine = sglang_sizes(
                release,
                args.ep,
                args.tokens,
                args.hidden,
                args.top_k,
                tuple(args.dispatch),
                tuple(args.draft_dispatch),
            )
        except EngineSizeError as error:
            print(f"moe-sidecar size: {error}", file=sys.stderr)
            if args.json:
                print(json.dumps({"ok": False, "error": str(error)}))
            return 2
    if args.json:
        document = answer_as_json(answer)
        if engine:
            document |= engine_as_json(args.engine, engine)
        print(json.dumps(document, indent=2))
    else:
        print(format_answer(answer))
        if engine:
            print(format_engine(args.engine, engine))
    # Sized but refused: a capacity script must not take the numbers as a
    # configuration that runs.
    for refusal in answer.refusals:
        print(f"moe-sidecar size: refused by {refusal}", file=sys.stderr)
    return 2 if answer.refusals else 0


def engine_as_json(engine: str, sizes: list[NamespaceSize]) -> dict[str, Any]:
    """The ``--engine`` part of the ``--json`` object: per rank, over its namespaces."""
    return {
        "engine": engine,
        "engine_bytes_per_rank": sum(size.engine_bytes_per_rank for size in sizes),
        "exact_bytes_per_rank": sum(size.exact_bytes_per_rank for size in sizes),
        "engine_namespaces": [
            {
                "namespace": size.namespace.name.lower(),
                "engine_bytes_per_rank": size.engine_bytes_per_rank,
                "exact_bytes_per_rank": size.exact_bytes_per_rank,
            }
            for size in sizes
        ],
    }


def format_engine(engine: str, sizes: list[NamespaceSize]) -> str:
    """The ``--engine`` section for a terminal."""
    lines = [f"  {engine}, one workspace per namespace (per rank):"]
    for size in sizes:
        lines.append(
            f"    {size.namespace.name.lower():>11}: {engine} alone "
            f"{_mib(size.engine_bytes_per_rank)}, exact {_mib(size.exact_bytes_per_rank)}"
        )
    saved = sum(size.saved_bytes_per_rank for size in sizes)
    lines.append(f"    saved: {_mib(saved)} per rank")
    return "\n".join(lines)
