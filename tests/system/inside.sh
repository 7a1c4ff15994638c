#!/bin/sh
# Runs inside the booted Debian container (see nspawn.sh) as a oneshot service, with systemd
# as PID 1: gpupool installed with `cmake --install` under /usr/local, as an operator would.
# Every step prints what it checks; the first failure ends the run with status 1.
set -eu
T=/usr/local/libexec/gpupool-systest
CONF=/usr/local/etc/gpupool/gpupoold.conf
SOCK=/run/gpupool/gpupoold.sock
echo "GPUPOOL-SYSTEST-START"

step() { echo "---- $*"; }
die() {
  echo "FAIL: $*"
  systemctl --no-pager status gpupoold.service gpupoold.socket 2>&1 || true
  journalctl --no-pager -u gpupoold -n 40 2>&1 || true
  exit 1
}
as() { user=$1; shift; setpriv --reuid="$user" --regid="$user" --init-groups "$@"; }
main_pid() { systemctl show -p MainPID --value gpupoold.service; }
wait_for() { # SECONDS COMMAND...: until COMMAND succeeds
  n=$(( $1 * 10 )); shift
  while [ $n -gt 0 ]; do "$@" && return 0; sleep 0.1; n=$((n - 1)); done
  return 1
}
ctl_ok() { as alice /usr/local/bin/gpupoolctl status >/dev/null 2>&1; }

step "install: sysusers, libraries, units"
systemd-sysusers
getent group gpupool >/dev/null || die "sysusers did not create the group gpupool"
ldconfig
useradd -m -G gpupool alice
useradd -m bob
systemctl daemon-reload
/usr/local/sbin/gpupoold --check-config --config "$CONF" || die "the shipped configuration does not pass --check-config"
systemctl cat gpupoold.service | grep -q '^RestartPreventExitStatus=2' || die "the installed unit lacks RestartPreventExitStatus=2"

step "man pages and --help of the installed programs"
for m in man8/gpupoold.8 man1/gpupoolctl.1 man5/gpupoold.conf.5; do
  [ -s "/usr/local/share/man/$m" ] || die "the man page $m is not installed under /usr/local/share/man"
done
for exe in /usr/local/sbin/gpupoold /usr/local/bin/gpupoolctl; do
  out=$(timeout 20 "$exe" --help) || die "$exe --help failed or hung"
  echo "$out" | grep -qi '^usage:' || die "$exe --help printed no usage"
done

step "gpupoold.socket"
systemctl start gpupoold.socket
[ -S "$SOCK" ] || die "no socket at $SOCK"
perm=$(stat -c '%U %G %a' "$SOCK")
[ "$perm" = "root gpupool 660" ] || die "socket owner/group/mode: $perm"
[ "$(systemctl is-active gpupoold.service)" != active ] || die "the service started before any client"

step "alice (group gpupool) connects: socket activation starts the daemon"
out=$(as alice /usr/local/bin/gpupoolctl status) || die "gpupoolctl status as alice: $out"
echo "$out" | head -n 2
pid=$(main_pid)
[ "$pid" -gt 1 ] || die "no MainPID for gpupoold.service"
echo "$out" | grep -q "(pid $pid, uid $(id -u gpupool) gpupool)" || die "status does not show the daemon's own pid $pid and uid"
systemctl status gpupoold.service --no-pager | grep -q "Status: \"Serving" || die "no Serving status line"
json=$(as alice /usr/local/bin/gpupoolctl --json status)
echo "$json" | grep -q "\"daemon_pid\":$pid," || die "--json status daemon_pid: $json"

step "bob (not in the group) is refused, with the socket's real owner, group and mode"
if out=$(as bob /usr/local/bin/gpupoolctl status 2>&1); then die "bob could connect"; fi
echo "$out" | head -n 1
# Stat it now: RuntimeDirectory= hands /run/gpupool and what is in it to the service's user.
real=$(stat -c 'owner %U, group %G, mode 0%a' "$SOCK")
echo "$out" | grep -q "($real)" || die "bob's refusal does not name the socket's $real: $out"
echo "$out" | grep -q "gpupool" || die "bob's refusal does not name the group"
out=$(as bob /usr/local/bin/gpupoolctl --json status 2>/dev/null || true)
echo "$out" | grep -q '^{"error":"permission denied' || die "--json refusal: $out"

