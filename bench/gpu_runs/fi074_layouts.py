"""Checks tests/data/flashinfer-0.7.4-layouts.csv against FlashInfer 0.7.4 itself, on a GPU machine.

Two checks per row, both against the pure sizing too
(:mod:`moe_sidecar.flashinfer.v0_7_4`):

* the op: FlashInfer's JIT op ``moe_a2a_get_workspace_layout`` (the
  ``nvlink_one_sided_alltoall`` module, compiled here on first use) given
  the row's ``dispatch_bytes`` and ``combine_bytes``, fence path (no CFT):
  every field of the table, the CFT-only fields 0, the first regions at 0,
  4 and 8;
* the constructor: FlashInfer's own ``NVLinkOneSidedAlltoAll.__init__`` for
  the row's params and config (``cft=False, lamport=False``), which computes
  the op's inputs in Python and calls the op; it is stopped where it would
  allocate (``_acquire_workspace``) and its metainfo compared. Rows whose
  top_k the class does not take (5, 7, 9, ...) get the op check only.
  One process stands in for all ``ep`` ranks: its communicator answers every
  collective with this process's own value, and the platform vote (which
  refuses a GPU without NVLink peers) is stood in for; nothing is allocated.

    python3 bench/gpu_runs/fi074_layouts.py [--table PATH] [--json OUT.json]

Exit status 0 when every row matched.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

ONE_SIDED = "flashinfer.moe_ep.backends.split.comm.nvlink_one_sided"
FIELDS = {
    "recv_counters": "RECV_COUNTERS_OFFSET_INDEX",
    "dispatch_completion_flags": "DISPATCH_COMPLETION_FLAGS_OFFSET_INDEX",
    "topk_target_ranks": "TOPK_TARGET_RANKS_OFFSET_INDEX",
    "topk_target_indices": "TOPK_TARGET_INDICES_OFFSET_INDEX",
    "eplb_gathered_stats": "EPLB_GATHERED_STATS_OFFSET_INDEX",
    "dispatch_payload": "DISPATCH_PAYLOAD_OFFSET_INDEX",
    "dispatch_payload_size": "DISPATCH_PAYLOAD_SIZE_INDEX",
    "combine_completion_flags": "COMBINE_COMPLETION_FLAGS_OFFSET_INDEX",
    "combine_input": "COMBINE_INPUT_OFFSET_INDEX",
    "combine_input_size": "COMBINE_INPUT_SIZE_INDEX",
    "workspace_size": "WORKSPACE_SIZE_INDEX",
}
FIXED = {
    "FLAG_VAL_OFFSET_INDEX": 0,
    "LOCAL_TOKEN_COUNTER_OFFSET_INDEX": 4,
    "SEND_COUNTERS_OFFSET_INDEX": 8,
    "DISPATCH_COUNTED_WRITE_COUNTERS_OFFSET_INDEX": 0,
    "DISPATCH_COUNTER_BASELINE_OFFSET_INDEX": 0,
    "COMBINE_COUNTED_WRITE_COUNTERS_OFFSET_INDEX": 0,
    "COMBINE_COUNTER_BASELINE_OFFSET_INDEX": 0,
    "COMBINE_RECV_OFFSET_INDEX": 0,
    "COMBINE_RECV_SIZE_INDEX": 0,
    "CFT_ENABLED_INDEX": 0,
    "LAMPORT_MAX_NUM_TOKENS_INDEX": 0,
}


class _Stopped(Exception):
    """Raised where the constructor would allocate; carries its metainfo."""

    def __init__(self, metainfo: list[int]) -> None:
        super().__init__("stopped before the allocation")
        self.metainfo = metainfo


class _OneProcessForAllRanks:
    """A communicator of ``size`` ranks in one process: every collective
    answers with this process's value for every rank (nothing is shared)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return self.size

    def allgather(self, data: Any) -> list[Any]:
        return [data] * self.size

    def bcast(self, data: Any, root: int) -> Any:
        return data

    def barrier(self) -> None:
        return None

    def Split(self, color: int, key: int) -> _OneProcessForAllRanks:
        return self


