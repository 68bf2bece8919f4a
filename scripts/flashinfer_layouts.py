"""Writes tests/data/flashinfer-0.7.4-layouts.csv from FlashInfer 0.7.4's own layout code.

FlashInfer 0.7.4 lays out the one-sided all-to-all's workspace in C++
(``calculateWorkspaceLayout`` in ``data/csrc/nvlink_one_sided_alltoall.cu``,
behind the JIT op ``moe_a2a_get_workspace_layout``). That function is host
code only, so this script compiles it on a CPU machine with g++: it copies
the function, its ``alignOffset`` helper, the ``kCachelineAlignment``
constant and the namespace aliases out of the wheel's ``.cu`` file as they
are (each found exactly once, else it stops), puts them after an
``#include`` of the wheel's own ``moeAlltoAllMeta.h`` (which includes the
kernel header with ``kMaxRanks``, ``kMaxTopK``, ``kCftCounterStride``), and
defines FlashInfer's ``TVM_FFI_ICHECK`` as "throw with the message". A tiny
driver feeds it one configuration per line and prints the metainfo.

The op's two byte-count inputs are what ``NVLinkOneSidedAlltoAll.__init__``
(``moe_ep/backends/split/comm/nvlink_one_sided/communication.py``) passes
on the fence path (CFT and Lamport off, as on SM90): ``ep_size *
max_tokens_per_rank * (params.dispatch_bytes_per_token + 8 * top_k +
extra_payload_bytes_per_token) + MAX_PAYLOADS * WORKSPACE_ALIGNMENT`` and
``ep_size * max_tokens_per_rank * hidden_size * 2``. This script writes that
Python arithmetic out below (it is not compiled code); the GPU check
(``bench/gpu_runs/fi074_layouts.py``) runs the real op on the same rows and
the real constructor's arithmetic too.

Usage (the wheel unzipped anywhere; CUDA headers for cuda_bf16.h)::

    pip download --no-deps flashinfer-python==0.7.4 -d /tmp/fi074
    python -m zipfile -e /tmp/fi074/flashinfer_python-0.7.4-py3-none-any.whl /tmp/fi074/src
    python scripts/flashinfer_layouts.py --flashinfer /tmp/fi074/src/flashinfer \\
        --cuda-include /usr/local/cuda/include --out tests/data/flashinfer-0.7.4-layouts.csv
"""

from __future__ import annotations

import argparse
import csv
import random
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

FLASHINFER_VERSION = "0.7.4"

# The metainfo fields of the fence layout the table keeps. The first three
# regions never move (flag at 0, token counter at 4, send counters at 8) and
# the CFT-only fields are 0 on that path: the driver checks both instead.
FIELDS = (
    ("RECV_COUNTERS_OFFSET_INDEX", "recv_counters"),
    ("DISPATCH_COMPLETION_FLAGS_OFFSET_INDEX", "dispatch_completion_flags"),
    ("TOPK_TARGET_RANKS_OFFSET_INDEX", "topk_target_ranks"),
    ("TOPK_TARGET_INDICES_OFFSET_INDEX", "topk_target_indices"),
    ("EPLB_GATHERED_STATS_OFFSET_INDEX", "eplb_gathered_stats"),
    ("DISPATCH_PAYLOAD_OFFSET_INDEX", "dispatch_payload"),
    ("DISPATCH_PAYLOAD_SIZE_INDEX", "dispatch_payload_size"),
    ("COMBINE_COMPLETION_FLAGS_OFFSET_INDEX", "combine_completion_flags"),
    ("COMBINE_INPUT_OFFSET_INDEX", "combine_input"),
    ("COMBINE_INPUT_SIZE_INDEX", "combine_input_size"),
    ("WORKSPACE_SIZE_INDEX", "workspace_size"),
)
ZERO_FIELDS = (
    "DISPATCH_COUNTED_WRITE_COUNTERS_OFFSET_INDEX",
    "DISPATCH_COUNTER_BASELINE_OFFSET_INDEX",
    "COMBINE_COUNTED_WRITE_COUNTERS_OFFSET_INDEX",
    "COMBINE_COUNTER_BASELINE_OFFSET_INDEX",
    "COMBINE_RECV_OFFSET_INDEX",
    "COMBINE_RECV_SIZE_INDEX",
    "CFT_ENABLED_INDEX",
)

