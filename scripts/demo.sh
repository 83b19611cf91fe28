#!/usr/bin/env bash
# The pull-storm demo: a local registry behind a counting, throttled proxy, a throw-away
# containerd, and the shim. 24 pods pull 3 images (8 MiB each) at once, first straight
# from containerd, then through the shim (pulls.max_parallel: 2), each time on a fresh
# containerd; prints what the registry saw and how long the pods waited, and what
# `cri-shim status --watch` showed during the shim's storm (pull progress bars).
# Extra arguments go to bench/pull_storm.py (python -m bench.pull_storm --help), e.g. --credential-groups 2.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --base   # containerd, docker-registry, skopeo, crictl, the package
echo "pull storm: 24 pods, 3 images of 8 MiB, registry link 6 MiB/s, shim max_parallel 2" >&2
exec "${PYTHON:-python3}" -m bench.pull_storm --pods 24 --images 3 --image-mib 8 --link-mibps 6 \
  --max-parallel 2 --status-watch 1 --explain "$@"
