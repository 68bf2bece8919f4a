# GPU call (1 x H200, FlashInfer 0.7.2.post1 with its module carried in .gpu/aot):
# on one tree, every GPU test (tests/gpu; the rejoin's is bench/gpu_runs/rejoin.sh's
# run, a call of its own) alone on the GPU first (the
# regression test reads the GPU-wide memory figure, which another process's
# allocations would change), then at once (the ranks of each part share the
# one GPU; a trap stays inside its process): SGLang's adapter at DeepSeek-V3
# shapes (EP 2 and EP 8) and the peer-loss kill with and without the watcher.
# Everything it writes is packed into $OUT/final-0721.tgz (the device tool
# returns at most 8 files).
#   bash bench/gpu_runs/final-0721.sh      (on the GPU machine, .gpu carried, $OUT set)
# PART_CPUS (e.g. 2-15) pins the parts to those cores.
. bench/gpu_runs/common.sh
pin=${PART_CPUS:+taskset -c $PART_CPUS}
mkdir -p "$OUT/run"
timeout 200 $pin python3 -m pytest tests/gpu -v -s -p no:cacheprovider --deselect tests/gpu/test_prewarm.py --deselect tests/gpu/test_rejoin_gpu.py \
  >"$OUT/run/gpu-tests.log" 2>&1; echo "gpu tests rc=$?" >>"$OUT/run/gpu-tests.log"
(for ep in 2 8; do
  timeout 250 $pin python3 bench/gpu_runs/sglang_alltoall.py --ep "$ep" --tokens 4096 --out "$OUT/run" \
    >"$OUT/run/sglang-ep$ep.log" 2>&1; echo "sglang ep$ep rc=$?" >>"$OUT/run/sglang-ep$ep.log"
done) &
(timeout 380 $pin python3 bench/peer_loss_gpu.py --ranks 4 --hang-cap 330 --out "$OUT/run" \
  >"$OUT/run/peer-loss.log" 2>&1; echo "peer-loss rc=$?" >>"$OUT/run/peer-loss.log") &
wait
cp "$OUT/machine.txt" "$OUT/run/" 2>/dev/null
tar czf "$OUT/final-0721.tgz" -C "$OUT" run && rm -rf "$OUT/run"
echo "== tails"; tar xzf "$OUT/final-0721.tgz" -O run/gpu-tests.log | tail -n 15
tar xzf "$OUT/final-0721.tgz" -O run/sglang-ep8.log | tail -n 12
tar xzf "$OUT/final-0721.tgz" -O run/peer-loss.log | tail -n 15