INPUT_COLUMNS = ("ep", "tokens", "top_k", "hidden", "format", "extra", "eplb")
COLUMNS = (*INPUT_COLUMNS, "dispatch_bytes", "combine_bytes", *(name for _, name in FIELDS))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# FlashInfer 0.7.4's _DISPATCH_BYTES_PER_TOKEN (moe_ep/core/comm/communication.py),
# written out: the generator must not import the project's own table.
FORMAT_BYTES = {
    "BF16": lambda h: 2 * h,
    "FP16": lambda h: 2 * h,
    "FP8PerTensor": lambda h: h,
    "DeepSeekFp8": lambda h: h + 4 * _ceil_div(h, 128),
    "MXFP8": lambda h: h + _ceil_div(h, 32),
    "NVFP4": lambda h: _ceil_div(h, 2) + _ceil_div(h, 16),
    "MXFP4": lambda h: _ceil_div(h, 2) + _ceil_div(h, 32),
}
MAX_PAYLOADS = 4
WORKSPACE_ALIGNMENT = 256


def op_inputs(
    ep: int, tokens: int, top_k: int, hidden: int, fmt: str, extra: int
) -> tuple[int, int]:
    """``(dispatch_bytes, combine_input_bytes)`` NVLinkOneSidedAlltoAll.__init__ passes."""
    rows = ep * tokens
    dispatch = rows * (FORMAT_BYTES[fmt](hidden) + 2 * top_k * 4 + extra)
    return dispatch + MAX_PAYLOADS * WORKSPACE_ALIGNMENT, rows * hidden * 2


def _piece(source: str, pattern: str, what: str) -> str:
    found = re.findall(pattern, source, flags=re.MULTILINE | re.DOTALL)
    if len(found) != 1:
        raise SystemExit(f"{what}: found {len(found)} times in the .cu, expected once")
    return str(found[0])


def driver_source(cu: str) -> str:
    """The C++ driver: FlashInfer's pieces, copied as they are, and a main."""
    aliases = _piece(cu, r"^namespace tl = [^\n]*\nnamespace meta = [^\n]*\n", "namespace aliases")
    alignment = _piece(cu, r"^constexpr size_t kCachelineAlignment = [^\n]*\n", "alignment")
    align = _piece(cu, r"^inline size_t alignOffset\(.*?\n}\n", "alignOffset")
    layout = _piece(
        cu,
        r"^meta::MoeA2AWorkspaceLayout calculateWorkspaceLayout\(.*?\n}\n",
        "calculateWorkspaceLayout",
    )
    fields = "\n".join(f'    {{"{name}", meta::{name}}},' for name, _ in FIELDS)
    zeros = "\n".join(f"    meta::{name}," for name in ZERO_FIELDS)
    return f"""// Generated by scripts/flashinfer_layouts.py: FlashInfer {FLASHINFER_VERSION}'s
// host layout code (copied from data/csrc/nvlink_one_sided_alltoall.cu as it is)
// behind a driver that reads configurations and prints layouts.
#include <array>
#include <cstdint>
#include <iostream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "tensorrt_llm/thop/moe/communication/moeAlltoAllMeta.h"

// FlashInfer's TVM_FFI_ICHECK(cond) << message: throw the message when cond fails.
#define TVM_FFI_ICHECK(cond) \\
  for (std::ostringstream icheck_message; !(cond); throw std::runtime_error(icheck_message.str())) \\
  icheck_message

namespace {{
{aliases}
{alignment}
{align}
{layout}
}}  // namespace

int main() {{
  std::pair<char const*, int64_t> const fields[] = {{
{fields}
  }};
  int64_t const zeros[] = {{
{zeros}
  }};
  int64_t ep, tokens, topK, dispatch, combine, eplb;
  while (std::cin >> ep >> tokens >> topK >> dispatch >> combine >> eplb) {{
    try {{
      auto const layout =
          calculateWorkspaceLayout(ep, tokens, topK, dispatch, combine, 0, eplb, false);
      for (int64_t index : zeros) {{
        if (layout[index] != 0) throw std::runtime_error("a CFT field is not 0");
      }}
      if (layout[meta::FLAG_VAL_OFFSET_INDEX] != 0 ||
          layout[meta::LOCAL_TOKEN_COUNTER_OFFSET_INDEX] != 4 ||
          layout[meta::SEND_COUNTERS_OFFSET_INDEX] != 8) {{
        throw std::runtime_error("the first regions moved");
      }}
      std::cout << "ok";
      for (auto const& field : fields) std::cout << ' ' << layout[field.second];
      std::cout << '\\n';
    }} catch (std::exception const& error) {{
      std::cout << "refused " << error.what() << '\\n';
    }}
  }}
  return 0;
}}
"""


