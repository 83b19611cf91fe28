#!/usr/bin/env bash
# A Debian 12 root for the systemd tests (tests/node/test_systemd.py): booted with
# `systemd-nspawn -b`, systemd 252 is PID 1; Debian's containerd is its containerd.service;
# cri-shim is installed the README's way (venv in /opt/cri-shim, /usr/local/bin/cri-shim).
# Built once (about 1-2 min) into /var/cache/cri-shim/nspawn-bookworm-<v>/root; the tests
# never write to it (they boot it with --volatile=overlay) and reinstall the checkout
# under test into the overlay.
set -euo pipefail
cd "$(dirname "$0")/../.."
export DEBIAN_FRONTEND=noninteractive

need=()
command -v systemd-nspawn >/dev/null || need+=(systemd-container)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need[*]}"
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi

# Bump when the package list or the steps below change.
V=v1
CACHE=/var/cache/cri-shim/nspawn-bookworm-$V
[ -e "$CACHE/complete" ] && exit 0

echo "setup: debootstrap a bookworm root for the systemd tests into $CACHE (1-2 min)"
mkdir -p /var/cache/cri-shim
tmp=$(mktemp -d /var/cache/cri-shim/.nspawn-bookworm-$V.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
nice debootstrap --variant=minbase \
  --include=systemd,systemd-sysv,dbus,procps,python3,python3-venv,containerd \
  bookworm "$tmp/root" "$mirror" >"$tmp/debootstrap.log" 2>&1 \
  || { tail -30 "$tmp/debootstrap.log" >&2; exit 1; }
root=$tmp/root
# pip inside trusts what the host trusts (the tests bind the host's bundle over this).
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  install -D -m 0644 /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$root/etc/pip.conf"
fi
# No getty/login/network units to wait for: the tests only need systemd and containerd.
rm -f "$root/etc/machine-id"
systemd-machine-id-setup --root="$root" >/dev/null
for u in getty@tty1.service systemd-networkd.service systemd-resolved.service \
         systemd-timesyncd.service apt-daily.timer apt-daily-upgrade.timer dpkg-db-backup.timer \
         e2scrub_all.timer fstrim.timer; do
  systemctl --root="$root" disable "$u" >/dev/null 2>&1 || true
done
# Debian enables containerd.service; the tests start it (cri-shim's Wants= does).
systemctl --root="$root" disable containerd.service >/dev/null 2>&1 || true
# containerd inside the container: the root is an overlay at test time, so the CRI plugin
# unpacks with the native snapshotter; the container may not lower oom_score_adj.
cat >"$root/etc/containerd/config.toml" <<'EOF'
version = 2
[plugins."io.containerd.grpc.v1.cri"]
  restrict_oom_score_adj = true
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "/etc/containerd/certs.d"
EOF

# The package, as docs/install.md "A node, by hand" says: a venv of its own, the entry point in
# /usr/local/bin. Done here once so its dependencies are cached in the root; the tests
# reinstall the checkout under test with the same pip command.
mkdir -p "$root/src/cri-shim"
# No systemd on the host to register with: --register=no --keep-unit. A machine name of
# our own, so concurrent runs don't share nspawn's per-machine state.
nspawn=(systemd-nspawn -q -D "$root" --register=no --keep-unit --machine="cri-shim-setup-$$"
        --resolv-conf=copy-host --overlay="$PWD::/src/cri-shim")
# (Without a host systemd, nspawn says "Attempted to remove disk file system under
# /run/systemd/nspawn/propagate/..." on exit; it removes that directory all the same.)
in_root() { "${nspawn[@]}" "$@" 2> >(grep -v 'Attempted to remove disk file system' >&2); }
in_root /usr/bin/python3 -m venv /opt/cri-shim
in_root /opt/cri-shim/bin/pip install -q /src/cri-shim
in_root /bin/ln -sf /opt/cri-shim/bin/cri-shim /usr/local/bin/cri-shim
in_root /usr/local/bin/cri-shim --help >/dev/null

rm -rf "$CACHE"
mv "$tmp" "$CACHE"
trap - EXIT
touch "$CACHE/complete"
echo "setup: nspawn root ready: $CACHE/root ($(du -sh "$CACHE/root" | cut -f1))"
