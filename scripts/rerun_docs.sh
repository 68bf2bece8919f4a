#!/usr/bin/env bash
# Re-runs the README's two commands and the user guide's quick-start commands
# in a fresh clone and a fresh virtual environment, timing each, and writes
# what each printed under OUTDIR with a table of the times (OUTDIR/times.md).
#   scripts/rerun_docs.sh OUTDIR [--skip-tests]
# Needs network access to PyPI (or its mirror) and the CPU torch index, and
# etcd on PATH for the two-node simulate. Ports 50051, 50052, 9464 and 2379
# must be free (the docs' defaults).
set -uo pipefail
out=$(realpath -m "${1:?usage: scripts/rerun_docs.sh OUTDIR [--skip-tests]}")
skip_tests=${2:-}
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
# Readable by other users, as a checkout usually is: tests run a sidecar as
# uid 65534 from it.
chmod 755 "$work"
mkdir -p "$out"
printf '| step | command | exit | seconds |\n| --- | --- | --- | --- |\n' >"$out/times.md"
step=0
# run NAME COMMAND...: runs COMMAND in the clone with bash, its output in OUTDIR/NN-NAME.log.
run() {
    local name=$1; shift
    step=$((step + 1))
    local log; log=$(printf '%s/%02d-%s.log' "$out" "$step" "$name")
    local start=$SECONDS
    (cd "$work/clone" && bash -c "$*") >"$log" 2>&1
    local rc=$?
    local shown=$*
    printf '| %d | `%s` | %d | %d |\n' "$step" "${shown//|/\\|}" "$rc" "$((SECONDS - start))" >>"$out/times.md"
    echo "$name: exit $rc in $((SECONDS - start)) s"
    return 0
}
# wait_port PORT: returns once something listens on 127.0.0.1:PORT (60 s at most).
wait_port() {
    for _ in $(seq 600); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.1  # the poll interval of a wait with a deadline
    done
    return 1
}

git clone -q "$repo" "$work/clone"
git -C "$work/clone" log -1 --format='tree: %h %s' >"$out/tree.txt"
readme_install=$(sed -n '/^```bash/,/^```/p' "$repo/README.md" | sed -n 2p)
readme_tests=$(sed -n '/^```bash/,/^```/p' "$repo/README.md" | sed -n 3p)
run readme-install-and-demo "$readme_install"
act='. .venv/bin/activate'
run size "$act && moe-sidecar size --flashinfer 0.7.4 --ep 8 --tokens 8192 --hidden 7168 --top-k 8 --experts 256 --dispatch nvfp4 --dispatch bf16"

(cd "$work/clone" && . .venv/bin/activate && exec moe-sidecar serve --state-dir ./state --node-name demo-node) \
    >"$out/sidecar.log" 2>&1 &
sidecar=$!
wait_port 50051 && wait_port 9464
run simulate-first "$act && moe-sidecar simulate --ranks 2 --model deepseek-v3 --target 127.0.0.1:50051"
run simulate-again "$act && moe-sidecar simulate --ranks 2 --model deepseek-v3 --target 127.0.0.1:50051"
run groups "$act && moe-sidecar groups"
run doctor "$act && moe-sidecar doctor --state-dir ./state"
run metrics "curl -s 127.0.0.1:9464/metrics | grep '^moe_sidecar_' | head -n 40"
kill -TERM "$sidecar"; wait "$sidecar"
echo "sidecar exit $?" >>"$out/sidecar.log"

if command -v etcd >/dev/null; then
    (cd "$work" && exec etcd --data-dir "$work/etcd-demo") >"$out/etcd.log" 2>&1 &
    etcd_pid=$!
    wait_port 2379
    run simulate-two-nodes "$act && moe-sidecar simulate --ranks 4 --nodes 2 --store etcd://127.0.0.1:2379/moe-simulate"
    run simulate-two-nodes-again "$act && moe-sidecar simulate --ranks 4 --nodes 2 --store etcd://127.0.0.1:2379/moe-simulate"
    kill "$etcd_pid"; wait "$etcd_pid" 2>/dev/null
fi
if [ "$skip_tests" != --skip-tests ]; then
    run readme-tests "$act && $readme_tests"
fi
rm -rf "$work"
cat "$out/times.md"
