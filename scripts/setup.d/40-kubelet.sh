#!/usr/bin/env bash
# kubelet v1.35.0 for the node suite (tests/node), built from the Go module proxy and cached
# by version. `go install k8s.io/kubernetes/cmd/kubelet@...` is refused (replace directives), so:
# download the module zip, drop its go.work, point the ./staging replaces at the published
# k8s.io/*@v0.35.0 modules and build with CGO_ENABLED=0 (3.5-5 min on 2 cores from empty Go caches).
set -euo pipefail
export PATH="$PATH:/usr/local/go/bin"
K8S_VERSION=${K8S_VERSION:-v1.35.0}
STAGING_VERSION="v0${K8S_VERSION#v1}"
CACHE=/var/cache/cri-shim/kubelet-$K8S_VERSION
[ -x "$CACHE/kubelet" ] && exit 0
echo "setup: build kubelet $K8S_VERSION from the Go module proxy (about 4 min)"
mkdir -p "$CACHE"
work=$(mktemp -d /var/tmp/kubelet-build.XXXXXX)
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
dir=$(GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
      | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
cp -r "$dir" "$work/src"
chmod -R u+w "$work/src"
cd "$work/src"
rm -f go.work go.work.sum
# Every `k8s.io/x => ./staging/src/k8s.io/x` becomes `k8s.io/x => k8s.io/x v0.N.M`.
python3 - "$STAGING_VERSION" <<'PY'
import re, sys
ver = sys.argv[1]
text = open("go.mod").read()
text = re.sub(r"(k8s\.io/[\w.-]+) => \./staging/src/k8s\.io/[\w.-]+", rf"\1 => \1 {ver}", text)
open("go.mod", "w").write(text)
PY
minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
v=k8s.io/component-base/version
CGO_ENABLED=0 GOFLAGS=-mod=mod nice -n 10 go build -o "$work/kubelet" \
  -ldflags "-s -w -X $v.gitVersion=$K8S_VERSION -X $v.gitMajor=1 -X $v.gitMinor=$minor -X $v.gitTreeState=clean" \
  ./cmd/kubelet
install -m 0755 "$work/kubelet" "$CACHE/kubelet.tmp"
mv "$CACHE/kubelet.tmp" "$CACHE/kubelet"
echo "setup: kubelet at $CACHE/kubelet"
