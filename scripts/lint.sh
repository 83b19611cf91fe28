#!/usr/bin/env bash
# Static checks, run by .ci/run before the tests: ruff, mypy --strict, the import contracts
# (import-linter, [tool.importlinter] in pyproject.toml) and scripts/check_imports.py (no
# import cycles, TYPE_CHECKING ones included; no private name from another package; no
# grpc.aio in the relay). Every check runs; the exit status is non-zero when
# any failed. The tools are the versions pinned in pyproject.toml's test extras: missing or
# other versions are installed first (scripts/setup.sh installs them with `.[test]` too).
# mypy checks against the installed dependencies: on a fresh machine run scripts/setup.sh first.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# The `name==version` pins of the test extras that this Python lacks.
missing=$("$PY" - <<'EOF'
import importlib.metadata as md
import re
import tomllib

with open("pyproject.toml", "rb") as f:
    test = tomllib.load(f)["project"]["optional-dependencies"]["test"]
for req in test:
    m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)==([^;\s]+)\s*", req)
    if m is None:
        continue
    try:
        ok = md.version(m[1]) == m[2]
    except md.PackageNotFoundError:
        ok = False
    if not ok:
        print(req)
EOF
) || { echo "lint: cannot read the pins in pyproject.toml" >&2; exit 1; }
if [ -n "$missing" ]; then
  echo "lint: pip install" $missing
  # shellcheck disable=SC2086  # one argument per pin
  "$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore $missing || exit 1
fi

failed=()
step() {  # step NAME COMMAND...: run it, time it, remember a failure
  local name=$1 start=$SECONDS
  shift
  echo "lint: $name"
  if "$@"; then
    echo "lint: $name ok ($((SECONDS - start)) s)"
  else
    echo "lint: $name FAILED ($((SECONDS - start)) s)" >&2
    failed+=("$name")
  fi
}

step "ruff" "$PY" -m ruff check shim tests bench scripts
step "mypy" "$PY" -m mypy
step "import contracts" "$PY" -c 'import sys; from importlinter.cli import lint_imports_command
sys.argv = ["lint-imports", "--no-logo"]; lint_imports_command()'
step "import cycles, private names" "$PY" scripts/check_imports.py

if [ ${#failed[@]} -gt 0 ]; then
  echo "lint: failed: ${failed[*]}" >&2
  exit 1
fi
echo "lint: all checks passed"
