#!/bin/sh
# gpupoold.conf(5) documents exactly the config keys of the table in daemon/config.c: every
# key `gpupoold --list-config-keys` prints appears in its section of the page (a .TP entry
# "\fBkey\fR = default" under .SS "[section ...]"), and the page names no key the table lacks.
#
#   tests/service/man_keys.sh GPUPOOLD MAN_PAGE
set -eu
gpupoold=$1 page=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$gpupoold" --list-config-keys | sed -n 's/^\[\([^]]*\)\] \([a-z_0-9]*\) =.*/\1 \2/p' | sort >"$tmp/table"
[ -s "$tmp/table" ] || { echo "FAIL: gpupoold --list-config-keys printed no key"; exit 1; }
# .SS "[daemon]" -> daemon; "[pool NAME]" -> pool; "[tenant NAME] and [group NAME]" -> tenant/group
awk '
  /^\.SS / { s = $0; sub(/^\.SS "?\[/, "", s); sub(/[] ].*/, "", s); sec = (s == "tenant") ? "tenant/group" : s; next }
  /^\.SH / { sec = ""; next }
  prev == ".TP" && sec != "" && /^\\fB[a-z_0-9]+\\fR = / { k = $0; sub(/^\\fB/, "", k); sub(/\\fR.*/, "", k); print sec, k }
  { prev = $0 }' "$page" | sort >"$tmp/page"
missing=$(comm -23 "$tmp/table" "$tmp/page")
extra=$(comm -13 "$tmp/table" "$tmp/page")
[ -z "$missing" ] || echo "FAIL: keys of the config table that $page does not document (section key):
$missing"
[ -z "$extra" ] || echo "FAIL: keys $page documents that the config table lacks (section key):
$extra"
[ -z "$missing$extra" ] || exit 1
echo "ok: $(wc -l <"$tmp/table") keys, each documented once in its section"
