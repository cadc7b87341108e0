#!/usr/bin/env bash
# Make sure the Debian packages that real nodes and image builds need are installed:
# containerd + runc + CNI plugins (the nodes' runtime), buildah + podman (image builds without a
# Docker engine), debootstrap (the base image), iptables (keeps pod traffic between our bridges),
# docker-registry (the loopback OCI registry the nodes pull our images from: hack/registry.sh).
# Idempotent: does nothing when every tool is present. Package services are kept from starting
# (policy-rc.d): each real node runs its own containerd with its own socket.
set -euo pipefail

need=()
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/usr/bin/$1" ]; }
have containerd || need+=(containerd)
have runc || need+=(runc)
[ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] && [ -x /usr/lib/cni/loopback ] \
  || need+=(containernetworking-plugins)
have buildah || need+=(buildah)
have podman || need+=(podman)
have debootstrap || need+=(debootstrap)
have docker-registry || need+=(docker-registry)
have iptables || need+=(iptables)
have ip || need+=(iproute2)
have gcc || need+=(gcc libc6-dev)
[ "${#need[@]}" = 0 ] && exit 0

# shellcheck source=apt-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/apt-lib.sh"
apt_install ensure-node-packages "${need[@]}"
