#!/usr/bin/env bash
# What scripts/build-image.sh and scripts/build-deb.sh run (tests/package, docs/install.md):
# mmdebstrap and umoci for the OCI image, dpkg-dev (dpkg-shlibdeps) for the .deb, and Debian's
# pip wheel, which both builds run under Debian 12's /usr/bin/python3. The builds install them
# too when missing; here a clean machine gets them before the tests look for them.
set -euo pipefail
need=()
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v umoci >/dev/null || need+=(umoci)
command -v dpkg-shlibdeps >/dev/null || need+=(dpkg-dev)
compgen -G "/usr/share/python-wheels/pip-*.whl" >/dev/null || need+=(python3-pip-whl)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
