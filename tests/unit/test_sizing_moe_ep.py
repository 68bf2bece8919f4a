"""FlashInfer 0.7.4's one-sided workspace layout, checked against FlashInfer's own code.

``tests/data/flashinfer-0.7.4-layouts.csv`` holds 6,000 configurations laid
out by FlashInfer 0.7.4's ``calculateWorkspaceLayout`` (its host C++,
compiled on a CPU machine by scripts/flashinfer_layouts.py; the file's
header says how). bench/gpu_runs/fi074_layouts.py checks the same rows
against the real op on an H200.
"""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import pytest

from moe_sidecar.core.plan import Capacities, join_capacities
from moe_sidecar.flashinfer import v0_7_4 as s

pytestmark = pytest.mark.timeout(60)

TABLE = Path(__file__).parents[1] / "data" / "flashinfer-0.7.4-layouts.csv"


def _rows() -> list[dict[str, str]]:
    with TABLE.open() as handle:
        return list(csv.DictReader(line for line in handle if not line.startswith("#")))


def test_the_table_covers_what_it_must() -> None:
    rows = _rows()
    assert len(rows) >= 5000
    ints = [{k: int(v) for k, v in r.items() if k != "format"} for r in rows]
    assert {r["format"] for r in rows} >= {"BF16", "FP8PerTensor", "MXFP8", "NVFP4", "DeepSeekFp8"}
    assert min(r["ep"] for r in ints) == 2 and max(r["ep"] for r in ints) == 256
    assert min(r["tokens"] for r in ints) == 1 and max(r["tokens"] for r in ints) == 16384
    assert {r["top_k"] for r in ints} == set(range(1, 23))
    assert min(r["hidden"] for r in ints) == 2048 and max(r["hidden"] for r in ints) == 7168
    assert any(r["extra"] for r in ints) and any(r["eplb"] for r in ints)


def test_every_row_byte_for_byte() -> None:
    mismatches = []
    for row in _rows():
        fmt = row.pop("format")
        r = {k: int(v) for k, v in row.items()}
        inputs = s.op_inputs(r["ep"], r["tokens"], r["top_k"], r["hidden"], fmt, r["extra"])
        layout = dataclasses.asdict(
            s.layer_layout(
                r["ep"], r["tokens"], r["top_k"], r["hidden"], fmt, r["extra"], r["eplb"]
            )
        )
        want = {k: r[k] for k in layout if k in r}
        got = {k: layout[k] for k in want}
        if inputs != (r["dispatch_bytes"], r["combine_bytes"]) or got != want:
            mismatches.append((row, inputs, got))
    assert not mismatches, mismatches[:3]


def test_deepseek_v3_by_hand() -> None:
    # EP 2, 128 tokens, top_k 8, hidden 7168, bf16 rows.
    layout = s.layer_layout(2, 128, 8, 7168, "BF16")
    assert layout.recv_counters == 16 and layout.dispatch_completion_flags == 128
    assert layout.topk_target_ranks == 256
    assert layout.topk_target_indices == 256 + 128 * 8 * 4
    assert layout.eplb_gathered_stats == layout.dispatch_payload == 256 + 2 * 128 * 8 * 4
    dispatch = 2 * 128 * (14336 + 64) + 4 * 256
    assert layout.dispatch_payload_size == dispatch
    assert layout.combine_completion_flags == layout.dispatch_payload + dispatch
    assert layout.combine_input == s._align(layout.combine_completion_flags + 8, 256)
    assert layout.workspace_size == layout.combine_input + 2 * 128 * 7168 * 2


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((257, 1, 8, 0, 0), "ep_size=257"),
        ((0, 1, 8, 0, 0), "ep_size=0"),
        ((2, 0, 8, 0, 0), "max_num_tokens=0"),
        ((2, 2**31, 8, 0, 0), "max_num_tokens=2147483648"),
        ((2, 1, 23, 0, 0), "top_k=23"),
        ((2, 1, 0, 0, 0), "top_k=0"),
        ((2, 1, 8, -1, 0), "dispatch_bytes=-1"),
        ((2, 1, 8, 0, -1), "combine_input_bytes=-1"),
    ],
)
def test_refusals_name_the_argument(args: tuple[int, ...], needle: str) -> None:
    with pytest.raises(s.LayoutError, match=needle.replace("(", r"\(")):
        s.workspace_layout(*args)


