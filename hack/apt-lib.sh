# Sourced by hack/ensure-*.sh: apt_install NAME PKG... installs Debian packages without letting
# their services start (policy-rc.d): tests start their own Prometheus, and each real node its own
# containerd. Needs root or sudo. One at a time on a machine (flock): make test's set-up runs
# cluster-up (the nodes' packages) beside the image build (the same packages) and, on a fresh
# machine, dpkg's lock refused the second apt-get at once; the first one's policy-rc.d must also
# outlive the second's install.
apt_install() {
  (
    flock 9
    _apt_install "$@"
  ) 9>"${TMPDIR:-/tmp}/ddpjob-apt.lock"
}

_apt_install() {
  local who="$1" sudo="" policy=/usr/sbin/policy-rc.d created=0 rc=0
  shift
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "$who: need root (or sudo) to apt-get install $*" >&2; return 1; }
    sudo="sudo"
  fi
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
    $sudo chmod +x "$policy"
    created=1
  fi
  echo "$who: apt-get install $*" >&2
  export DEBIAN_FRONTEND=noninteractive
  { $sudo apt-get update -qq && $sudo apt-get install -y -qq --no-install-recommends "$@"; } >&2 || rc=$?
  [ "$created" = 1 ] && $sudo rm -f "$policy"
  return "$rc"
}
