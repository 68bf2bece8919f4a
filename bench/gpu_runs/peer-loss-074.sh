# GPU (1 x H200, FlashInfer 0.7.4, .gpu074 carried, $OUT set): the peer-loss
# run of bench/gpu_runs/peer-loss.sh on 0.7.4's moe_ep object
# (NVLinkOneSidedAlltoAll, stepped as bench/masked_steps_gpu.py steps it; the
# platform vote stood in for, every rank sharing the GPU): rank 3 killed
# between its dispatch and its combine while ranks 0-2 wait in combine, with
# the watcher (MOE_SIDECAR_ON_PEER_LOSS=exit: every survivor gone within 2 s,
# naming the dead rank) and without it (=wait). 0.7.4's waits time out after
# NVLinkOneSidedConfig.timeout_sec (default 300 s): under the 60 s cap the
# survivors without the watcher are expected still hung, and the summary line
# says so (capped, not a trap). Its module compiles on first use (about 85 s)
# unless an earlier 0.7.4 call of this warm machine left it in /tmp/fi-074.
#   bash bench/gpu_runs/peer-loss-074.sh
. bench/gpu_runs/common-fi074.sh
mkdir -p "$OUT/peer-loss-074"
timeout 250 python3 bench/peer_loss_gpu.py --backend flashinfer-moe-ep --ranks 4 --hang-cap 60 --out "$OUT/peer-loss-074" 2>&1 | tee "$OUT/peer-loss-074.log"
exit "${PIPESTATUS[0]}"
