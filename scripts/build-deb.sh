#!/usr/bin/env bash
# The node package: a .deb for Debian 12 nodes that needs neither pip nor the network on the
# node (docs/install.md).
#
#   bash scripts/build-deb.sh [--out DIR]     (as root, on Debian 12; DIR defaults to dist/)
#
# Writes DIR/cri-shim_VERSION_ARCH.deb (VERSION: pyproject.toml's). It holds:
#   /opt/cri-shim/                  its own Python environment (packaging/common.sh): a venv on
#                                   Debian 12's /usr/bin/python3 with the commit's wheel and the
#                                   exact wheels of packaging/requirements.lock
#   /usr/bin/cri-shim               -> /opt/cri-shim/bin/cri-shim
#   /lib/systemd/system/cri-shim.service            systemd/cri-shim.service as it is
#   /lib/systemd/system/cri-shim.service.d/10-deb.conf  its ExecStart= with /usr/bin/cri-shim
#                                   (the unit names /usr/local/bin/cri-shim, where the README's
#                                   manual install puts it; a package has no files in /usr/local)
#   /usr/share/cri-shim/            config.example.yaml, kubelet-image-only.yaml,
#                                   kubelet-full.yaml, kubelet.service.d/10-cri-shim.conf
# Depends: python3 (>= 3.11), python3 (<< 3.12) (the venv is Python 3.11's) and the libraries
# the compiled modules link against (dpkg-shlibdeps). Its maintainer scripts never enable or
# start the shim (`cri-shim node install` does); an upgrade restarts a running shim; removal is
# refused while the shim runs. Reproducible: dpkg-deb clamps file times to SOURCE_DATE_EPOCH
# (the commit's time), root owns every file. xz -3: a quarter of -6's time for 11 % more bytes.
set -euo pipefail
# shellcheck disable=SC2034  # read by packaging/common.sh
PROG=build-deb
# shellcheck source=packaging/common.sh source-path=SCRIPTDIR/..
. "$(dirname "$0")/../packaging/common.sh"
START=$SECONDS

pkg_out_dir "$@"  # sets OUT (--out DIR, default dist/); --help

need_apt "dpkg-deb:dpkg" "dpkg-shlibdeps:dpkg-dev"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/cri-shim-deb.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
pkg_init "$WORK"
pkg_wheels "$WORK"
S=$WORK/stage
pkg_venv "$S"
libs=$(shlib_depends "$S")

src=$WORK/src/systemd
install -d "$S/usr/bin" "$S/lib/systemd/system/cri-shim.service.d" "$S/usr/share/cri-shim/kubelet.service.d"
ln -s "$PREFIX/bin/cri-shim" "$S/usr/bin/cri-shim"
install -m 0644 "$src/cri-shim.service" "$S/lib/systemd/system/cri-shim.service"
exec_start=$(sed -n 's|^ExecStart=/usr/local/bin/cri-shim |ExecStart=/usr/bin/cri-shim |p' "$src/cri-shim.service")
[ -n "$exec_start" ] || die "systemd/cri-shim.service: no 'ExecStart=/usr/local/bin/cri-shim ...' line"
printf '%s\n' \
  "# The cri-shim package's entry point is /usr/bin/cri-shim (scripts/build-deb.sh); the unit's" \
  "# own ExecStart= names /usr/local/bin/cri-shim, where the README's manual install puts it." \
  "[Service]" "ExecStart=" "$exec_start" >"$S/lib/systemd/system/cri-shim.service.d/10-deb.conf"
for f in config.example.yaml kubelet-image-only.yaml kubelet-full.yaml; do
  install -m 0644 "$src/$f" "$S/usr/share/cri-shim/$f"
done
install -m 0644 "$src/kubelet.service.d/10-cri-shim.conf" "$S/usr/share/cri-shim/kubelet.service.d/"

ARCH=$(dpkg --print-architecture)
install -d "$S/DEBIAN"
for f in postinst prerm postrm; do
  install -m 0755 "$WORK/src/packaging/deb/$f" "$S/DEBIAN/$f"
done
(cd "$S" && find . -path ./DEBIAN -prune -o -type f -printf '%P\n' | LC_ALL=C sort \
   | xargs -d '\n' md5sum >DEBIAN/md5sums)
# In KiB, from file sizes (not blocks: the same on any file system).
size=$(find "$S" -path "$S/DEBIAN" -prune -o \( -type f -o -type l \) -printf '%s\n' \
       | awk '{ k += int(($1 + 1023) / 1024) } END { print k }')
summary=$("$PY" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["description"])' \
          "$WORK/src/pyproject.toml")
cat >"$S/DEBIAN/control" <<EOF
Package: cri-shim
Version: $VERSION
Architecture: $ARCH
Maintainer: cri-shim developers <cri-shim@packages.invalid>
Installed-Size: $size
Depends: python3 (>= 3.11), python3 (<< 3.12), $libs
Section: admin
Priority: optional
Description: $summary
 cri-shim is a CRI proxy between kubelet and containerd or CRI-O. This
 package carries its own Python environment in /opt/cri-shim (no pip and
 no network needed on the node). It does not enable or start the shim:
 \`cri-shim node install\` sets the node up, \`cri-shim node uninstall\`
 undoes it. The unit, the kubelet drop-in and the example config are in
 /lib/systemd/system and /usr/share/cri-shim.
EOF

DEB=$OUT/cri-shim_${VERSION}_$ARCH.deb
dpkg-deb --root-owner-group -Zxz -z3 --build "$S" "$DEB.tmp" >/dev/null
mv "$DEB.tmp" "$DEB"
log "built cri-shim $VERSION (commit ${COMMIT:0:12}) in $((SECONDS - START)) s"
log "  $DEB: $(awk -v b="$(stat -c %s "$DEB")" 'BEGIN { printf "%.1f MiB", b / 1048576 }'), $((size / 1024)) MiB installed"
sha256sum "$DEB" | cut -d' ' -f1
