# GPU (1 x H200, FlashInfer 0.7.2.post1 with its module carried in .gpu/aot):
# a peer killed between its dispatch and its combine while the other three
# ranks (all four sharing the GPU) wait in combine, with the peer-loss watcher
# (MOE_SIDECAR_ON_PEER_LOSS=exit: every survivor gone within 2 s, naming the
# dead rank) and without it (=wait: FlashInfer's own outcome, recorded as a
# trap 304 s later and a hang past 470 s), both in one run. The run without
# the watcher is watched for 400 s, then its survivors are killed.
#   bash bench/gpu_runs/peer-loss.sh      (on the GPU machine, .gpu carried, $OUT set)
. bench/gpu_runs/common.sh
timeout 590 python3 bench/peer_loss_gpu.py --ranks 4 --hang-cap 400 --out "$OUT" 2>&1 | tee "$OUT/peer-loss.log"
