#!/usr/bin/env bash
# containerd 2.x for the runtime-handler e2e tests (1.6 ignores ImageSpec.runtime_handler).
set -euo pipefail
export PATH="$PATH:/usr/local/go/bin"
if [ ! -x /opt/containerd2/bin/containerd ]; then
  echo "setup: go install containerd v2.4.2 (a few minutes)"
  GOBIN=/opt/containerd2/bin go install -tags "no_btrfs no_devmapper no_zfs" \
    github.com/containerd/containerd/v2/cmd/containerd@v2.4.2
fi
