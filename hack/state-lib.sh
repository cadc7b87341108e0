# Sourced (ROOT set): STATE, the directory where a local cluster keeps its state, the one home of it.
# .cache/cluster, or .cache/cluster-oldest with DDPJOB_CLUSTER=oldest (hack/cluster-up.sh), with
# symlinks resolved: the processes a cluster-up starts name this path on their command lines, which
# is how cluster-up and cluster-down know them as theirs, so a second checkout whose .cache links to
# this one's must see this one's cluster as its own, and never tear it down as a stranger's.
# cluster_state_dir [KIND]: the state directory of the main cluster ("") or of KIND.
cluster_state_dir() {
  local cache
  mkdir -p "$ROOT/.cache"
  cache="$(cd "$ROOT/.cache" && pwd -P)"
  echo "$cache/cluster${1:+-$1}"
}
STATE="$(cluster_state_dir "${DDPJOB_CLUSTER:-}")"