def _rows(table: Path) -> list[dict[str, Any]]:
    with table.open() as handle:
        rows = list(csv.DictReader(line for line in handle if not line.startswith("#")))
    return [{k: (v if k == "format" else int(v)) for k, v in r.items()} for r in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--table", type=Path, default=Path("tests/data/flashinfer-0.7.4-layouts.csv")
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    import importlib

    import flashinfer
    import torch

    from moe_sidecar.flashinfer import v0_7_4

    started = time.perf_counter()
    kernels = importlib.import_module(f"{ONE_SIDED}.kernels")
    communication = importlib.import_module(f"{ONE_SIDED}.communication")
    common = importlib.import_module("flashinfer.moe_ep.backends.split.comm.nvlink_common")
    moe_ep = importlib.import_module("flashinfer.moe_ep")
    quant_format = importlib.import_module("flashinfer.fused_moe").QuantFormat
    module = kernels.get_nvlink_one_sided_alltoall_module()
    index = kernels.layout_constants()
    load_seconds = time.perf_counter() - started
    print(
        f"flashinfer {flashinfer.__version__}, torch {torch.__version__}, "
        f"{torch.cuda.get_device_name()}; module ready in {load_seconds:.1f} s",
        flush=True,
    )
    assert (index.MAX_RANKS, index.MAX_TOP_K, index.MAX_PAYLOADS, index.WORKSPACE_ALIGNMENT) == (
        v0_7_4.MAX_RANKS,
        v0_7_4.MAX_TOP_K,
        v0_7_4.MAX_PAYLOADS,
        v0_7_4.WORKSPACE_ALIGNMENT,
    ), vars(index)

    # The stand-in for the platform vote: only here, where nothing is allocated.
    for stood_in in (communication, common):
        setattr(stood_in, "nvlink_platform_supported", lambda: True)  # noqa: B010

    class Stopping(communication.NVLinkOneSidedAlltoAll):  # type: ignore[misc, name-defined]
        def _acquire_workspace(self, mapping: Any, comm: Any, metainfo: Any, cft: bool) -> Any:
            raise _Stopped([int(v) for v in metainfo.tolist()])

    rows = _rows(args.table)
    op_mismatches: list[str] = []
    ctor_mismatches: list[str] = []
    ctor_checked = 0
    for number, r in enumerate(rows):
        expected = {k: r[k] for k in FIELDS}
        pure = v0_7_4.layer_layout(
            r["ep"], r["tokens"], r["top_k"], r["hidden"], r["format"], r["extra"], r["eplb"]
        )
        metainfo = torch.zeros(index.NUM_METAINFO_FIELDS, dtype=torch.int64)
        module.moe_a2a_get_workspace_layout(
            r["ep"],
            r["tokens"],
            r["top_k"],
            r["dispatch_bytes"],
            r["combine_bytes"],
            0,
            r["eplb"],
            False,
            metainfo,
        )
        values = [int(v) for v in metainfo.tolist()]
        got = {k: values[getattr(index, name)] for k, name in FIELDS.items()}
        fixed = {name: values[getattr(index, name)] for name in FIXED}
        ours = {k: getattr(pure, k) for k in FIELDS}
        if got != expected or fixed != FIXED or ours != expected:
            op_mismatches.append(f"row {number} {r}: op {got} {fixed}, pure {ours}")

        if r["top_k"] not in v0_7_4.SUPPORTED_TOP_K:
            continue
        ctor_checked += 1
        per_rank = max(1, math.ceil(max(r["top_k"], r["eplb"]) / r["ep"]))
        params = moe_ep.MoEEpCommParams(
            num_experts=r["ep"] * per_rank,
            top_k=r["top_k"],
            max_tokens_per_rank=r["tokens"],
            hidden_size=r["hidden"],
            dtype=torch.bfloat16,
            dispatch_format=quant_format[r["format"]],
        )
        config = moe_ep.NVLinkOneSidedConfig(
            extra_payload_bytes_per_token=r["extra"],
            eplb_stats_num_experts=r["eplb"],
            comm_backend=_OneProcessForAllRanks(r["ep"]),
            cft=False,
            lamport=False,
        )
        bootstrap = moe_ep.BootstrapConfig(
            world_size=r["ep"], rank=0, device=torch.cuda.current_device()
        )
        try:
            Stopping(bootstrap, params, config)
        except _Stopped as stopped:
            built = {k: stopped.metainfo[getattr(index, name)] for k, name in FIELDS.items()}
            if built != expected:
                ctor_mismatches.append(f"row {number} {r}: constructor {built}")
        else:
            ctor_mismatches.append(f"row {number}: the constructor did not reach the allocation")
        if number % 1000 == 0:
            print(f"  {number} rows checked", flush=True)

    summary = {
        "flashinfer": flashinfer.__version__,
        "device": torch.cuda.get_device_name(),
        "rows": len(rows),
        "op_matched": len(rows) - len(op_mismatches),
        "constructor_checked": ctor_checked,
        "constructor_matched": ctor_checked - len(ctor_mismatches),
        "module_ready_seconds": round(load_seconds, 1),
        "seconds": round(time.perf_counter() - started, 1),
    }
    for line in (op_mismatches + ctor_mismatches)[:20]:
        print("MISMATCH", line)
    print(json.dumps(summary))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if not op_mismatches and not ctor_mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
