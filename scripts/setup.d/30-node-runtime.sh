#!/usr/bin/env bash
# Running containers for the node suite (tests/node): Debian's runc, CNI plugins, a static
# busybox (the test image) and gcc (a static pause binary); containerd 2.x needs a 2.x
# containerd-shim-runc-v2 next to it (Debian's 1.6 shim fails with "type with url ... not found").
set -euo pipefail
export PATH="$PATH:/usr/local/go/bin"
need_apt=()
command -v runc >/dev/null || [ -x /usr/sbin/runc ] || need_apt+=(runc)
[ -x /usr/lib/cni/bridge ] || need_apt+=(containernetworking-plugins)
dpkg -s busybox-static >/dev/null 2>&1 || need_apt+=(busybox-static)
command -v gcc >/dev/null || need_apt+=(gcc)
[ -e /usr/lib/x86_64-linux-gnu/libc.a ] || [ -e /usr/lib/aarch64-linux-gnu/libc.a ] || need_apt+=(libc6-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
SHIM_VERSION=${CONTAINERD2_SHIM_VERSION:-v2.4.2}
CACHE=/var/cache/cri-shim/containerd-shim-runc-v2-$SHIM_VERSION
if [ ! -x "$CACHE/containerd-shim-runc-v2" ]; then
  echo "setup: go install containerd-shim-runc-v2 $SHIM_VERSION (about 1 min)"
  mkdir -p "$CACHE"
  GOBIN="$CACHE" nice -n 10 go install "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$SHIM_VERSION"
fi
mkdir -p /opt/containerd2/bin
ln -sf "$CACHE/containerd-shim-runc-v2" /opt/containerd2/bin/containerd-shim-runc-v2
