# FlashInfer 0.7.4 GPU call 2 (one H200, EP ranks sharing it): the client's
# flashinfer-moe-ep backend through a real sidecar at DeepSeek-V3 shapes, EP 2
# and EP 8 (tests/gpu/test_fi074_alltoall.py), plus the overflow case. The
# platform vote is stood in for because every rank is on the one GPU (the
# test says so in its output). Run after fi074-layouts.sh on the same warm
# machine to reuse the compiled module; a fresh machine compiles it first.
#   run: bash bench/gpu_runs/fi074-tests.sh     (carry .gpu074; copy $OUT to bench/results/gpu/)
. bench/gpu_runs/common-fi074.sh
timeout 570 python3 -m pytest tests/gpu/test_fi074_alltoall.py -v -s -p no:cacheprovider 2>&1 | tee "$OUT/fi074-tests.log" | tail -n 40
