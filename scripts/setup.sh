#!/usr/bin/env bash
# Install what cri-shim's demo and tests need on a fresh Debian 12 machine (idempotent).
# Debian: containerd, docker-registry, skopeo, systemd (systemd-analyze), stress-ng; Python: the
# package with its test extras; Go: crictl v1.37.0. Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v containerd >/dev/null || need_apt+=(containerd)
command -v docker-registry >/dev/null || need_apt+=(docker-registry)
command -v skopeo >/dev/null || need_apt+=(skopeo)
command -v systemd-analyze >/dev/null || need_apt+=(systemd)
command -v go >/dev/null || [ -x /usr/local/go/bin/go ] || need_apt+=(golang-go)
# scripts/test.sh --under-load (CI); the demo (--base) does not need it
[ "${1:-}" = "--base" ] || command -v stress-ng >/dev/null || need_apt+=(stress-ng)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if ! "$PY" -c 'import shim, grpc, pytest, pytest_timeout, hypothesis, bcrypt, hpack, mypy, ruff, importlinter' 2>/dev/null \
   || ! "$PY" -c 'import importlib.metadata as m; m.version("cri-shim")' 2>/dev/null; then
  echo "setup: pip install -e .[test]"
  "$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore -e '.[test]'
fi

export PATH="$PATH:/usr/local/go/bin:$HOME/go/bin"
if ! command -v crictl >/dev/null; then
  echo "setup: go install crictl v1.37.0"
  GOBIN=/usr/local/bin go install sigs.k8s.io/cri-tools/cmd/crictl@v1.37.0
fi
# One file per extra component (containerd 2.x, kubelet, CRI-O, ...), each idempotent and
# caching its build by version, run in name order. `--base` (the demo) skips them.
if [ "${1:-}" != "--base" ]; then
  for step in scripts/setup.d/*.sh; do
    bash "$step"
  done
fi