def _capacities(activation: int, hidden: int, top_k: int = 8, tokens: int = 128) -> Capacities:
    return Capacities(
        max_tokens=tokens,
        dispatch_bytes_per_token=activation + 8 * top_k,
        combine_bytes_per_token=2 * hidden,
        top_k=top_k,
        num_experts=256,
    )


def test_a_single_layer_is_described_as_itself() -> None:
    for fmt in ("BF16", "DeepSeekFp8", "FP8PerTensor", "NVFP4", "MXFP4"):
        activation = s._format_bytes(fmt, 7168)
        d = s.describe(_capacities(activation, 7168))
        assert d.dispatch_bytes_per_token == activation + 64
        assert s.capacities_workspace_bytes(_capacities(activation, 7168), 8) == (
            s.layer_layout(8, 128, 8, 7168, fmt).workspace_size
        )


def test_union_of_nvfp4_and_bf16_mtp_is_the_bf16_layout() -> None:
    nvfp4 = _capacities(s._format_bytes("NVFP4", 7168), 7168)
    bf16 = _capacities(2 * 7168, 7168)
    union = join_capacities(nvfp4, bf16)
    d = s.describe(union)
    assert (d.hidden_size, d.dispatch_format, d.extra_payload_bytes_per_token) == (7168, "BF16", 0)
    assert (
        s.capacities_workspace_bytes(union, 2)
        == s.layer_layout(2, 128, 8, 7168, "BF16").workspace_size
    )
    # The NVFP4 layout alone is smaller: its fixed regions cannot hold the bf16 layer.
    alone = s.layer_layout(2, 128, 8, 7168, "NVFP4")
    assert alone.dispatch_payload_size < 2 * 128 * (2 * 7168 + 64)
    assert alone.combine_input_size == 2 * 128 * 7168 * 2


def test_union_across_hidden_sizes_never_smaller_than_either_layer() -> None:
    # bf16 rows at hidden 4096 (8192 B) under a hidden-6144 combine: DeepSeekFp8
    # of 6144 (6336 B) is the largest format that fits, the rest is extra bytes.
    union = join_capacities(_capacities(8192, 4096), _capacities(6144 + 6144 // 32, 6144))
    d = s.describe(union)
    assert (d.hidden_size, d.dispatch_format) == (6144, "DeepSeekFp8")
    assert d.dispatch_bytes_per_token == union.dispatch_bytes_per_token
    layout = s.layer_layout(
        2, 128, 8, d.hidden_size, d.dispatch_format, d.extra_payload_bytes_per_token
    )
    for need in (8192 + 64, 6144 + 192 + 64):
        assert layout.dispatch_payload_size >= 2 * 128 * need + 4 * 256
    assert layout.combine_input_size >= 2 * 128 * 6144 * 2


def test_a_row_below_every_format_is_built_larger_never_smaller() -> None:
    tiny = _capacities(100, 7168)
    d = s.describe(tiny)
    assert d.dispatch_format == "MXFP4" and d.extra_payload_bytes_per_token == 0
    assert d.dispatch_bytes_per_token > tiny.dispatch_bytes_per_token


def test_object_refusals() -> None:
    assert s.object_refusals(8, 8, 256, 0) == ()
    assert "top_k=5" in s.object_refusals(8, 5, 256, 0)[0]
    assert "divisible" in s.object_refusals(6, 8, 256, 0)[0]
    assert "eplb_stats_num_experts=300" in s.object_refusals(8, 8, 256, 300)[0]
    assert len(s.object_refusals(6, 5, 256, 300)) == 3
