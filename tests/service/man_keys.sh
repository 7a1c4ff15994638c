#!/bin/sh
# gpupoold.conf(5) documents exactly the config keys of the table in daemon/service/config.c: every
# key `gpupoold --list-config-keys` prints appears in its section of the page (a .TP entry
# "\fBkey\fR = default" under .SS "[section ...]"), and the page names no key the table lacks.
# The [daemon] keys a reload cannot change (the table's "(restart only)") are exactly those
# whose entry is marked \fI(restart)\fR, so the page says which keys change live.
#
#   tests/service/man_keys.sh GPUPOOLD MAN_PAGE
set -eu
gpupoold=$1 page=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$gpupoold" --list-config-keys >"$tmp/list"
sed -n 's/^\[\([^]]*\)\] \([a-z_0-9]*\) =.*/\1 \2/p' "$tmp/list" | sort >"$tmp/table"
[ -s "$tmp/table" ] || { echo "FAIL: gpupoold --list-config-keys printed no key"; exit 1; }
sed -n 's/^\[daemon\] \([a-z_0-9]*\) =.*(restart only)$/\1/p' "$tmp/list" | sort >"$tmp/table_restart"
[ -s "$tmp/table_restart" ] || { echo "FAIL: gpupoold --list-config-keys marks no key (restart only)"; exit 1; }
# .SS "[daemon]" -> daemon; "[pool NAME]" -> pool; "[tenant NAME] and [group NAME]" -> tenant/group
awk -v restart="$tmp/page_restart" '
  function flush() { if (key != "" && sec == "daemon" && marked) print key > restart; key = ""; marked = 0 }
  /^\.SS / { flush(); s = $0; sub(/^\.SS "?\[/, "", s); sub(/[] ].*/, "", s); sec = (s == "tenant") ? "tenant/group" : s; next }
  /^\.SH / { flush(); sec = ""; next }
  /^\.TP/ { flush() }
  prev == ".TP" && sec != "" && /^\\fB[a-z_0-9]+\\fR = / { k = $0; sub(/^\\fB/, "", k); sub(/\\fR.*/, "", k); print sec, k; key = k }
  key != "" && index($0, "\\fI(restart)\\fR") { marked = 1 }
  { prev = $0 }
  END { flush() }' "$page" | sort >"$tmp/page"
touch "$tmp/page_restart"
sort -o "$tmp/page_restart" "$tmp/page_restart"
missing=$(comm -23 "$tmp/table" "$tmp/page")
extra=$(comm -13 "$tmp/table" "$tmp/page")
unmarked=$(comm -23 "$tmp/table_restart" "$tmp/page_restart")
overmarked=$(comm -13 "$tmp/table_restart" "$tmp/page_restart")
[ -z "$missing" ] || echo "FAIL: keys of the config table that $page does not document (section key):
$missing"
[ -z "$extra" ] || echo "FAIL: keys $page documents that the config table lacks (section key):
$extra"
[ -z "$unmarked" ] || echo "FAIL: [daemon] keys only a restart changes that $page does not mark (restart):
$unmarked"
[ -z "$overmarked" ] || echo "FAIL: [daemon] keys $page marks (restart) that a reload changes:
$overmarked"
[ -z "$missing$extra$unmarked$overmarked" ] || exit 1
echo "ok: $(wc -l <"$tmp/table") keys, each documented once in its section; $(wc -l <"$tmp/table_restart") marked (restart)"