step "a live client across a service restart"
mkfifo /tmp/holder.in
chmod 666 /tmp/holder.in
as alice "$T/svc_holder" "$SOCK" systest-holder systest/tensor 1048576 reconnect </tmp/holder.in >/tmp/holder.out 2>&1 &
holder=$!
exec 3>/tmp/holder.in
wait_for 10 grep -q ready /tmp/holder.out || die "svc_holder did not get ready: $(cat /tmp/holder.out)"
old=$(main_pid)
systemctl restart gpupoold.service
new=$(main_pid)
[ "$new" != "$old" ] || die "MainPID did not change on restart"
[ -S "$SOCK" ] || die "the socket disappeared on restart"
echo go >&3
exec 3>&-
wait "$holder" || die "the client did not reconnect with its hold reported lost: $(cat /tmp/holder.out)"
echo "client reconnected after restart (pid $old -> $new): $(tail -n 1 /tmp/holder.out)"

step "a configuration error fails fast, with its reason in systemctl status and the journal"
cp "$CONF" /tmp/good.conf
printf '[pool broken]\ncapacity = lots\n' >>"$CONF"
t0=$(date +%s)
systemctl restart gpupoold.service || true
wait_for 10 sh -c '[ "$(systemctl is-failed gpupoold.service)" = failed ]' || die "the service did not fail on a bad config"
[ $(( $(date +%s) - t0 )) -le 5 ] || die "failing took more than 5 s"
sleep 4 # RestartSec=2: a restart would have happened by now
[ "$(systemctl show -p NRestarts --value gpupoold.service)" = 0 ] || die "systemd restarted the service after exit status 2"
[ "$(systemctl show -p ExecMainStatus --value gpupoold.service)" = 2 ] || die "exit status is not 2"
st=$(systemctl status gpupoold.service --no-pager 2>&1 || true)
echo "$st" | grep 'Status:'
echo "$st" | grep 'Status:' | grep -q "not a size" || die "the reason is not in systemctl status"
journalctl --no-pager -u gpupoold -p err | grep -q "not a size" || die "the reason is not in the journal at error priority"
cp /tmp/good.conf "$CONF"
systemctl reset-failed gpupoold.service
wait_for 10 ctl_ok || die "gpupoold did not come back after the config was fixed"

step "a SIGSTOPped daemon: clients time out, the watchdog restarts it"
mkdir -p /run/systemd/system/gpupoold.service.d
printf '[Service]\nWatchdogSec=3\nLimitCORE=0\n' >/run/systemd/system/gpupoold.service.d/systest.conf
systemctl daemon-reload
systemctl restart gpupoold.service
wait_for 10 ctl_ok || die "gpupoold did not start with WatchdogSec=3"
stopped=$(main_pid)
restarts=$(systemctl show -p NRestarts --value gpupoold.service)
kill -STOP "$stopped"
if out=$(as alice env GPUPOOL_CONNECT_TIMEOUT_MS=1000 /usr/local/bin/gpupoolctl status 2>&1); then
  die "gpupoolctl got an answer from a stopped daemon"
fi
echo "$out" | head -n 1
echo "$out" | grep -q "did not answer in 1 s" || die "timeout message: $out"
wait_for 30 sh -c "[ \"\$(systemctl show -p MainPID --value gpupoold.service)\" != $stopped ] && [ \"\$(systemctl show -p MainPID --value gpupoold.service)\" != 0 ]" ||
  die "the watchdog did not restart the stopped daemon"
wait_for 10 ctl_ok || die "gpupoold did not answer after the watchdog restart"
[ "$(systemctl show -p NRestarts --value gpupoold.service)" -gt "$restarts" ] || die "NRestarts did not grow"
journalctl --no-pager -u gpupoold | grep -qi "watchdog timeout" || die "no watchdog timeout in the journal"
echo "watchdog restarted pid $stopped -> $(main_pid)"
rm -f /run/systemd/system/gpupoold.service.d/systest.conf
echo "GPUPOOL-SYSTEST-OK"
