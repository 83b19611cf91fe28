#!/usr/bin/env bash
# shellcheck disable=SC2016  # in the mmdebstrap hooks, $1 is the root: for the hook's shell
# The OCI image of cri-shim (the controller's; the shim's too, wherever it runs from an image), built
# on this machine from Debian packages and the commit's wheel, no base image pulled from a
# registry: docs/install.md.
#
#   bash scripts/build-image.sh [--out DIR]     (as root, on Debian 12; DIR defaults to dist/)
#
# 1. The venv at /opt/cri-shim (packaging/common.sh): the commit's wheel and the wheels of
#    packaging/requirements.lock, installed offline.
# 2. A root filesystem from Debian 12's packages by mmdebstrap: the essential set, python3,
#    ca-certificates and the libraries the venv's compiled modules link against
#    (dpkg-shlibdeps); no apt, no man pages, docs or locales (dpkg path-exclude), no apt lists,
#    caches or logs; user nonroot (65532:65532).
# 3. One layer and its config by umoci: user 65532:65532, entrypoint /opt/cri-shim/bin/cri-shim,
#    PATH with /opt/cri-shim/bin first (so `python3 -m shim` is the venv's too).
#
# Writes DIR/image (an OCI layout, tag = the project's version) and DIR/cri-shim-VERSION-image.tar
# (the same layout as one tarball: `ctr images import`, `podman load`, `skopeo copy oci-archive:`).
# The same commit gives the same digest: SOURCE_DATE_EPOCH is the commit's time (mmdebstrap
# clamps every file time to it), the .pyc files are hash-checked, and umoci's output is fixed by
# its input. Debian packages come from the mirror of this machine's apt sources
# (/etc/apt/sources.list.d/debian.sources; another file with CRI_SHIM_APT_SOURCES=FILE): a
# snapshot.debian.org mirror there makes the digest the same on another day too.
# Installs mmdebstrap and umoci with apt if missing; idempotent (downloads cached in
# /var/cache/cri-shim).
set -euo pipefail
# shellcheck disable=SC2034  # read by packaging/common.sh
PROG=build-image
# shellcheck source=packaging/common.sh source-path=SCRIPTDIR/..
. "$(dirname "$0")/../packaging/common.sh"
START=$SECONDS

pkg_out_dir "$@"  # sets OUT (--out DIR, default dist/); --help

need_apt "mmdebstrap:mmdebstrap" "umoci:umoci"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/cri-shim-image.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
pkg_init "$WORK"
pkg_wheels "$WORK"
pkg_venv "$WORK/stage"
log "venv ready ($((SECONDS - START)) s)"
libs=$(shlib_depends "$WORK/stage" | sed 's/ *([^)]*)//g; s/ //g')

# The apt sources: the Debian mirror this machine uses.
sources=${CRI_SHIM_APT_SOURCES:-}
if [ -z "$sources" ]; then
  for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
    if [ -s "$f" ] && grep -qE '^[^#]*(deb|URIs:)' "$f"; then sources=$f; break; fi
  done
fi
mirrors=()
[ -n "$sources" ] && mirrors=("$sources")  # none: mmdebstrap's default, deb.debian.org
ARCH=$(dpkg --print-architecture)
DEBS=$CACHE/debs-bookworm-$ARCH  # the .debs, kept between builds (the same files either way)
mkdir -p "$DEBS"

# Each hook is run by mmdebstrap with the root as $1. After the .debs are saved for the next
# build: the build host's resolv.conf and hostname (mmdebstrap copies them in), info's generated
# index, and apt's working directories (no apt in the image).
user_hook='printf "nonroot:x:65532:65532:nonroot:/home/nonroot:/usr/sbin/nologin\n" >>"$1/etc/passwd"
printf "nonroot:x:65532:\n" >>"$1/etc/group"
install -d -m 0755 -o 65532 -g 65532 "$1/home/nonroot"'
log "mmdebstrap bookworm (essential, python3, ca-certificates, $libs) from ${sources:-deb.debian.org}"
mmdebstrap --variant=essential --mode=root --format=tar \
  --include="python3,ca-certificates,$libs" \
  --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-include=/usr/share/locale/locale.alias' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/lintian/*' \
  --skip=essential/unlink \
  --setup-hook='mkdir -p "$1/var/cache/apt/archives"' \
  --setup-hook="sync-in $DEBS /var/cache/apt/archives/" \
  --customize-hook="sync-out /var/cache/apt/archives $DEBS" \
  --customize-hook="copy-in $WORK/stage$PREFIX /opt" \
  --customize-hook="$user_hook" \
  --customize-hook='rm -f "$1/etc/resolv.conf" "$1/etc/hostname" "$1/usr/share/info/dir"' \
  --customize-hook='rm -rf "$1/var/lib/apt" "$1/var/cache/apt" "$1/var/log/apt" "$1"/var/cache/debconf/*-old' \
  --skip=cleanup/apt \
  bookworm "$WORK/rootfs.tar" "${mirrors[@]}" >"$WORK/mmdebstrap.log" 2>&1 \
  || { tail -40 "$WORK/mmdebstrap.log" >&2; die "mmdebstrap failed"; }
# Device nodes are the runtime's to make.
mmtarfilter --path-exclude='/dev/*' <"$WORK/rootfs.tar" >"$WORK/layer.tar"
rm "$WORK/rootfs.tar"
log "root file system ready ($((SECONDS - START)) s)"

CREATED=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
LAYOUT=$OUT/image
IMAGE=$LAYOUT:$VERSION
rm -rf "$LAYOUT"
umoci init --layout "$LAYOUT"
umoci new --image "$IMAGE"
umoci raw add-layer --image "$IMAGE" --history.created "$CREATED" \
  --history.created_by "scripts/build-image.sh: mmdebstrap bookworm (essential, python3, ca-certificates), $PREFIX" \
  "$WORK/layer.tar"
umoci config --image "$IMAGE" --no-history --created "$CREATED" \
  --config.user 65532:65532 \
  --config.entrypoint "$PREFIX/bin/cri-shim" --config.cmd --help \
  --config.env "PATH=$PREFIX/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
  --config.env PYTHONUNBUFFERED=1 \
  --config.workingdir / \
  --config.label org.opencontainers.image.title=cri-shim \
  --config.label "org.opencontainers.image.version=$VERSION" \
  --config.label "org.opencontainers.image.revision=$COMMIT" \
  --config.label "org.opencontainers.image.created=$CREATED"
umoci gc --layout "$LAYOUT"
chmod -R a+rX "$LAYOUT"
ARCHIVE=$OUT/cri-shim-$VERSION-image.tar
tar --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner \
  -C "$LAYOUT" -cf "$ARCHIVE.tmp" .
mv "$ARCHIVE.tmp" "$ARCHIVE"

digest=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["manifests"][0]["digest"])' \
         "$LAYOUT/index.json")
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
log "built cri-shim $VERSION (commit ${COMMIT:0:12}) in $((SECONDS - START)) s"
log "  $LAYOUT (tag $VERSION)"
log "  $ARCHIVE: $(mib "$(stat -c %s "$ARCHIVE")") compressed, $(mib "$(stat -c %s "$WORK/layer.tar")") uncompressed"
echo "$digest"
