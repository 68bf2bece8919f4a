# GPU call (1 x H200, FlashInfer 0.7.4, .gpu074 carried): the layout table
# against the real op, then the 0.7.4 GPU tests (the rejoin's is
# bench/gpu_runs/rejoin.sh's run, a call of its own), on one tree.
#   bash bench/gpu_runs/final-074.sh      (on the GPU machine, .gpu074 carried, $OUT set)
. bench/gpu_runs/common-fi074.sh
timeout 300 python3 bench/gpu_runs/fi074_layouts.py --json "$OUT/fi074-layouts.json" 2>&1 | tee "$OUT/fi074-layouts.log" | tail -n 8
timeout 270 python3 -m pytest tests/gpu -v -s -p no:cacheprovider --deselect tests/gpu/test_prewarm.py --deselect tests/gpu/test_rejoin_gpu.py 2>&1 | tee "$OUT/fi074-tests.log" | tail -n 25
