# shellcheck shell=bash
# Shared by scripts/build-image.sh and scripts/build-deb.sh (sourced, not run). docs/install.md.
#
# Both artifacts carry the same Python environment: a venv at /opt/cri-shim made by Debian 12's
# /usr/bin/python3, holding cri-shim's wheel built from the commit (`git archive HEAD`: changes
# not committed are not in it) and the exact wheels that packaging/requirements.lock pins (sha256
# checked), installed offline. The commit's time is SOURCE_DATE_EPOCH: file times are clamped to
# it and the .pyc files are hash-checked ones instead of timestamped, so the same commit gives
# the same bytes.
#
# Needs root (a private mount namespace puts the venv at /opt/cri-shim without touching the
# host's /opt). Downloads are cached by content in $CRI_SHIM_CACHE (/var/cache/cri-shim).

set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${CRI_SHIM_CACHE:-/var/cache/cri-shim}
PROG=${PROG:-$(basename "$0")}
#: Debian 12's interpreter: the one on the nodes (the package's Depends) and in the image.
PY=/usr/bin/python3
PREFIX=/opt/cri-shim

log() { echo "$PROG: $*" >&2; }
die() { echo "$PROG: $*" >&2; exit 1; }

# need_apt WHAT:PACKAGE...: apt-get install each PACKAGE whose WHAT (a command, or an absolute
# path) is missing.
# The one argument both build scripts take: OUT, the directory the artifact goes to (made, absolute).
pkg_out_dir() {
  OUT=$REPO/dist
  while [ $# -gt 0 ]; do
    case $1 in
      --out) OUT=$2; shift 2 ;;
      --out=*) OUT=${1#--out=}; shift ;;
      -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '/^# shellcheck/d; $d; s/^# \{0,1\}//'; exit 0 ;;
      *) die "unknown argument $1 (--out DIR)" ;;
    esac
  done
  mkdir -p "$OUT"
  OUT=$(cd "$OUT" && pwd)
}

