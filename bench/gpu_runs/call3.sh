# GPU call 3 (2 x H200): bench/ep_scale.py's four measurements at EP 2 (bench/ep_scale.py:
# regression through a sidecar, memory vs vLLM 0.33's sequence, REUSE rounds and
# model init, prewarmed cold start), then every GPU test but prewarm's on the
# final tree. FlashInfer's module of call 1 is carried as .gpu/aot.
#   bash bench/gpu_runs/call3.sh      (on the GPU machine, .gpu carried, $OUT set)
. bench/gpu_runs/common.sh
timeout 360 python3 bench/ep_scale.py --out "$OUT" --budget 330 2>&1 | tail -n 60
timeout 150 python3 -m pytest tests/gpu -v -s -p no:cacheprovider --deselect tests/gpu/test_prewarm.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 15
