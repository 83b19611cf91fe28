#!/usr/bin/env bash
# Run every test: unit, end-to-end against real containerd + registry + crictl, and a
# short soak. Installs what is missing first (scripts/setup.sh). Extra args go to pytest.
#
#   bash scripts/test.sh --under-load [pytest args]
#     the same, with every core kept busy meanwhile by a CPU hog at normal priority
#     (stress-ng --cpu NCORES, from setup.sh), as on a busy node; the hog is stopped when
#     pytest ends, whatever happens (and ends by itself after CRI_SHIM_HOG_SECONDS, 3600).
#     CI (.ci/run) reruns the process and e2e suites this way: docs/testing.md.
set -euo pipefail
cd "$(dirname "$0")/.."
under_load=false
if [ "${1:-}" = "--under-load" ]; then
  under_load=true
  shift
fi
bash scripts/setup.sh
export PATH="$PATH:/usr/local/go/bin:$HOME/go/bin"
export CRI_SHIM_SOAK_SECONDS="${CRI_SHIM_SOAK_SECONDS:-60}"
pytest=("${PYTHON:-python3}" -m pytest -q -ra --durations=25 "$@")
if ! $under_load; then
  exec "${pytest[@]}"
fi

cores=$(nproc)
stress-ng --cpu "$cores" --timeout "${CRI_SHIM_HOG_SECONDS:-3600}s" --quiet &
hog=$!
trap 'kill "$hog" 2>/dev/null || true; wait "$hog" 2>/dev/null || true' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
echo "test.sh: under load: stress-ng --cpu $cores (pid $hog) at normal priority while pytest runs" >&2
"${pytest[@]}"
