#!/usr/bin/env bash
# gpupool under a real systemd: boots a minimal Debian 12 with `systemd-nspawn -b`, installs
# gpupool from BUILD_DIR with `cmake --install` (DESTDIR into the container's tree) and runs
# tests/system/inside.sh there as a oneshot service: gpupoold.socket, a user in the socket's
# group and one outside it, a service restart under a live client, a configuration error
# that fails fast with its reason in `systemctl status`, and a SIGSTOPped daemon restarted
# by the watchdog.
#
#   tests/system/nspawn.sh BUILD_DIR
#
# The Debian tree (debootstrap --variant=minbase bookworm, ~250 MB, about a minute) is cached
# in $GPUPOOL_NSPAWN_CACHE (default /var/cache/gpupool-nspawn) and copied for each run, so
# the cache is never changed by a test. Mirror: $GPUPOOL_DEBIAN_MIRROR (default
# http://deb.debian.org/debian).
#
# Exit 77 (skipped) only where nspawn cannot run: not root, no systemd-nspawn/debootstrap,
# no mirror to build the tree from, or a container whose systemd never starts (the reason
# is printed).
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:?usage: nspawn.sh BUILD_DIR}" && pwd)
cache=${GPUPOOL_NSPAWN_CACHE:-/var/cache/gpupool-nspawn}
mirror=${GPUPOOL_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# Bump the suffix when the package list changes: a new tree is built next to the old one.
pkgs=systemd,systemd-sysv,dbus,libuv1,libprotobuf-c1,libucx0
tree=$cache/bookworm-minbase-2

skip() { echo "SKIP: $*"; exit 77; }
die() { echo "FAIL: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || skip "booting a container needs root"
command -v systemd-nspawn >/dev/null || skip "systemd-nspawn is not installed (package systemd-container)"
command -v debootstrap >/dev/null || skip "debootstrap is not installed"
[ -x "$build/daemon/gpupoold" ] && [ -x "$build/tests/service/svc_holder" ] && [ -x "$build/tests/service/svc_survive" ] ||
  die "$build lacks gpupoold or tests/service/svc_holder or svc_survive (build it with the tests first)"

mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
if [ ! -x "$tree/lib/systemd/systemd" ]; then
  echo "==== building the Debian 12 tree in $tree (debootstrap, once)"
  rm -rf "$tree.new"
  t0=$(date +%s)
  if ! debootstrap --variant=minbase --include="$pkgs" bookworm "$tree.new" "$mirror" >"$cache/debootstrap.log" 2>&1; then
    tail -n 15 "$cache/debootstrap.log"
    if grep -qiE "Failed getting release file|Couldn't download|Temporary failure resolving|Network is unreachable" "$cache/debootstrap.log"; then
      rm -rf "$tree.new"
      skip "cannot build the container's Debian tree: the mirror $mirror is unreachable"
    fi
    die "debootstrap failed (log: $cache/debootstrap.log)"
  fi
  mv "$tree.new" "$tree"
  echo "debootstrap took $(( $(date +%s) - t0 )) s"
fi
flock -u 9

run=$(mktemp -d /var/tmp/gpupool-nspawn-XXXXXX)
machine=gpupool-$$
cleanup() { rm -rf "$run"; }
trap cleanup EXIT
root=$run/root
t0=$(date +%s)
cp -a --reflink=auto "$tree" "$root"
echo "copied the tree in $(( $(date +%s) - t0 )) s"

echo "==== cmake --install $build into the container (prefix $(sed -n 's/^CMAKE_INSTALL_PREFIX:PATH=//p' "$build/CMakeCache.txt"))"
DESTDIR=$root cmake --install "$build" >"$run/install.log" 2>&1 || { cat "$run/install.log"; die "cmake --install"; }
t=$root/usr/local/libexec/gpupool-systest
mkdir -p "$t"
cp "$build/tests/service/svc_holder" "$build/tests/service/svc_survive" "$src/tests/system/inside.sh" "$t/"
chmod 755 "$t" "$t"/*
cat >"$root/etc/systemd/system/gpupool-systest.service" <<'EOF'
[Unit]
Description=gpupool system test
After=multi-user.target
[Service]
Type=oneshot
# `systemctl exit N` ends the container with status N (SuccessAction=exit-force was seen
# not to end it on systemd 252).
ExecStart=/bin/sh -c '/usr/local/libexec/gpupool-systest/inside.sh >/var/tmp/systest.log 2>&1; systemctl --no-block exit $$?'
[Install]
WantedBy=multi-user.target
EOF
# Proof that the container's systemd came up, even if the test unit never ran.
cat >"$root/etc/systemd/system/gpupool-systest-booted.service" <<'EOF'
[Unit]
Description=gpupool system test: the container booted
DefaultDependencies=no
[Service]
Type=oneshot
ExecStart=/bin/touch /var/tmp/systest.booted
[Install]
WantedBy=sysinit.target
EOF
ln -s ../gpupool-systest.service "$root/etc/systemd/system/multi-user.target.wants/gpupool-systest.service"
mkdir -p "$root/etc/systemd/system/sysinit.target.wants"
ln -s ../gpupool-systest-booted.service "$root/etc/systemd/system/sysinit.target.wants/gpupool-systest-booted.service"
# Nothing but the test: no login prompt, no timers.
ln -sf /dev/null "$root/etc/systemd/system/console-getty.service"
ln -sf /dev/null "$root/etc/systemd/system/apt-daily.timer"
ln -sf /dev/null "$root/etc/systemd/system/apt-daily-upgrade.timer"
echo "$machine" >"$root/etc/hostname"

echo "==== booting the container (systemd-nspawn -b)"
t0=$(date +%s)
set +e
timeout "${GPUPOOL_NSPAWN_TIMEOUT:-600}" systemd-nspawn --quiet --directory="$root" --machine="$machine" --register=no \
  --keep-unit --private-network --resolv-conf=off --timezone=off --link-journal=no \
  --console=pipe --boot </dev/null >"$run/console.log" 2>&1
rc=$?
set -e
took=$(( $(date +%s) - t0 ))
log=$root/var/tmp/systest.log
if [ -f "$log" ]; then cat "$log"; fi
if [ ! -f "$log" ] || ! grep -q GPUPOOL-SYSTEST-START "$log"; then
  tail -n 30 "$run/console.log"
  if [ ! -e "$root/var/tmp/systest.booted" ]; then
    skip "systemd-nspawn could not boot a container here (exit $rc; its output is above)"
  fi
  die "the container booted but the test did not run (exit $rc)"
fi
grep -q GPUPOOL-SYSTEST-OK "$log" || { tail -n 30 "$run/console.log"; die "the system test failed inside the container (exit $rc, ${took} s)"; }
[ $rc -eq 0 ] || { tail -n 30 "$run/console.log"; die "the container exited with $rc after the test passed"; }
echo "==== system test passed in ${took} s (boot, test and shutdown)"
