#!/usr/bin/env bash
# Every test tier, as `make test` runs it: three pytest sessions side by side, each doing its own
# set-up, so that none waits for what only another needs.
#
# - cluster: the control plane with its real nodes (it compiles from Go modules cold), then the
#   tiers that drive it (cluster, e2e, realpods). Our images are built and the nodes pull them from
#   the local registry in the background meanwhile (about 13 minutes on 2 cores when the multi-GB
#   trainer image changed): the tests that use the real nodes run last (tests/conftest.py), and
#   their fixture waits for the images on hack/images.sh's lock, or builds and publishes them
#   itself in a direct pytest run.
# - cpu: the trainer's real torchrun runs on the newest torch. It needs no cluster and no other
#   venv: it starts at once (stop 62's CI: 10 of its 70 minutes were set-up it waited for).
# - oldest: prometheus-operator (the e2e test that needs it waits for the build's lock, or builds
#   it itself), the second control plane at the oldest Kubernetes the chart allows with the
#   versioned tests (the Makefile's VERSIONED_TESTS, kwok's nodes only), then the unit tier, the
#   trainer tiers again on the floor's torch (their own venv), and the trainer's throughput guard.
#
# The tiers that drive a control plane spend most of their time waiting on the API server, the
# scheduler and pods, while the CPU tiers compute: one after the other they would leave one of CI's
# two cores idle for most of an hour.
# No session depends on another's state (the CPU tiers start no cluster objects; each cluster
# session has its own control plane), and tests wait on events, not on wall-clock margins, so
# sharing the cores makes them slower, not wrong. Each line is prefixed with its session; each
# session prints its own summary; the run fails if any does, and its last lines name every failed
# test of every session (CI shows a log's tail).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
# The slowest tests of each session in its log: where the CI budget goes, without a rerun.
export PYTEST_ARGS="${PYTEST_ARGS:-} --durations=15"
read -r -a ARGS <<<"${PYTEST_ARGS}"

prefix() { sed -u "s/^/[$1] /"; }
OVERHEAD_TEST=tests/trainer/test_trainer_overhead.py::test_trainer_throughput_is_at_least_090_of_a_plain_ddp_loop

# floor_venv: make install-floor, one session at a time (the cluster session's image build and the
# oldest session's floor tier both need it; the second finds it made).
floor_venv() {
  mkdir -p .cache
  flock .cache/install-floor.lock make --no-print-directory install-floor
}

cluster_tiers() {
  local rc=0 publish_pid=
  DDPJOB_PROMETHEUS_OPERATOR=0 hack/cluster-up.sh || { echo "make test: the control plane did not start (above)"; return 1; }
  # Our images are built, pushed to the local registry and pulled by the nodes while the tests that
  # need no real node run (rehearsal 26: 4.5 minutes of building before pytest started, then 8 of
  # pushing and pulling beside it). A failed build fails the real-node tests' fixture, which tries
  # again and says why.
  # The floor venv first (the oldest session's, under its lock): the trainer image's torch base
  # then installs the same torch wheel from the machine's uv cache, not from PyPI a second time.
  { floor_venv && hack/images.sh products && hack/images.sh all; } 2>&1 | prefix images &
  publish_pid=$!
  "$PY" -m pytest -ra "${ARGS[@]}" tests --ignore=tests/trainer --ignore=tests/unit || rc=$?   # every other tier, new ones too
  wait "$publish_pid" || rc=$((rc ? rc : 1))
  return "$rc"
}

# The versioned tests again, on the second control plane at the oldest Kubernetes the chart
# allows (the Makefile's VERSIONED_TESTS say which and why); its own pytest cache. The tiers after
# them run even when they could not.
oldest_tiers() {
  local rc=0 floor_pid
  # The floor venv downloads and writes (torch) while the second control plane starts.
  floor_venv &
  floor_pid=$!
  hack/build.sh prometheus-operator || rc=1   # for the cluster session's e2e test (above)
  if [ "$rc" = 0 ] && DDPJOB_CLUSTER=oldest hack/cluster-up.sh; then
    PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} -o cache_dir=.pytest_cache/oldest" make --no-print-directory test-oldest || rc=$?
  else
    rc=1
  fi
  # Down once its tests ran: its API server, etcd and kwok no longer take a share of the two cores
  # the other sessions still need. Its logs stay for a failure's reader.
  DDPJOB_CLUSTER=oldest hack/cluster-down.sh --keep-logs || true
  # Then the unit tier (pure functions, no cluster).
  PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} -o cache_dir=.pytest_cache/unit" \
    "$PY" -m pytest -ra "${ARGS[@]}" tests/unit || rc=$((rc ? rc : $?))
  # The trainer tiers again on the floor's torch: here, not after the trainer tier in the cpu
  # session, which was CI's critical path with both (rehearsal 25: about 72 minutes, while this
  # session ended after 36).
  if wait "$floor_pid"; then
    make --no-print-directory test-floor || rc=$((rc ? rc : $?))
  else
    echo "make test: the floor venv did not install (above)"
    rc=$((rc ? rc : 1))
  fi
  # And the trainer's throughput guard: it races its two arms side by side, so whatever else the
  # machine runs slows both alike, and it races more (4 to 12 minutes) when that load spreads its
  # ratios.
  PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} -o cache_dir=.pytest_cache/overhead" \
    "$PY" -m pytest -ra "${ARGS[@]}" "$OVERHEAD_TEST" || rc=$((rc ? rc : $?))
  return "$rc"
}

# The trainer's real torchrun runs on the newest torch: no cluster, no floor venv to wait for.
cpu_tiers() {
  # Its own pytest cache: every session writes its own when it ends.
  PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} -o cache_dir=.pytest_cache/cpu" \
    "$PY" -m pytest -ra "${ARGS[@]}" tests/trainer --deselect "$OVERHEAD_TEST"   # the oldest session runs it
}

# recap NAME...: the failed tests and the pytest summaries of each session's log, at the end of
# the output, where CI's tail shows them; before them, the last lines of each session's failure
# explanations (pytest's "E   " lines: a summary line names only a message's first line).
recap() {
  local name
  for name in "$@"; do
    grep -E "^\[$name\] E   " "$LOGS/$name.log" | tail -n 24 || true
  done
  for name in "$@"; do
    grep -E "^\[$name\] (FAILED|ERROR) |^\[$name\] =+ .* in [0-9.]+s|^\[$name\] make test: " "$LOGS/$name.log" || true
  done
}

LOGS=.cache/test-logs
mkdir -p "$LOGS"
cluster_tiers 2>&1 | prefix cluster | tee "$LOGS/cluster.log" &
cluster_pid=$!
cpu_tiers 2>&1 | prefix cpu | tee "$LOGS/cpu.log" &
cpu_pid=$!
oldest_tiers 2>&1 | prefix oldest | tee "$LOGS/oldest.log" &
oldest_pid=$!
wait "$cluster_pid"; cluster_rc=$?
wait "$cpu_pid"; cpu_rc=$?
wait "$oldest_pid"; oldest_rc=$?
echo "make test: the sessions' summaries and failures (whole logs in $LOGS/):"
recap cluster cpu oldest
echo "make test: cluster tiers exit ${cluster_rc}, cpu tier (trainer) exit ${cpu_rc}, oldest Kubernetes (then unit, the floor, the throughput guard) exit ${oldest_rc}"
exit $((cluster_rc || cpu_rc || oldest_rc))
