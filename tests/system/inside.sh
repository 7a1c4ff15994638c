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
# start_holder TAG CLIENT NAME MODE: alice's svc_holder holding NAME (1 MiB), fed through the
# FIFO /tmp/TAG.in on fd 3, output in /tmp/TAG.out, its pid in $holder; returns once it is ready.
start_holder() {
  mkfifo "/tmp/$1.in"
  chmod 666 "/tmp/$1.in"
  as alice "$T/svc_holder" "$SOCK" "$2" "$3" 1048576 "$4" <"/tmp/$1.in" >"/tmp/$1.out" 2>&1 &
  holder=$!
  exec 3>"/tmp/$1.in"
  wait_for 10 grep -q ready "/tmp/$1.out" || die "svc_holder did not get ready: $(cat "/tmp/$1.out")"
}

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
echo "$out" | grep -q 'usermod -aG gpupool \$USER' || die "bob's refusal does not say 'usermod -aG gpupool \$USER': $out"
out=$(as bob /usr/local/bin/gpupoolctl --json status 2>/dev/null || true)
echo "$out" | grep -q '^{"error":"permission denied' || die "--json refusal: $out"

step "trim is an operator's request; names lists every name of a buffer"
if out=$(as alice /usr/local/bin/gpupoolctl trim 2>&1); then die "alice (not an operator) could trim: $out"; fi
echo "$out" | grep -q "permission denied" || die "alice's trim refusal: $out"
/usr/local/bin/gpupoolctl trim >/dev/null || die "root could not trim"
mkfifo /tmp/names.in
chmod 666 /tmp/names.in
as alice "$T/svc_holder" "$SOCK" systest-names systest/c,systest/a,systest/b 4096 closed </tmp/names.in >/tmp/names.out 2>&1 &
namer=$!
exec 4>/tmp/names.in
wait_for 10 grep -q ready /tmp/names.out || die "svc_holder did not get ready: $(cat /tmp/names.out)"
au=$(id -u alice)
out=$(/usr/local/bin/gpupoolctl names)
echo "$out"
n=$(echo "$out" | grep -c "^uid:$au/systest/[abc] ") || true
[ "$n" = 3 ] || die "names shows $n of alice's 3 names"
/usr/local/bin/gpupoolctl --json buffers | grep -q "\"names\":\[\"uid:$au/systest/a\",\"uid:$au/systest/b\",\"uid:$au/systest/c\"\]" ||
  die "buffers --json lacks the buffer's three names: $(/usr/local/bin/gpupoolctl --json buffers)"
exec 4>&-
kill "$namer" 2>/dev/null || true
wait "$namer" 2>/dev/null || true

step "a live client across a service restart: it reconnects and its hold is given back"
start_holder holder systest-holder systest/tensor resumed
old=$(main_pid)
systemctl restart gpupoold.service
new=$(main_pid)
[ "$new" != "$old" ] || die "MainPID did not change on restart"
[ -S "$SOCK" ] || die "the socket disappeared on restart"
echo go >&3
exec 3>&-
wait "$holder" || die "the client did not reconnect with its hold given back: $(cat /tmp/holder.out)"
echo "client reconnected after restart (pid $old -> $new): $(tail -n 1 /tmp/holder.out)"

step "metrics: each exporter starts or fails on its own; HTTP answers; a scrapers' group"
MSOCK=/run/gpupool/metrics.sock
# USER REQUEST-LINE: the whole answer of the metrics socket to that request, as USER.
scrape() {
  as "$1" perl -MIO::Socket::UNIX -e '
    my $s = IO::Socket::UNIX->new(Peer => $ARGV[0]) or die "connect $ARGV[0]: $!\n";
    print $s "$ARGV[1]\r\nHost: x\r\n\r\n"; local $/; print <$s>;' "$MSOCK" "$2"
}
groupadd -r gpupool-metrics
useradd -m -G gpupool-metrics carol
cp "$CONF" /tmp/metrics-good.conf
# The textfile's directory does not exist (no node_exporter here) and the unit allows no TCP:
# both exporters fail, and the socket must serve all the same.
sed -i 's|^metrics_socket = .*|&\nmetrics_socket_group = gpupool-metrics\nmetrics_textfile = /var/lib/prometheus/node-exporter/gpupool.prom\nmetrics_listen = 9464|' "$CONF"
mkdir -p /run/systemd/system/gpupoold.service.d
printf '[Service]\nSupplementaryGroups=gpupool-metrics\n' >/run/systemd/system/gpupoold.service.d/metrics.conf
systemctl daemon-reload
systemctl restart gpupoold.service || die "gpupoold did not start with the metrics settings"
wait_for 10 ctl_ok || die "gpupoold did not answer with the metrics settings"
wait_for 10 test -S "$MSOCK" || die "no metrics socket although only the textfile and TCP exporters failed"
mperm=$(stat -c '%G %a' "$MSOCK")
[ "$mperm" = "gpupool-metrics 660" ] || die "metrics socket group/mode: $mperm (want gpupool-metrics 660)"
journalctl --no-pager -u gpupoold -n 200 | grep -q "textfile exporter degraded: cannot create /var/lib/prometheus/node-exporter/gpupool.prom.tmp" ||
  die "no 'textfile exporter degraded' line in the journal"
