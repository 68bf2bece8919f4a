# Sourced by the FlashInfer 0.7.4 GPU run scripts (fi074-*.sh): installs the
# wheels of bench/gpu_runs/prepare-fi074.sh (carried as .gpu074: flashinfer
# 0.7.4 slimmed, apache-tvm-ffi, the sidecar's wire packages) and the project
# beside them. FlashInfer 0.7.4 has no ahead-of-time module here: its
# nvlink_one_sided_alltoall module compiles on first use (83 s measured on an
# H200 host) into FLASHINFER_WORKSPACE_BASE, which later processes of the same
# warm machine reuse. Logs go to $OUT.
set -uo pipefail
# Its own target and JIT cache: a warm machine may hold 0.7.2.post1 in
# /tmp/site and /tmp/fi from common.sh. The wheels and the project go in
# with --upgrade: pip --target keeps a package directory that exists (an
# earlier call's wheels or tree).
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-fi074 .gpu074/*.whl \
  && python3 -m pip install -q --upgrade --no-index --no-deps --no-build-isolation --target /tmp/site-fi074 . || exit 1
export PYTHONPATH=/tmp/site-fi074:$PWD PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fi-074 NCCL_NVLS_ENABLE=0
{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi -L
  python3 -c 'import sys, torch, flashinfer, grpc, google.protobuf as pb; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "flashinfer", flashinfer.__version__, "grpcio", grpc.__version__, "protobuf", pb.__version__)'
  git log -1 --format='tree: %h %s' 2>/dev/null || true
} 2>&1 | tee "$OUT/machine-fi074.txt"
