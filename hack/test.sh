#!/usr/bin/env bash
# Every test tier, as `make test` runs it: the set-up, then three pytest sessions side by side.
#
# Set-up: the control plane compiles from Go modules (CPU) while the floor venv and the images
# mostly download and write (network, disk): side by side, a cold machine waits for the longer of
# the two instead of their sum. Then the nodes pull the images from the local registry. What only
# some tests need is built beside the tiers, off that critical path (cold: about 4.5 of its 31
# minutes): the second control plane (by the oldest session, before its tests) and
# prometheus-operator (by the oldest session first; the e2e test that needs it waits for the
# build's lock, or builds it itself).
#
# The tiers that drive the control plane (cluster, e2e, realpods) spend most of their time waiting
# on the API server, the scheduler and pods, while the CPU tiers (the trainer's real torchrun runs,
# then the version-dependent ones again on the image's torch) compute: one after the other they
# leave one of CI's two cores idle for most of an hour. The versioned tests on the oldest
# Kubernetes (the Makefile's VERSIONED_TESTS) wait on their own control plane, kwok's nodes only;
# that session then runs the unit tier and the trainer's throughput guard.
# No session depends on another's state (the CPU tiers start no cluster objects; each cluster
# session has its own control plane), and tests wait on events, not on wall-clock margins, so
# sharing the cores makes them slower, not wrong. Each line is prefixed with its session; each
# session prints its own summary; the run fails if any does.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
# The slowest tests of each session in its log: where the CI budget goes, without a rerun.
export PYTEST_ARGS="${PYTEST_ARGS:-} --durations=15"
read -r -a ARGS <<<"${PYTEST_ARGS}"

prefix() { sed -u "s/^/[$1] /"; }
OVERHEAD_TEST=tests/trainer/test_trainer_overhead.py::test_trainer_throughput_is_at_least_090_of_a_plain_ddp_loop

prepare() {
  local cp_pid img_pid rc=0
  DDPJOB_PROMETHEUS_OPERATOR=0 hack/cluster-up.sh 2>&1 | prefix setup &
  cp_pid=$!
  { make --no-print-directory install-floor && hack/images.sh products; } 2>&1 | prefix setup &
  img_pid=$!
  wait "$cp_pid" || rc=1
  wait "$img_pid" || rc=1
  [ "$rc" = 0 ] || { echo "make test: set-up failed (above)"; return 1; }
  hack/images.sh all 2>&1 | prefix setup   # built: the nodes pull them from the local registry
}

cluster_tiers() {
  "$PY" -m pytest -ra "${ARGS[@]}" tests --ignore=tests/trainer --ignore=tests/unit   # every other tier, new ones too
}

# The versioned tests again, on the second control plane at the oldest Kubernetes the chart
# allows (the Makefile's VERSIONED_TESTS say which and why); its own pytest cache. The unit tier
# runs after them even when they could not.
oldest_tiers() {
  local rc=0
  hack/build.sh prometheus-operator || rc=1   # for the cluster session's e2e test (above)
  if [ "$rc" = 0 ] && DDPJOB_CLUSTER=oldest hack/cluster-up.sh; then
    PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} -o cache_dir=.pytest_cache/oldest" make --no-print-directory test-oldest || rc=$?
  else
    rc=1
  fi
  # Down once its tests ran (10 of CI's 70 minutes): its API server, etcd and kwok no longer take a
  # share of the two cores the other sessions still need. Its logs stay for a failure's reader.
  DDPJOB_CLUSTER=oldest hack/cluster-down.sh --keep-logs || true
  # Then the unit tier (pure functions, no cluster): in this session, which ends about 45 minutes
  # before the others, not in the cluster session, whose end it delayed by its 3-4 minutes.
  PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} -o cache_dir=.pytest_cache/unit" \
    "$PY" -m pytest -ra "${ARGS[@]}" tests/unit || rc=$((rc ? rc : $?))
  # And the trainer's throughput guard, the cpu session's longest test: it races its two arms
  # side by side, so whatever else the machine runs slows both alike, and it races more (4 to 12
  # minutes) when that load spreads its ratios. Here it ends before the cpu session does.
  PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} -o cache_dir=.pytest_cache/overhead" \
    "$PY" -m pytest -ra "${ARGS[@]}" "$OVERHEAD_TEST" || rc=$((rc ? rc : $?))
  return "$rc"
}

cpu_tiers() {
  local rc=0
  # Its own pytest cache: every session writes its own when it ends.
  export PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} -o cache_dir=.pytest_cache/cpu"
  "$PY" -m pytest -ra "${ARGS[@]}" tests/trainer --deselect "$OVERHEAD_TEST" || rc=$?   # the oldest session runs it
  # The floor runs even when the newest torch failed: a failure on one torch only is worth seeing.
  make --no-print-directory test-floor || rc=$((rc ? rc : $?))
  return "$rc"
}

prepare || exit 1
cluster_tiers 2>&1 | prefix cluster &
cluster_pid=$!
cpu_tiers 2>&1 | prefix cpu &
cpu_pid=$!
oldest_tiers 2>&1 | prefix oldest &
oldest_pid=$!
wait "$cluster_pid"; cluster_rc=$?
wait "$cpu_pid"; cpu_rc=$?
wait "$oldest_pid"; oldest_rc=$?
echo "make test: cluster tiers exit ${cluster_rc}, cpu tiers (trainer, then floor) exit ${cpu_rc}, oldest Kubernetes (then unit, then the throughput guard) exit ${oldest_rc}"
exit $((cluster_rc || cpu_rc || oldest_rc))
