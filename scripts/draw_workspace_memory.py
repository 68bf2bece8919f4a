"""Draws docs/images/workspace-memory.png: all-to-all workspace memory per GPU against EP size.

DeepSeek-V3 (hidden 7168, top_k 8, 256 experts; 58 NVFP4 MoE layers, then the
bf16 MTP layer) at 8,192 tokens per rank, two ways:

* computed, for every EP size: ``moe-sidecar size``'s own answer
  (:func:`moe_sidecar.client.size.answer.plan_sizes` read through
  :func:`moe_sidecar.client.size.command.answer_as_json`, the object
  ``moe-sidecar size --json`` prints) for FlashInfer 0.7.2.post1, vLLM 0.33's
  release, with ``--dispatch nvfp4 --dispatch bf16``: so the picture and the
  command cannot disagree. vLLM 0.33 keeps the NVFP4 workspace mapped after it
  builds the bf16 one (FlashInfer's class-level cache), so it holds both (the
  answer's ``kept_superseded_bytes_per_rank``); moe-sidecar holds the union
  only (``workspace_bytes_per_rank``);
* measured, at EP 2 on 2 x H200: the device memory each side held after the
  growth (``cudaMemGetInfo``; FlashInfer allocates in 2 MiB steps), read from
  ``bench/results/gpu/vllm-memory.json`` (``python bench/vllm_gpu_bench.py``).

Run from the repository root with the dev extra installed::

    python scripts/draw_workspace_memory.py            # writes the PNG
    python scripts/draw_workspace_memory.py --print    # the numbers, no picture
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from moe_sidecar.client.size.answer import plan_sizes
from moe_sidecar.client.size.command import answer_as_json

ROOT = Path(__file__).resolve().parent.parent
MEASURED = ROOT / "bench" / "results" / "gpu" / "vllm-memory.json"
PICTURE = ROOT / "docs" / "images" / "workspace-memory.png"

HIDDEN = 7168
TOP_K = 8
NUM_EXPERTS = 256
TOKENS = 8192
EP_SIZES = (2, 4, 8, 16, 32, 64)
MiB = 2**20
RELEASE = "0.7.2.post1"
"""vLLM 0.33's FlashInfer, the release the GPU run measured."""
LAYER_KINDS = ("nvfp4", "bf16")
"""The NVFP4 MoE layers first, then the bf16 MTP layer: the order vLLM builds them."""


@dataclass(frozen=True)
class Computed:
    """Workspace bytes per GPU at one EP size, as ``moe-sidecar size --json`` answers."""

    ep: int
    nvfp4: int
    """The first MoE layer's workspace (NVFP4 rows): the answer's first ``layers`` entry."""
    union: int
    """The workspace that serves every layer: ``workspace_bytes_per_rank``."""
    vllm: int
    """vLLM 0.33 keeps the superseded NVFP4 workspace beside the union:
    ``kept_superseded_bytes_per_rank``."""


def computed(ep: int, tokens: int = TOKENS) -> Computed:
    """DeepSeek-V3's two layer kinds at ``ep`` ranks, in ``moe-sidecar size``'s answer."""
    answer = answer_as_json(
        plan_sizes(RELEASE, ep, tokens, HIDDEN, TOP_K, NUM_EXPERTS, LAYER_KINDS)
    )
    first = answer["layers"][0]  # the answer keeps --dispatch order: NVFP4 first
    return Computed(
        ep,
        nvfp4=first["workspace_bytes_per_rank"],
        union=answer["workspace_bytes_per_rank"],
        vllm=answer["kept_superseded_bytes_per_rank"],
    )


@dataclass(frozen=True)
class Measured:
    """Device memory held after the growth, measured at EP 2."""

    tokens: int
    machine: str
    vllm: int
    moe_sidecar: int
    expected: tuple[int, int]
    """The NVFP4 and bf16 workspace sizes the run checked against FlashInfer's."""


def measured(path: Path = MEASURED) -> list[Measured]:
    """The runs of ``bench/vllm_gpu_bench.py`` recorded in ``path``."""
    document = json.loads(path.read_text())
    found = []
    for run in document["runs"]:
        held = {side: runs[0]["steps"][-1]["held"] for side, runs in run["runs"].items()}
        found.append(
            Measured(
                run["tokens"],
                document["machine"],
                held["vllm-0.33"],
                held["moe-sidecar"],
                (run["expected"][0], run["expected"][1]),
            )
        )
    return found


def draw(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only
    import matplotlib.pyplot as plt

    rows = [computed(ep) for ep in EP_SIZES]
    [at_ep2] = [m for m in measured() if m.tokens == TOKENS]
    figure, axes = plt.subplots(figsize=(8, 4.8), dpi=110)
    axes.plot(
        [r.ep for r in rows],
        [r.vllm / MiB for r in rows],
        "o-",
        color="#c0392b",
        label="vLLM 0.33: both workspaces mapped (computed)",
    )
    axes.plot(
        [r.ep for r in rows],
        [r.union / MiB for r in rows],
        "o-",
        color="#2471a3",
        label="moe-sidecar: the union only (computed)",
    )
    axes.plot(
        [2],
        [at_ep2.vllm / MiB],
        "D",
        markersize=10,
        markerfacecolor="none",
        color="#c0392b",
        label=f"vLLM 0.33, measured on 2 x H200: {at_ep2.vllm / MiB:.0f} MiB",
    )
    axes.plot(
        [2],
        [at_ep2.moe_sidecar / MiB],
        "D",
        markersize=10,
        markerfacecolor="none",
        color="#2471a3",
        label=f"moe-sidecar, measured on 2 x H200: {at_ep2.moe_sidecar / MiB:.0f} MiB",
    )
    axes.set_xscale("log", base=2)
    axes.set_xticks(list(EP_SIZES), [str(ep) for ep in EP_SIZES])
    axes.set_yscale("log")  # a doubling per step: the EP 2 measurements stay readable
    axes.set_xlabel("EP size (GPUs in the expert-parallel group)")
    axes.set_ylabel("all-to-all workspace per GPU (MiB, log scale)")
    axes.set_title(
        "DeepSeek-V3 (58 NVFP4 MoE layers + bf16 MTP layer), 8,192 tokens per rank", fontsize=10
    )
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8, loc="upper left")
    figure.text(
        0.01,
        0.01,
        "computed: moe-sidecar size --flashinfer 0.7.2.post1 --dispatch nvfp4 --dispatch bf16; "
        "measured: cudaMemGetInfo, bench/vllm_gpu_bench.py",
        fontsize=7,
        color="#555555",
    )
    figure.tight_layout(rect=(0, 0.03, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, metadata={"Software": None})
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PICTURE, help=f"default {PICTURE}")
    parser.add_argument("--print", action="store_true", help="print the numbers, draw nothing")
    args = parser.parse_args()
    for row in (computed(ep) for ep in EP_SIZES):
        print(
            f"EP {row.ep:>2} (computed): vLLM 0.33 {row.vllm / MiB:8.1f} MiB, "
            f"moe-sidecar {row.union / MiB:8.1f} MiB, kept for nothing {row.nvfp4 / MiB:8.1f} MiB"
        )
    for run in measured():
        print(
            f"EP  2 (measured, {run.machine}, {run.tokens} tokens per rank): vLLM 0.33 "
            f"{run.vllm / MiB:.1f} MiB, moe-sidecar {run.moe_sidecar / MiB:.1f} MiB"
        )
    if not args.print:
        draw(args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
