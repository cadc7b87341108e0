#!/usr/bin/env bash
# Every test tier, as `make test` runs it: two pytest sessions side by side.
#
# The tiers that drive the control plane (cluster, e2e, realpods) spend most of their time waiting
# on the API server, the scheduler and pods, while the CPU tiers (the trainer's real torchrun runs,
# then the version-dependent ones again on the image's torch) compute: one after the other they
# leave one of CI's two cores idle for most of an hour. Neither session depends on the other's
# state (the CPU tiers start no cluster objects), and tests wait on events, not on wall-clock
# margins, so sharing the cores makes them slower, not wrong. Each line is prefixed with its
# session; each session prints its own summary; the run fails if either does.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
# The slowest tests of each session in its log: where the CI budget goes, without a rerun.
export PYTEST_ARGS="${PYTEST_ARGS:-} --durations=15"
read -r -a ARGS <<<"${PYTEST_ARGS}"

cluster_tiers() {
  local rc=0
  "$PY" -m pytest -ra "${ARGS[@]}" tests --ignore=tests/trainer || rc=$?   # every other tier, new ones too
  # The versioned tests again, on the second control plane at the oldest Kubernetes the chart
  # allows (the Makefile's VERSIONED_TESTS say which and why); its own pytest cache.
  PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} -o cache_dir=.pytest_cache/oldest" make --no-print-directory test-oldest || rc=$((rc ? rc : $?))
  return "$rc"
}

cpu_tiers() {
  local rc=0
  # Its own pytest cache: both sessions write theirs when they end.
  export PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} -o cache_dir=.pytest_cache/cpu"
  "$PY" -m pytest -ra "${ARGS[@]}" tests/trainer || rc=$?
  # The floor runs even when the newest torch failed: a failure on one torch only is worth seeing.
  make --no-print-directory test-floor || rc=$((rc ? rc : $?))
  return "$rc"
}

prefix() { sed -u "s/^/[$1] /"; }

cluster_tiers 2>&1 | prefix cluster &
cluster_pid=$!
cpu_tiers 2>&1 | prefix cpu &
cpu_pid=$!
wait "$cluster_pid"; cluster_rc=$?
wait "$cpu_pid"; cpu_rc=$?
echo "make test: cluster tiers exit ${cluster_rc}, cpu tiers (trainer, then floor) exit ${cpu_rc}"
exit $((cluster_rc || cpu_rc))