need_apt() {
  local item what need=()
  for item; do
    what=${item%%:*}
    if [[ $what == /* ]]; then compgen -G "$what" >/dev/null || need+=("${item#*:}")
    else command -v "$what" >/dev/null || need+=("${item#*:}"); fi
  done
  [ ${#need[@]} -eq 0 ] && return 0
  log "apt-get install ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends "${need[@]}" >/dev/null
}

# pkg_init WORK: the commit, its time, the source tree of the commit in WORK/src, its version,
# and the pip the builds run (Debian's python3-pip-whl, run from the wheel under $PY).
pkg_init() {
  local work=$1
  [ "$(id -u)" = 0 ] || die "run me as root (a private mount namespace for /opt/cri-shim)"
  need_apt "$PY:python3" "/usr/share/python-wheels/pip-*.whl:python3-pip-whl" \
           "git:git" "unshare:util-linux"
  "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || die "$PY is not Python 3.11: build on Debian 12 (bookworm), the nodes' and the image's release"
  case "$work/" in "$PREFIX"/*|/opt/*) die "work directory $work must not be under /opt" ;; esac
  COMMIT=$(git -C "$REPO" rev-parse HEAD)
  export SOURCE_DATE_EPOCH
  SOURCE_DATE_EPOCH=$(git -C "$REPO" log -1 --format=%ct HEAD)
  if [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no)" ]; then
    log "building commit ${COMMIT:0:12}: changes not committed are not in it"
  fi
  mkdir -p "$work/src"
  git -C "$REPO" archive HEAD | tar -x -C "$work/src"
  VERSION=$("$PY" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
            "$work/src/pyproject.toml")
  PIP_WHL=$(compgen -G "/usr/share/python-wheels/pip-*.whl" | sort -V | tail -1)
  # Deterministic .pyc (hash-based, since SOURCE_DATE_EPOCH is set) and hashing.
  export PYTHONHASHSEED=0 PYTHONDONTWRITEBYTECODE=1
}

pip_() { "$PY" "$PIP_WHL/pip" --disable-pip-version-check "$@"; }

# pkg_wheels WORK: WHEELS (the locked wheels, downloaded once per lock content and checked
# against its sha256) and WORK/dist/cri_shim-VERSION-py3-none-any.whl, built offline from WORK/src.
pkg_wheels() {
  local work=$1 key tmp
  DIST=$work/dist
  key=$(cat "$REPO/packaging/requirements.lock" "$REPO/packaging/build-requirements.lock" | sha256sum | cut -c1-16)
  WHEELS=$CACHE/wheels-$key
  if [ ! -e "$WHEELS/complete" ]; then
    log "pip download the wheels of packaging/requirements.lock into $WHEELS"
    mkdir -p "$CACHE"
    tmp=$(mktemp -d "$CACHE/.wheels-$key.XXXXXX")
    pip_ download -q --no-deps --only-binary=:all: --no-cache-dir --require-hashes -d "$tmp" \
      -r "$REPO/packaging/requirements.lock" -r "$REPO/packaging/build-requirements.lock" \
      || { rm -rf "$tmp"; die "pip download failed"; }
    touch "$tmp/complete"
    rm -rf "$WHEELS"
    mv "$tmp" "$WHEELS"
  fi
  # pyproject.toml's build-system from the same directory: build-requirements.lock's setuptools.
  pip_ --isolated wheel -q --no-deps --no-index --find-links "$WHEELS" --no-cache-dir \
    -w "$work/dist" "$work/src" >/dev/null
  compgen -G "$work/dist/cri_shim-$VERSION-*.whl" >/dev/null || die "no cri-shim $VERSION wheel in $work/dist"
}

# pkg_venv STAGE (after pkg_wheels): the venv at STAGE/opt/cri-shim, made and filled at /opt/cri-shim in a private
# mount namespace (its paths are the ones it will have on the node and in the image).
pkg_venv() {
  local stage=$1 pins
  pins=$(sed -n 's/^\([A-Za-z0-9_.-]*==[^ ]*\).*/\1/p' "$REPO/packaging/requirements.lock")
  rm -rf "${stage:?}$PREFIX"
  mkdir -p "$stage$PREFIX"
  # shellcheck disable=SC2086,SC2016  # $pins: one argument per pin; $1.. are the inner shell's
  unshare --mount --propagation private bash -euc '
    prefix=$1 stage=$2 py=$3 pip=$4 wheels=$5 dist=$6
    shift 6
    mount -t tmpfs -o mode=0755 cri-shim-build /opt
    mkdir -p "$prefix"
    mount --bind "$stage" "$prefix"
    "$py" -m venv --without-pip "$prefix"
    # --no-deps: exactly the lock, nothing resolved; `pip check` then proves it complete.
    "$prefix/bin/python" "$pip/pip" --isolated --disable-pip-version-check install -q --no-index --no-deps \
      --no-cache-dir --no-warn-script-location --find-links "$wheels" --find-links "$dist" "$@"
    "$prefix/bin/python" "$pip/pip" --isolated --disable-pip-version-check check >/dev/null
    "$prefix/bin/cri-shim" --help >/dev/null
  ' _ "$PREFIX" "$stage$PREFIX" "$PY" "$PIP_WHL" "$WHEELS" "$DIST" $pins "cri-shim==$VERSION"
  # Activate.ps1 (PowerShell) has no use here; the shell ones are kept for operators.
  rm -f "$stage$PREFIX/bin/Activate.ps1"
}

# shlib_depends STAGE: the Debian packages (with versions) the venv's compiled modules link
# against, as dpkg-shlibdeps finds them ("libc6 (>= 2.34), libstdc++6 (>= 4.8), ...").
shlib_depends() {
  local stage=$1 tmp out
  need_apt "dpkg-shlibdeps:dpkg-dev"
  tmp=$(mktemp -d)
  mkdir "$tmp/debian"
  printf 'Source: cri-shim\n\nPackage: cri-shim\nArchitecture: any\n' >"$tmp/debian/control"
  out=$(cd "$tmp" && find "$stage$PREFIX" -name '*.so' -type f -print0 | sort -z \
        | xargs -0 dpkg-shlibdeps -O 2>"$tmp/log") || { cat "$tmp/log" >&2; rm -rf "$tmp"; return 1; }
  rm -rf "$tmp"
  echo "${out#shlibs:Depends=}"
}
