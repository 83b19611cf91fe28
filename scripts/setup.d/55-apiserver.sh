#!/usr/bin/env bash
# etcd, kube-apiserver, kube-scheduler, kube-controller-manager and kubectl for the cluster suite
# (tests/cluster, bench/cluster_fleet.py), built from the Go module proxy and cached by version
# (envtest's binary download is not reachable here).
# - etcd: a wrapper module requiring go.etcd.io/etcd/server/v3 (its go.mod has ../ replaces, so
#   `go install ...@v` is refused; in a wrapper, dependencies' replaces are ignored). About 2 min.
# - kube-apiserver, kube-scheduler, kube-controller-manager, kubectl: a wrapper module requiring
#   k8s.io/kubernetes with every k8s.io/* staging module replaced by its published release v0.N.M;
#   one `go build` of the missing commands (they share the compile cache). kube-apiserver alone
#   about 9 min and 2 GB peak on 2 cores; the other three add a few minutes once it is built
#   (kubectl: the cluster suite applies deploy/cluster/ with the version it tests).
#   Each is cached by version in its own directory (a cache holding only kube-apiserver gains the
#   others on the next run).
set -euo pipefail
export PATH="$PATH:/usr/local/go/bin"
K8S_VERSION=${K8S_VERSION:-v1.35.0}
ETCD_VERSION=${ETCD_VERSION:-v3.6.17}
STAGING_VERSION="v0${K8S_VERSION#v1}"
ETCD_CACHE=/var/cache/cri-shim/etcd-$ETCD_VERSION
KUBE_CMDS=(kube-apiserver kube-scheduler kube-controller-manager kubectl)
missing=()
for c in "${KUBE_CMDS[@]}"; do
  [ -x "/var/cache/cri-shim/$c-$K8S_VERSION/$c" ] || missing+=("$c")
done
[ -x "$ETCD_CACHE/etcd" ] && [ ${#missing[@]} -eq 0 ] && exit 0
work=$(mktemp -d /var/tmp/apiserver-build.XXXXXX)
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
export CGO_ENABLED=0 GOFLAGS=-mod=mod

if [ ! -x "$ETCD_CACHE/etcd" ]; then
  echo "setup: build etcd $ETCD_VERSION from the Go module proxy (about 2 min)"
  mkdir -p "$work/etcd" "$ETCD_CACHE"
  cd "$work/etcd"
  cat > go.mod <<MOD
module cri-shim.local/etcd-build

go 1.24

require go.etcd.io/etcd/server/v3 $ETCD_VERSION
MOD
  cat > tools.go <<'GO'
//go:build tools

package tools

import _ "go.etcd.io/etcd/server/v3"
GO
  go mod tidy >/dev/null 2>&1 || true
  go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
  nice -n 10 go build -o "$work/etcd/etcd" -ldflags "-s -w" go.etcd.io/etcd/server/v3
  install -m 0755 "$work/etcd/etcd" "$ETCD_CACHE/etcd.tmp"
  mv "$ETCD_CACHE/etcd.tmp" "$ETCD_CACHE/etcd"
  echo "setup: etcd at $ETCD_CACHE/etcd"
fi

if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: build ${missing[*]} $K8S_VERSION from the Go module proxy (kube-apiserver about 9 min)"
  mkdir -p "$work/api/bin"
  cd "$work/api"
  # k8s.io/kubernetes' own go.mod lists every staging module; each becomes a replace to the release.
  gomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
          | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  python3 - "$gomod" "$K8S_VERSION" "$STAGING_VERSION" > go.mod <<'PY'
import re, sys
gomod, k8s, staging = sys.argv[1:]
mods = sorted(set(re.findall(r"(k8s\.io/[\w.-]+) => \./staging/src/k8s\.io/[\w.-]+", open(gomod).read())))
print("module cri-shim.local/apiserver-build\n\ngo 1.25\n")
print(f"require k8s.io/kubernetes {k8s}\n")
print("replace (")
for m in mods:
    print(f"\t{m} => {m} {staging}")
print(")")
PY
  { printf '//go:build tools\n\npackage tools\n\nimport (\n'
    for c in "${KUBE_CMDS[@]}"; do printf '\t_ "k8s.io/kubernetes/cmd/%s"\n' "$c"; done
    printf ')\n'; } > tools.go
  go mod tidy
  minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  v=k8s.io/component-base/version
  pkgs=()
  for c in "${missing[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$c"); done
  nice -n 10 go build -o "$work/api/bin/" \
    -ldflags "-s -w -X $v.gitVersion=$K8S_VERSION -X $v.gitMajor=1 -X $v.gitMinor=$minor -X $v.gitTreeState=clean" \
    "${pkgs[@]}"
  for c in "${missing[@]}"; do
    dest=/var/cache/cri-shim/$c-$K8S_VERSION
    mkdir -p "$dest"
    install -m 0755 "$work/api/bin/$c" "$dest/$c.tmp"
    mv "$dest/$c.tmp" "$dest/$c"
    echo "setup: $c at $dest/$c"
  done
fi
