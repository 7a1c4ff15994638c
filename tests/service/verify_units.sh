#!/bin/sh
# Checks the systemd units as systemd itself reads them, on any machine with systemd-analyze
# (systemd need not be running: this works in containers).
#
#   verify_units.sh verify BUILD_DIR TEST_UNIT_DIR
#     1. `systemd-analyze verify` on test copies of the units whose ExecStart= points at the
#        build tree's gpupoold (verify insists that the binary exists);
#     2. `cmake --install` into a staging root, then checks that units, sysusers entry, config
#        and binaries land where the units say, and verifies the installed units with
#        --root=STAGING (with the host's own units copied in, which verify needs to resolve
#        sysinit.target and friends);
#     3. the sysusers.d entry applied to an empty passwd/group in the staging root.
#   verify_units.sh security UNIT_FILE MAX_EXPOSURE
#     `systemd-analyze security --offline=yes` on the unit; fails above MAX_EXPOSURE.
#
# Exit 77 (skipped) when systemd-analyze is missing or too old for what is asked.
set -eu

die() { echo "FAIL: $*" >&2; exit 1; }
skip() { echo "SKIP: $*"; exit 77; }

command -v systemd-analyze >/dev/null 2>&1 || skip "systemd-analyze is not installed"

# verify prints problems as warnings and may still exit 0: any output is a failure.
run_verify() {
  out=$(systemd-analyze verify --man=no "$@" 2>&1) || { echo "$out" >&2; die "systemd-analyze verify $*"; }
  if [ -n "$out" ]; then
    echo "$out" >&2
    die "systemd-analyze verify printed warnings for $*"
  fi
}

case "${1:-}" in
verify)
  build=$2
  units=$3
  [ -x "$build/daemon/gpupoold" ] || die "no gpupoold in $build/daemon"
  echo "== verify build-tree copies in $units"
  run_verify "$units/gpupoold.socket" "$units/gpupoold.service"

  stage=$(mktemp -d /tmp/gpupool-install-XXXXXX)
  trap 'rm -rf "$stage"' EXIT
  echo "== cmake --install into $stage"
  DESTDIR=$stage cmake --install "$build" >"$stage.log" 2>&1 || { cat "$stage.log" >&2; rm -f "$stage.log"; die "cmake --install"; }
  rm -f "$stage.log"
  unitdir=$(sed -n 's/^GPUPOOL_SYSTEMD_UNITDIR:PATH=//p' "$build/CMakeCache.txt")
  sysusersdir=$(sed -n 's/^GPUPOOL_SYSUSERSDIR:PATH=//p' "$build/CMakeCache.txt")
  [ -n "$unitdir" ] && [ -n "$sysusersdir" ] || die "unit directories not in the CMake cache"
  prefix=$(sed -n 's/^CMAKE_INSTALL_PREFIX:PATH=//p' "$build/CMakeCache.txt")
  case $unitdir in /*) ;; *) unitdir=$prefix/$unitdir ;; esac
  case $sysusersdir in /*) ;; *) sysusersdir=$prefix/$sysusersdir ;; esac
  for f in "$unitdir/gpupoold.service" "$unitdir/gpupoold.socket" "$sysusersdir/gpupool.conf"; do
    [ -f "$stage$f" ] || die "$f was not installed"
  done
  exec_start=$(sed -n 's/^ExecStart=\([^ ]*\).*/\1/p' "$stage$unitdir/gpupoold.service")
  config=$(sed -n 's/^ExecStart=.* --config \([^ ]*\).*/\1/p' "$stage$unitdir/gpupoold.service")
  [ -x "$stage$exec_start" ] || die "ExecStart=$exec_start is not an installed executable"
  [ -f "$stage$config" ] || die "--config $config is not installed"
  [ -f "$stage$config.default" ] || die "$config.default is not installed"
  [ -x "$stage$(dirname "$(dirname "$exec_start")")/bin/gpupoolctl" ] || die "gpupoolctl is not installed next to gpupoold"
  grep -q '^ListenStream=/run/gpupool/gpupoold.sock$' "$stage$unitdir/gpupoold.socket" || die "socket path"
  grep -q '^socket = /run/gpupool/gpupoold.sock$' "$stage$config" || die "the config's socket differs from the socket unit's"

  echo "== verify the installed units with --root=$stage"
  for d in /lib/systemd/system /usr/lib/systemd/system; do
    [ -d "$d" ] && mkdir -p "$stage$d" && cp -an "$d/." "$stage$d/" 2>/dev/null || true
  done
  # ExecReload= runs the system's /bin/sh, which the staging root lacks: the host's stands in.
  mkdir -p "$stage/bin" && cp /bin/sh "$stage/bin/sh" || die "no /bin/sh to stand in for the system's"
  # The host's units may refer to binaries that are not in the staging root; only ours are
  # checked here.
  out=$(systemd-analyze verify --man=no --root="$stage" gpupoold.socket gpupoold.service 2>&1) || { echo "$out" >&2; die "verify --root"; }
  [ -z "$out" ] || { echo "$out" >&2; die "verify --root printed warnings"; }

  if command -v systemd-sysusers >/dev/null 2>&1; then
    echo "== systemd-sysusers on an empty root"
    mkdir -p "$stage/etc"
    : >"$stage/etc/passwd"; : >"$stage/etc/group"; : >"$stage/etc/shadow"; : >"$stage/etc/gshadow"
    systemd-sysusers --root="$stage" "$stage$sysusersdir/gpupool.conf" || die "systemd-sysusers"
    grep -q '^gpupool:' "$stage/etc/group" || die "sysusers did not create the group gpupool"
    grep -q '^gpupool:' "$stage/etc/passwd" || die "sysusers did not create the user gpupool"
    gid=$(sed -n 's/^gpupool:[^:]*:\([0-9]*\):.*/\1/p' "$stage/etc/group")
    ugid=$(sed -n 's/^gpupool:[^:]*:[0-9]*:\([0-9]*\):.*/\1/p' "$stage/etc/passwd")
    [ "$gid" = "$ugid" ] || die "the user gpupool's primary group is not gpupool"
  else
    echo "(systemd-sysusers not installed: sysusers entry not applied)"
  fi
  echo "ok"
  ;;
security)
  unit=$2
  max=$3
  systemd-analyze security --help 2>&1 | grep -q -- '--offline' || skip "systemd-analyze security has no --offline (systemd < 250)"
  out=$(systemd-analyze security --offline=yes --no-pager "$unit" 2>&1) || true
  echo "$out" | tail -n 25
  level=$(echo "$out" | sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p')
  [ -n "$level" ] || die "no exposure level in the output"
  echo "exposure $level (limit $max)"
  awk -v l="$level" -v m="$max" 'BEGIN { exit !(l <= m) }' || die "exposure $level is above $max"
  echo "ok"
  ;;
*)
  echo "usage: verify_units.sh verify BUILD_DIR TEST_UNIT_DIR | security UNIT_FILE MAX" >&2
  exit 2
  ;;
esac
