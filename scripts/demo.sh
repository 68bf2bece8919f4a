#!/usr/bin/env bash
# The README's demo: start a sidecar, run a model's start-up against it twice
# (the second run is a restart, which builds once), then show what the sidecar
# keeps. Needs the client extra (torch); no GPU. About a minute on 2 cores.
set -euo pipefail

work=$(mktemp -d "${TMPDIR:-/tmp}/moe-sidecar-demo.XXXXXX")
target="unix://$work/sidecar.sock"
# Its own socket, state directory and no TCP port, so it runs beside any
# other sidecar on the machine; a fixed node name for the growth history.
moe-sidecar serve --listen "$target" --state-dir "$work/state" --health-port 0 \
    --metrics-port 0 --node-name demo-node --log-format text 2>"$work/sidecar.log" &
sidecar=$!
stop() {
    kill -TERM "$sidecar" 2>/dev/null || true
    wait "$sidecar" 2>/dev/null || true
    rm -rf "$work"
}
trap stop EXIT
for _ in $(seq 300); do
    [ -S "$work/sidecar.sock" ] && break
    if ! kill -0 "$sidecar" 2>/dev/null; then
        cat "$work/sidecar.log" >&2
        exit 1
    fi
    sleep 0.1
done

echo "== a sidecar on $target"
echo "== 1. DeepSeek-V3's MoE layers on 2 CPU ranks: the bf16 MTP layer grows the workspace"
moe-sidecar simulate --ranks 2 --target "$target"
echo
echo "== 2. the same model restarted: the sidecar remembers the plan, round 1 builds it"
moe-sidecar simulate --ranks 2 --target "$target"
echo
echo "== 3. what the sidecar keeps: moe-sidecar groups"
moe-sidecar groups --target "$target"