def configurations(seed: int, count: int) -> Iterator[tuple[int, int, int, int, str, int, int]]:
    """The table's rows: named corners first, then a seeded sample.

    EP 2-256, tokens 1-16384, top_k 1-22, hidden 2048-7168, every dispatch
    format, extra bytes and EPLB statistics. Yields
    ``(ep, tokens, top_k, hidden, format, extra, eplb)``.
    """
    seen: set[tuple[int, int, int, int, str, int, int]] = set()
    corners = []
    for fmt in FORMAT_BYTES:
        for ep in (2, 8, 256):
            for tokens in (1, 8192, 16384):
                for top_k in (1, 8, 22):
                    for eplb in (0, 256):
                        corners.append((ep, tokens, top_k, 7168, fmt, 0, eplb))
    # DeepSeek-V3: hidden 7168, top_k 8, 256 experts; NVFP4 base with a bf16 MTP head.
    for ep in (2, 4, 8, 16, 32, 64, 72, 128, 144, 256):
        for tokens in (128, 256, 1024, 8192):
            for fmt in ("NVFP4", "BF16", "DeepSeekFp8", "MXFP8"):
                corners.append((ep, tokens, 8, 7168, fmt, 0, 0))
    for row in corners:
        if row not in seen:
            seen.add(row)
            yield row
    rng = random.Random(seed)
    eps = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 72, 96, 128, 144, 192, 255, 256)
    hiddens = (2048, 2560, 2880, 3072, 4096, 5120, 6144, 7168)
    experts = (16, 64, 128, 160, 256, 384, 512)
    while len(seen) < count:
        fmt = rng.choice(tuple(FORMAT_BYTES))
        row = (
            rng.choice(eps) if rng.random() < 0.7 else rng.randint(2, 256),
            rng.choice((1, 2, 7, 64, 128, 256, 512, 1000, 1024, 2048, 4096, 8192, 16384))
            if rng.random() < 0.6
            else rng.randint(1, 16384),
            rng.randint(1, 22),
            rng.choice(hiddens) if rng.random() < 0.8 else rng.randint(2048, 7168),
            fmt,
            rng.choice((0, 0, 0, 4, 16, 28, 96, 224)),
            rng.choice((0, 0, 0, rng.choice(experts))),
        )
        if row not in seen:
            seen.add(row)
            yield row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--flashinfer", type=Path, required=True, help="the wheel's flashinfer/")
    parser.add_argument("--cuda-include", type=Path, default=Path("/usr/local/cuda/include"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=6000)
    parser.add_argument("--seed", type=int, default=74)
    args = parser.parse_args(argv)

    data = args.flashinfer / "data"
    cu = (data / "csrc" / "nvlink_one_sided_alltoall.cu").read_text()
    rows = list(configurations(args.seed, args.count))
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "layout_driver.cpp"
        binary = Path(tmp) / "layout_driver"
        source.write_text(driver_source(cu))
        nv_internal = data / "csrc" / "nv_internal"
        subprocess.run(
            [
                "g++",
                "-std=c++17",
                "-O1",
                f"-I{nv_internal}",
                f"-I{nv_internal / 'include'}",
                f"-I{args.cuda_include}",
                str(source),
                "-o",
                str(binary),
            ],
            check=True,
        )
        inputs = "".join(
            f"{ep} {tokens} {top_k} {' '.join(map(str, op_inputs(ep, tokens, top_k, hidden, fmt, extra)))} {eplb}\n"
            for ep, tokens, top_k, hidden, fmt, extra, eplb in rows
        )
        output = subprocess.run(
            [str(binary)], input=inputs, capture_output=True, text=True, check=True
        ).stdout.splitlines()
    if len(output) != len(rows):
        raise SystemExit(f"the driver answered {len(output)} of {len(rows)} rows")
    refused = [line for line in output if not line.startswith("ok ")]
    if refused:
        raise SystemExit(f"FlashInfer's layout refused {len(refused)} rows: {refused[:3]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as handle:
        handle.write(
            f"# FlashInfer {FLASHINFER_VERSION}'s one-sided all-to-all workspace layout, fence path "
            "(CFT and Lamport off), one row per configuration.\n"
            "# Produced by scripts/flashinfer_layouts.py on a CPU machine: FlashInfer's own host "
            "layout code (calculateWorkspaceLayout from the wheel's\n"
            "# data/csrc/nvlink_one_sided_alltoall.cu, unmodified, with its moeAlltoAllMeta.h) "
            "compiled with g++; dispatch_bytes and combine_bytes are the inputs\n"
            "# NVLinkOneSidedAlltoAll.__init__ computes in Python (written out in the script). "
            "Not yet the GPU op: bench/gpu_runs/fi074_layouts.py checks these\n"
            f"# rows against the real moe_a2a_get_workspace_layout. seed={args.seed} "
            f"rows={len(rows)}; format = FlashInfer QuantFormat name.\n"
        )
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(COLUMNS)
        for row, line in zip(rows, output, strict=True):
            ep, tokens, top_k, hidden, fmt, extra, _ = row
            writer.writerow(
                (*row, *op_inputs(ep, tokens, top_k, hidden, fmt, extra), *line.split()[1:])
            )
    print(f"wrote {len(rows)} rows to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
