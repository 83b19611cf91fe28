#!/usr/bin/env bash
# CRI-O v1.34.0 for the `crio` e2e suite (pytest -m crio). Debian 12 has no cri-o package, so
# this builds crio (pure Go, no cgo libraries) and pinns (C, Debian's gcc) from the source the
# Go module proxy serves, and installs Debian's conmon. The build is cached by version under
# /var/cache/cri-shim/crio-v1.34.0/{crio,pinns}: about 2 minutes on 2 cores the first time,
# nothing afterwards.
set -euo pipefail
export PATH="$PATH:/usr/local/go/bin"
VERSION=v1.34.0
DEST=/var/cache/cri-shim/crio-$VERSION

need_apt=()
command -v conmon >/dev/null || need_apt+=(conmon)
command -v runc >/dev/null || need_apt+=(runc)
command -v gcc >/dev/null || need_apt+=(gcc libc6-dev)
command -v make >/dev/null || need_apt+=(make)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ -x "$DEST/crio" ] && [ -x "$DEST/pinns" ]; then
  exit 0
fi

echo "setup: build CRI-O $VERSION from the Go module proxy (about 2 minutes)"
src=$(go mod download -json "github.com/cri-o/cri-o@$VERSION" \
      | python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')
work=$(mktemp -d)
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
# The module cache is read-only: build in a copy.
cp -r "$src" "$work/cri-o"
chmod -R u+w "$work/cri-o"
cd "$work/cri-o"
mkdir -p "$work/out"
CGO_ENABLED=0 nice -n 10 go build -trimpath \
  -tags "containers_image_openpgp exclude_graphdriver_btrfs btrfs_noversion containers_image_ostree_stub" \
  -ldflags "-s -w -X github.com/cri-o/cri-o/internal/version.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
  -o "$work/out/crio" ./cmd/crio
nice -n 10 make -s -C pinns >/dev/null
cp bin/pinns "$work/out/pinns"
"$work/out/crio" --version >/dev/null
mkdir -p "$DEST"
install -m 0755 "$work/out/crio" "$work/out/pinns" "$DEST/"
echo "setup: CRI-O $VERSION in $DEST"
