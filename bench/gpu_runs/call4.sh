# GPU call 4 (2 x H200): prewarm's GPU test (tests/gpu/test_prewarm.py): a cold
# JIT compile in a fresh cache, then fresh rank processes that load the module
# without compiling.
#   bash bench/gpu_runs/call4.sh      (on the GPU machine, .gpu carried, $OUT set)
. bench/gpu_runs/common.sh
timeout 420 python3 -m pytest tests/gpu/test_prewarm.py -v -s -p no:cacheprovider 2>&1 | tee "$OUT/gpu-prewarm-test.log" | tail -n 30
