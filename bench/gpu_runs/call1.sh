# GPU call 1 (2 x H200): the cold compile through `moe-sidecar prewarm` with no
# GPU visible, its second run ("already built"), then every GPU test.
#   bash bench/gpu_runs/call1.sh      (on the GPU machine, .gpu carried, $OUT set)
. bench/gpu_runs/common.sh
{
  echo "== prewarm, no GPU visible, into an empty cache (the cold JIT compile)"
  time CUDA_VISIBLE_DEVICES= moe_sidecar prewarm --arch 9.0a --ignore-aot
  echo "== prewarm again: nothing to build"
  time CUDA_VISIBLE_DEVICES= moe_sidecar prewarm --arch 9.0a --ignore-aot
} 2>&1 | tee "$OUT/prewarm.log"
cp /tmp/fi/.cache/flashinfer/*/90a/cached_ops/mnnvl_moe_alltoall/mnnvl_moe_alltoall.so "$OUT/" || true
timeout 330 python3 -m pytest tests/gpu -v -s -p no:cacheprovider --deselect tests/gpu/test_prewarm.py 2>&1 | tee "$OUT/gpu-tests.log"
