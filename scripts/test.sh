#!/usr/bin/env bash
# Run every test: unit, end-to-end against real containerd + registry + crictl, and a
# short soak. Installs what is missing first (scripts/setup.sh). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PATH:/usr/local/go/bin:$HOME/go/bin"
export CRI_SHIM_SOAK_SECONDS="${CRI_SHIM_SOAK_SECONDS:-60}"
exec "${PYTHON:-python3}" -m pytest -q -ra "$@"
