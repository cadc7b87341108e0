#!/usr/bin/env bash
# How often a finished two-node run of examples/scripts/train.py aborts in teardown
# ("terminate called without an active exception"), with and without the launcher's exit guard
# (trainer/ddpjob_trainer/launch/exitguard). Both nodes on this machine, gloo on the CPU.
#   hack/stress-teardown.sh [RUNS] [guarded|unguarded]
set -euo pipefail
runs=${1:-20}
mode=${2:-guarded}
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
guard=$("$py" -c 'from ddpjob_trainer.launch.node import EXIT_GUARD; print(EXIT_GUARD)')
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
cd "$root/examples"
aborts=0
for i in $(seq "$runs"); do
  port=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  for node in 0 1; do
    (
      [ "$mode" = guarded ] && export PYTHONPATH=$guard
      "$py" -m torch.distributed.run --nnodes 2 --node-rank $node --nproc-per-node 1 \
        --master-addr 127.0.0.1 --master-port "$port" scripts/train.py --epochs 1 \
        >"$logs/$i.$node.log" 2>&1 || true
    ) &
  done
  wait
  if grep -q "terminate called" "$logs/$i".*.log; then aborts=$((aborts + 1)); fi
done
echo "$mode: $aborts of $runs runs aborted in teardown"