journalctl --no-pager -u gpupoold -n 200 | grep -q "tcp exporter degraded" || die "no 'tcp exporter degraded' line in the journal"
journalctl --no-pager -u gpupoold -n 200 | grep -q "metrics disabled" && die "the journal says metrics are disabled"
ans=$(scrape carol "GET /metrics HTTP/1.1") || die "carol (group gpupool-metrics) cannot scrape: $ans"
echo "$ans" | head -n 1 | grep -q "^HTTP/1.0 200 OK" || die "GET /metrics: $(echo "$ans" | head -n 3)"
echo "$ans" | grep -q "^Content-Length: [0-9]" || die "GET /metrics has no Content-Length"
for fam in gpupool_pool_capacity_bytes process_cpu_seconds_total process_resident_memory_bytes \
           process_open_fds process_max_fds process_start_time_seconds; do
  echo "$ans" | grep -q "^# TYPE $fam " || die "no $fam in the scrape"
done
scrape carol "GET /nonexistent HTTP/1.1" | head -n 1 | grep -q "^HTTP/1.0 404" || die "GET /nonexistent is not 404"
scrape carol "POST /metrics HTTP/1.1" | grep -q "^Allow: GET, HEAD" || die "POST has no 405 with Allow"
[ "$(scrape carol "HEAD /metrics HTTP/1.1" | sed -n '/^\r$/,$p' | wc -c)" -le 2 ] || die "HEAD sent a body"
if out=$(as carol /usr/local/bin/gpupoolctl status 2>&1); then die "carol, a scraper only, could use the daemon"; fi
echo "carol scrapes $MSOCK ($mperm) and is refused by the daemon"
rm -f /run/systemd/system/gpupoold.service.d/metrics.conf
cp /tmp/metrics-good.conf "$CONF"
systemctl daemon-reload
systemctl restart gpupoold.service
wait_for 10 ctl_ok || die "gpupoold did not come back with the shipped configuration"

step "systemctl reload with a client holding a name: the name and its connection survive"
# Mode "closed": reconnection off, so its request after the reload succeeds only if the
# daemon kept its connection (svc_holder then exits 1, "not dropped").
start_holder reload systest-reload systest/reload closed
pid=$(main_pid)
cp "$CONF" /tmp/good.conf
sed -i -e 's/^#max_clients_per_uid = .*/max_clients_per_uid = 200/' -e 's/^#listen_backlog = .*/listen_backlog = 64/' "$CONF"
systemctl reload gpupoold.service || die "systemctl reload failed"
[ "$(main_pid)" = "$pid" ] || die "reload replaced the daemon (pid $pid -> $(main_pid))"
wait_for 10 sh -c 'journalctl --no-pager -u gpupoold | grep -q "reloaded .*changed: max_clients_per_uid"' ||
  die "the journal does not list the change"
journalctl --no-pager -u gpupoold | grep "reloaded " | tail -n 1
journalctl --no-pager -u gpupoold | grep "reloaded " | tail -n 1 | grep -q "until a restart: listen_backlog" ||
  die "the journal does not say listen_backlog waits for a restart"
/usr/local/bin/gpupoolctl names | grep -q "systest/reload" || die "the name did not survive the reload"
echo go >&3
exec 3>&-
if wait "$holder"; then rc=0; else rc=$?; fi
[ "$rc" = 1 ] || die "the holder's connection did not survive the reload (exit $rc): $(cat /tmp/reload.out)"
cp /tmp/good.conf "$CONF"
systemctl reload gpupoold.service

