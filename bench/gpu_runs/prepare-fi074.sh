#!/usr/bin/env bash
# Prepares .gpu074 for the FlashInfer 0.7.4 GPU runs (fi074.sh): the slimmed
# flashinfer-python 0.7.4 wheel and apache-tvm-ffi of ../shared/gpu/prepare-flashinfer-0.7.4.sh,
# plus the sidecar's wire packages the GPU machine lacks (grpcio, protobuf,
# health checking, reflection) and pytest-asyncio, for Python 3.12. It travels
# alone (carry .gpu074, not .gpu): the tree and it must stay under 64 MiB
# (about 51 MiB of wheels).
#   usage (in the worktree): bash bench/gpu_runs/prepare-fi074.sh [DEST]
set -euo pipefail
dest=${1:-.gpu074}
shared=../shared
[ -d "$shared/gpu" ] || shared=/work/shared
bash "$shared/gpu/prepare-flashinfer-0.7.4.sh" "$dest"
# Beyond what that script drops: the C++ sources of other JIT modules that
# sit beside their Python packages (flashinfer/*_backend/csrc/, about 13 MB
# compressed); the one-sided all-to-all compiles from data/ only.
python3 - "$dest"/flashinfer_python-0.7.4-*.whl <<'PY'
import os, re, sys, zipfile
path = sys.argv[1]
with zipfile.ZipFile(path) as src, zipfile.ZipFile(path + ".new", "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
    for info in src.infolist():
        if re.match(r"flashinfer/[^/]+_backend/csrc/", info.filename) and not info.filename.endswith(".py"):
            continue
        out.writestr(info, src.read(info))
os.replace(path + ".new", path)
PY
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dest" \
  grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 pytest-asyncio
du -ch "$dest"/*.whl | tail -1
