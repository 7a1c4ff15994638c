#!/usr/bin/env bash
# Network namespaces for the peer tests: N "nodes" joined by veth pairs on one bridge.
#
#   tests/remote/netns.sh up N      # gpn0..gpn{N-1}, 10.77.0.1/24 .. 10.77.0.N, lo up in each
#   tests/remote/netns.sh down      # removes every namespace and link this script made
#   tests/remote/netns.sh check     # exit 0 when namespaces can be made here, else 77 + reason
#   tests/remote/netns.sh run N -- CMD ARGS...
#                                   # up N, CMD, down (also on error or a signal); CMD's status
#
# The bridge lives in a namespace of its own (gpnbr), so the host's network is never touched:
# node I has the veth `gpv<I>` (its end) whose peer `gpb<I>` is a port of bridge `gpbr0` in gpnbr.
# A test daemon runs as `ip netns exec gpn<I> ...` with UCX_NET_DEVICES=gpv<I>.
#
# GPUPOOL_NETNS_RATE (e.g. 400mbit) caps what the bridge sends to each node (a tbf qdisc on
# every bridge port), so a transfer lasts long enough for a test to kill something in its
# middle; when the kernel has no tbf it exits 77 saying so.
#
# GPUPOOL_NETNS_PREFIX (default gpn) changes the namespace names, so two suites can run side by
# side; the addresses are then 10.77.<GPUPOOL_NETNS_SUBNET>.x (default 0). Needs root and `ip`
# (iproute2); without them it exits 77 (the ctest skip status) naming what is missing.
set -euo pipefail

PREFIX=${GPUPOOL_NETNS_PREFIX:-gpn}
SUBNET=${GPUPOOL_NETNS_SUBNET:-0}
BRNS=${PREFIX}br
BR=gpbr0
MAX=32

die() { echo "netns.sh: $*" >&2; exit 1; }
skip() { echo "netns.sh: SKIP: $*" >&2; exit 77; }

# Exit 77 with the reason when namespaces cannot be made here.
check() {
  [ "$(id -u)" -eq 0 ] || skip "needs root to create network namespaces (run as root, as CI does)"
  command -v ip >/dev/null || skip "needs 'ip' from iproute2 (tools/deps.sh installs it)"
  local probe="${PREFIX}probe$$"
  if ! ip netns add "$probe" 2>/dev/null; then
    skip "this kernel or container does not allow 'ip netns add' (no CAP_SYS_ADMIN or no netns support)"
  fi
  # ip netns exec remounts / as a slave and /sys in the namespace: in a chroot whose / is not a
  # mount point that fails ("mount --make-rslave /" failed: Invalid argument).
  local err
  if ! err=$(ip netns exec "$probe" true 2>&1); then
    ip netns delete "$probe" 2>/dev/null || true
    skip "'ip netns exec' does not work here ($(echo "$err" | head -n1)); in a chroot, make its / a mount point (mount --bind DIR DIR) or run on the machine itself"
  fi
  ip netns delete "$probe" 2>/dev/null || true
}

ns_exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$1"; }

down() {
  local ns
  # Node namespaces first (deleting one removes its veth end and so the peer port on the bridge).
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    case "$ns" in
      "$BRNS") ;;
      "$PREFIX"[0-9]|"$PREFIX"[0-9][0-9]) ip netns delete "$ns" 2>/dev/null || true ;;
    esac
  done
  if ns_exists "$BRNS"; then ip netns delete "$BRNS" 2>/dev/null || true; fi
}

up() {
  local n=$1 i ns addr
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le "$MAX" ] ||
    die "up N: N must be 1..$MAX, got '$n'"
  check
  down # a run killed before its trap leaves namespaces behind: start clean
  ip netns add "$BRNS"
  ip -n "$BRNS" link set lo up
  ip -n "$BRNS" link add "$BR" type bridge
  ip -n "$BRNS" link set "$BR" up
  for ((i = 0; i < n; i++)); do
    ns="$PREFIX$i"
    addr="10.77.$SUBNET.$((i + 1))"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # Created inside the node namespace, the bridge end moved out: no name ever lands on the host.
    ip -n "$ns" link add "gpv$i" type veth peer name "gpb$i" netns "$BRNS"
    ip -n "$BRNS" link set "gpb$i" master "$BR"
    ip -n "$BRNS" link set "gpb$i" up
    if [ -n "${GPUPOOL_NETNS_RATE:-}" ] &&
      ! ip netns exec "$BRNS" tc qdisc add dev "gpb$i" root tbf rate "$GPUPOOL_NETNS_RATE" \
        burst 256kb latency 50ms 2>/dev/null; then
      down
      skip "cannot cap the link at $GPUPOOL_NETNS_RATE: no 'tc' or no tbf qdisc in this kernel"
    fi
    ip -n "$ns" addr add "$addr/24" dev "gpv$i"
    ip -n "$ns" link set "gpv$i" up
  done
  # Wait until every node reaches the first one: the veth carrier comes up asynchronously.
  # With ping (iputils-ping, in tools/deps.sh) that is a real round trip; without it, the
  # carrier of both ends.
  for ((i = 0; i < n; i++)); do
    local ok=0 t
    for t in $(seq 1 50); do
      if reachable "$i"; then ok=1; break; fi
      sleep 0.1
    done
    [ "$ok" = 1 ] || die "node $PREFIX$i cannot reach 10.77.$SUBNET.1 after 5 s"
  done
}

reachable() {
  local i=$1
  if command -v ping >/dev/null; then
    ip netns exec "$PREFIX$i" ping -c1 -W1 "10.77.$SUBNET.1" >/dev/null 2>&1
  else
    ip -n "$PREFIX$i" link show "gpv$i" | grep -q LOWER_UP &&
      ip -n "$BRNS" link show "gpb$i" | grep -q LOWER_UP
  fi
}

case "${1:-}" in
  up)
    [ $# -eq 2 ] || die "usage: netns.sh up N"
    # Half made is worse than none: a failure (or a signal) part way removes what was made.
    trap 'rc=$?; [ "$rc" -eq 0 ] || [ "$rc" -eq 77 ] || down; exit "$rc"' EXIT
    trap 'exit 130' INT TERM HUP
    up "$2"
    ;;
  down) [ "$(id -u)" -eq 0 ] || skip "needs root"; down ;;
  check) check ;;
  run)
    [ $# -ge 4 ] && [ "$3" = "--" ] || die "usage: netns.sh run N -- CMD ARGS..."
    n=$2; shift 3
    trap down EXIT
    trap 'exit 130' INT TERM HUP
    up "$n"
    set +e
    "$@"
    rc=$?
    set -e
    exit "$rc"
    ;;
  *) die "usage: netns.sh up N | down | check | run N -- CMD ARGS..." ;;
esac