step "systemctl reload of a file the daemon rejects fails the job and changes nothing"
pid=$(main_pid)
sed -i 's/^\[daemon\]$/[daemon]\nmax_clinets = 5/' "$CONF"
grep -q '^max_clinets = 5$' "$CONF" || die "could not put the misspelt key into $CONF"
if systemctl reload gpupoold.service; then die "systemctl reload of a file with max_clinets succeeded"; fi
journalctl --no-pager -u gpupoold | grep -q "unknown key 'max_clinets'" || die "the journal does not say why the reload failed"
[ "$(main_pid)" = "$pid" ] || die "the failed reload replaced the daemon (pid $pid -> $(main_pid))"
[ "$(systemctl is-active gpupoold.service)" = active ] || die "the failed reload left gpupoold $(systemctl is-active gpupoold.service)"
ctl_ok || die "gpupoold does not serve after a failed reload"
cp /tmp/good.conf "$CONF"
systemctl reload gpupoold.service || die "systemctl reload of the good file failed"

step "a configuration error under socket activation: clients are told why, the socket stays usable"
systemctl stop gpupoold.service
printf '[pool broken]\ncapacity = lots\n' >>"$CONF"
rc=0
out=$(as alice /usr/local/bin/gpupoolctl status 2>&1) || rc=$?
echo "$out" | head -n 1
[ "$rc" = 4 ] || die "gpupoolctl status exited $rc with a bad config, not 4 (up but not serving)"
echo "$out" | grep -q "not a size" || die "the client is not told what is wrong: $out"
pid=$(main_pid)
[ "$pid" -gt 1 ] || die "gpupoold did not stay up to answer"
# The start that once jammed the socket: many clients in a row.
for i in 1 2 3 4 5 6 7 8; do as alice /usr/local/bin/gpupoolctl status >/dev/null 2>&1 || true; done
[ "$(systemctl is-active gpupoold.socket)" = active ] ||
  die "gpupoold.socket failed: $(systemctl show -p Result --value gpupoold.socket)"
[ "$(main_pid)" = "$pid" ] || die "gpupoold was started again for each client"
st=$(systemctl status gpupoold.service --no-pager 2>&1 || true)
echo "$st" | grep 'Status:'
echo "$st" | grep 'Status:' | grep -q "not a size" || die "the reason is not in systemctl status"
systemctl show -p StatusText --value gpupoold.service | grep -q "^Configuration error, not serving: " ||
  die "StatusText does not begin with the config-error mark"
journalctl --no-pager -u gpupoold -p err | grep -q "not a size" || die "the reason is not in the journal at error priority"
cp /tmp/good.conf "$CONF"
systemctl reload gpupoold.service
wait_for 10 ctl_ok || die "gpupoold did not serve after the config was fixed and reloaded"
# And what the README advised before: a restart, straight after, within any start limit.
systemctl restart gpupoold.service || die "systemctl restart after the fix failed"
wait_for 10 ctl_ok || die "gpupoold did not serve after the restart"

step "a daemon that cannot start (a library missing, each start failing slowly): the start limit stops the loop; the documented recovery brings it back"
lib=$(ldd /usr/local/sbin/gpupoold | sed -n -e 's/.*libucp\.so\.0 => \([^ ]*\).*/\1/p' | head -n 1)
[ -n "$lib" ] || lib=$(ldd /usr/local/sbin/gpupoold | sed -n -e 's/.*libuv\.so\.1 => \([^ ]*\).*/\1/p' | head -n 1)
if [ -n "$lib" ]; then
  systemctl stop gpupoold.service
  mv "$lib" "$lib.hidden"
  mkdir -p /run/systemd/system/gpupoold.service.d
  # Each start takes a while to fail, as on the host where the loop never hit the limit.
  printf '[Service]\nExecStartPre=/bin/sleep 2\n' >/run/systemd/system/gpupoold.service.d/slow.conf
  systemctl daemon-reload
  t0=$(date +%s)
  systemctl start gpupoold.service 2>/dev/null && die "gpupoold started without $lib"
  # systemd 252 keeps the service's Result of its last failure (exit-code) and fails the
  # socket with service-start-limit-hit.
  wait_for 150 sh -c '[ "$(systemctl show -p Result --value gpupoold.socket)" = service-start-limit-hit ]' ||
    die "the loop of failing starts did not stop at the start limit within 150 s ($(systemctl show -p NRestarts --value gpupoold.service) restarts)"
  echo "stopped after $(systemctl show -p NRestarts --value gpupoold.service) restarts in $(( $(date +%s) - t0 )) s"
  journalctl --no-pager -u gpupoold | grep -q "Start request repeated too quickly" || die "the journal does not say the start limit was hit"
  journalctl --no-pager -u gpupoold | grep -q "$(basename "$lib")" || die "the journal does not name the missing library"
  [ "$(systemctl is-active gpupoold.service)" = failed ] || die "gpupoold.service is $(systemctl is-active gpupoold.service), not failed"
  rc=0
  as alice /usr/local/bin/gpupoolctl status >/dev/null 2>&1 || rc=$?
  [ "$rc" = 3 ] || die "gpupoolctl status exited $rc with the socket down, not 3"
  [ ! -e "$SOCK" ] || die "the failed socket unit left $SOCK behind"
  # The recovery systemd/README.md gives:
  mv "$lib.hidden" "$lib"
  rm -f /run/systemd/system/gpupoold.service.d/slow.conf
  systemctl daemon-reload
  systemctl reset-failed gpupoold.service gpupoold.socket
  systemctl start gpupoold.socket
  wait_for 10 ctl_ok || die "gpupoold did not serve after the recovery"
