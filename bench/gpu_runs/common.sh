# Sourced by the GPU run scripts: installs what the GPU machine lacks (the
# wheels carried as .gpu/wheels: flashinfer-python, grpcio, protobuf and the
# rest, downloaded with pip on a machine with PyPI) and the project beside them, and
# puts FlashInfer's module compiled earlier (.gpu/aot) where FlashInfer finds
# an ahead-of-time module. Logs go to $OUT.
set -uo pipefail
# Once per call: a script run from one that sourced this already (and set
# MOE_GPU_INSTALLED) reuses the install. The wheels and the project go in
# with --upgrade: pip --target keeps a package directory that exists (a warm
# machine's, from an earlier call's wheels or tree) unless told to replace it.
if [ -z "${MOE_GPU_INSTALLED:-}" ]; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/wheels/*.whl \
    && python3 -m pip install -q --upgrade --no-index --no-deps --no-build-isolation --target /tmp/site . || exit 1
fi
export MOE_GPU_INSTALLED=1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fi NCCL_NVLS_ENABLE=0
if [ -f .gpu/aot/mnnvl_moe_alltoall.so ]; then
  mkdir -p /tmp/site/flashinfer/data/aot/mnnvl_moe_alltoall
  cp .gpu/aot/mnnvl_moe_alltoall.so /tmp/site/flashinfer/data/aot/mnnvl_moe_alltoall/
fi
moe_sidecar() { python3 -c 'import sys; from moe_sidecar.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }
{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi -L
  python3 -c 'import sys, torch, flashinfer, grpc, google.protobuf as pb; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "flashinfer", flashinfer.__version__, "grpcio", grpc.__version__, "protobuf", pb.__version__)'
  git log -1 --format='tree: %h %s' 2>/dev/null || true
} 2>&1 | tee "$OUT/machine.txt"
