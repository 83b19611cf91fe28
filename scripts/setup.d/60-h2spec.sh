#!/usr/bin/env bash
# h2spec (HTTP/2 conformance suite) with gRPC request headers, and socat, for tests/e2e/test_h2spec.py
# (socat is also the plain-relay column of bench/passthrough.py).
#
# The Go module proxy serves github.com/summerwind/h2spec only as v1.5.0 and v2.2.1+incompatible
# (no go.mod). We build v2.2.1 with a go.mod that pins every dependency, so the build is the same on
# every machine and works with current Go (checked with Go 1.26).
# h2spec has a --path option but none for request headers: its requests are `GET` with no
# content-type, which a gRPC server refuses before any HTTP/2 behaviour is exercised. So the build
# edits the two lines of spec/util.go that make the common request headers: `:method POST`, plus
# `content-type: application/grpc` and `te: trailers`. The binary is installed as `h2spec-grpc`.
# Cached by version under /var/cache/cri-shim/h2spec-<version>/ (about 30 s to build once).
set -euo pipefail
export PATH="$PATH:/usr/local/go/bin"

if ! command -v socat >/dev/null; then
  echo "setup: apt-get install socat"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq socat >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq socat >/dev/null; }
fi

H2SPEC_VERSION=v2.2.1+incompatible
PATCH_LEVEL=grpc1   # bump when the edit below changes
CACHE=/var/cache/cri-shim/h2spec-${H2SPEC_VERSION%+incompatible}-${PATCH_LEVEL}
BIN=$CACHE/h2spec-grpc

if [ ! -x "$BIN" ]; then
  echo "setup: build h2spec $H2SPEC_VERSION with gRPC request headers (about 30 s)"
  mkdir -p "$CACHE"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  cd "$work"
  dir=$(GOFLAGS=-mod=mod go mod download -json "github.com/summerwind/h2spec@$H2SPEC_VERSION" \
        | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
  [ -n "$dir" ] && [ -d "$dir" ] || { echo "setup: h2spec module download failed" >&2; exit 1; }
  cp -r "$dir" src
  chmod -R u+w src
  cd src
  cat > go.mod <<'EOF'
module github.com/summerwind/h2spec

go 1.18

require (
	github.com/fatih/color v0.0.0-20161025120501-bf82308e8c85
	github.com/spf13/cobra v0.0.0-20170118185516-dc208f4211e7
	golang.org/x/net v0.0.0-20161104230106-55a3084c9119
	github.com/inconshreveable/mousetrap v1.1.0
	github.com/mattn/go-colorable v0.1.16
	github.com/mattn/go-isatty v0.0.24
	github.com/spf13/pflag v1.1.0
	golang.org/x/sys v0.29.0
)
EOF
  util=spec/util.go
  grep -q 'HeaderField(":method", "GET"),' "$util" && grep -q 'HeaderField(":authority", authority),' "$util" \
    || { echo "setup: h2spec $util is not the expected version" >&2; exit 1; }
  sed -i -e 's|HeaderField(":method", "GET"),|HeaderField(":method", "POST"),|' \
         -e 's|HeaderField(":authority", authority),|&\n\t\tHeaderField("content-type", "application/grpc"),\n\t\tHeaderField("te", "trailers"),|' \
         "$util"
  GOFLAGS=-mod=mod CGO_ENABLED=0 nice go build -trimpath -o "$BIN.tmp" ./cmd/h2spec
  mv "$BIN.tmp" "$BIN"
fi
ln -sf "$BIN" /usr/local/bin/h2spec-grpc