else
  echo "(gpupoold links neither libucp nor a shared libuv: nothing to take away)"
fi

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

step "names, versions and their bytes survive kill -9 and systemctl restart; systemctl stop lets them go"
systemctl daemon-reload
systemctl reset-failed gpupoold.service gpupoold.socket 2>/dev/null || true
systemctl restart gpupoold.service
wait_for 10 ctl_ok || die "gpupoold did not start for the survival step"
store() { systemctl show -p NFileDescriptorStore --value gpupoold.service; }
wait_for 10 sh -c '[ "$(systemctl show -p NFileDescriptorStore --value gpupoold.service)" -gt 0 ]' ||
  die "the daemon put nothing in systemd's fd store"
base=$(store)
as alice "$T/svc_survive" "$SOCK" publish survive/n 40 65536 7 || die "publishing version 1 failed"
as alice "$T/svc_survive" "$SOCK" publish survive/n 40 65536 9 || die "publishing version 2 failed"
echo "fd store: $base entries before, $(store) with 40 names"
old=$(main_pid)
kill -KILL "$old"
wait_for 30 sh -c "p=\$(systemctl show -p MainPID --value gpupoold.service); [ \"\$p\" != $old ] && [ \"\$p\" != 0 ]" ||
  die "systemd did not restart the killed daemon"
wait_for 10 ctl_ok || die "gpupoold did not answer after the crash"
as alice "$T/svc_survive" "$SOCK" check survive/n 40 65536 9 2 || die "the names did not survive kill -9"
journalctl --no-pager -u gpupoold | grep "restored state" | tail -n 1
/usr/local/bin/gpupoolctl status | grep "^survival: " || die "gpupoolctl status has no survival line"
/usr/local/bin/gpupoolctl status | grep -q "^survival: kept in the fd store .*restored at start: 40 name(s)" ||
  die "gpupoolctl status does not say the 40 names were restored"
journalctl --no-pager -u gpupoold | grep "restored state" | tail -n 1 | grep -q "40 name(s)" ||
  die "the journal does not say the 40 names were restored"
systemctl restart gpupoold.service || die "systemctl restart failed"
wait_for 10 ctl_ok || die "gpupoold did not answer after the restart"
as alice "$T/svc_survive" "$SOCK" check survive/n 40 65536 9 2 || die "the names did not survive systemctl restart"
as alice "$T/svc_survive" "$SOCK" publish survive/n 1 65536 11 || die "publishing after the restart failed"
as alice "$T/svc_survive" "$SOCK" check survive/n 1 65536 11 3 || die "the version after the restart is not 3"
as alice "$T/svc_survive" "$SOCK" unpublish survive/n 40 || die "unpublishing failed"
/usr/local/bin/gpupoolctl trim >/dev/null || true
wait_for 10 sh -c "[ \"\$(systemctl show -p NFileDescriptorStore --value gpupoold.service)\" -le $base ]" ||
  die "the fd store holds $(store) entries after everything was released, $base before"
as alice "$T/svc_survive" "$SOCK" publish survive/n 2 4096 5 || die "publishing before the stop failed"
systemctl stop gpupoold.service
systemctl start gpupoold.service
wait_for 10 ctl_ok || die "gpupoold did not start after the stop"
if as alice "$T/svc_survive" "$SOCK" check survive/n 2 4096 5 1 >/dev/null; then
  die "names survived systemctl stop (the fd store should have been emptied)"
fi
echo "survival: kill -9 and restart keep 40 names at version 2, stop lets them go"
echo "GPUPOOL-SYSTEST-OK"
