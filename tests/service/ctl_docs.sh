#!/bin/sh
# The operator docs say what the programs do. Compared with the programs' own --help (which
# gpupoolctl builds from its command table, its (admin) marks from the request table in
# common/requests.h):
#   - gpupoolctl(1) documents exactly the commands of `gpupoolctl --help`, marks \fI(admin)\fR
#     exactly those --help marks (admin), and gives the same default --timeout;
#   - the lists of admin commands in systemd/README.md and README.md are exactly those;
#   - gpupoold(8) documents under SIGNALS every signal `gpupoold --help` names;
#   - config/gpupoold.conf tells operators to reload after a change, not to restart.
#
#   tests/service/ctl_docs.sh GPUPOOLD GPUPOOLCTL SOURCE_DIR
set -eu
gpupoold=$1 gpupoolctl=$2 src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
bad() { printf 'FAIL: %s\n' "$*"; fail=1; }

"$gpupoolctl" --help >"$tmp/help"
# "  name [ARG]   text", continuation lines indented deeper; (admin) at the end of an entry.
awk '/^Commands:/ { on = 1; next } on && /^$/ { exit }
     on && /^  [a-z]/ { if (cmd != "") print cmd, admin; cmd = $1; admin = 0 }
     on && /\(admin\)$/ { admin = 1 }
     END { if (cmd != "") print cmd, admin }' "$tmp/help" | sort >"$tmp/help_cmds"
[ -s "$tmp/help_cmds" ] || bad "gpupoolctl --help lists no command"
# .TP, then .B name or .BI "name" " ARG"; \fI(admin)\fR anywhere in the entry.
awk '/^\.SH/ { if (cmd != "") print cmd, admin; cmd = ""; on = ($0 ~ /^\.SH COMMANDS/); next }
     on && /^\.TP/ { if (cmd != "") print cmd, admin; cmd = ""; admin = 0; want = 1; next }
     on && want { c = $2; gsub(/"/, "", c); gsub(/\\/, "", c); cmd = c; want = 0; next }
     on && index($0, "\\fI(admin)\\fR") { admin = 1 }' "$src/man/gpupoolctl.1" | sort >"$tmp/man_cmds"
if ! cmp -s "$tmp/help_cmds" "$tmp/man_cmds"; then
  bad "gpupoolctl(1) and gpupoolctl --help disagree (command, 1 = admin):
$(diff "$tmp/help_cmds" "$tmp/man_cmds" | sed -n 's/^[<>]/&/p' | sed 's/^</  --help:/; s/^>/  man:   /')"
fi
awk '$2 == 1 { print $1 }' "$tmp/help_cmds" | sort >"$tmp/admin"

# "Admin requests (`gpupoolctl clients`, `buffers`, ... and `trim`) are accepted" and
# "`clients`, `buffers`, ... and `trim` are admin requests": every backticked word.
admin_list() {
  tr '\n' ' ' <"$1" | grep -o "$2" | head -1 | grep -o '`[a-z -]*`' | tr -d '`' |
    sed 's/^gpupoolctl //' | sort
}
admin_list "$src/systemd/README.md" 'Admin requests ([^)]*)' >"$tmp/readme_sys"
admin_list "$src/README.md" '`clients`[^.]* are admin requests' >"$tmp/readme"
for f in readme_sys readme; do
  [ -s "$tmp/$f" ] || { bad "$f: no list of admin commands found"; continue; }
  cmp -s "$tmp/admin" "$tmp/$f" || bad "the admin commands of $f ($(echo $(cat "$tmp/$f"))) are not those of gpupoolctl --help ($(echo $(cat "$tmp/admin")))"
done

help_t=$(sed -n 's/.*--timeout SEC .*(default \([0-9]*\).*/\1/p' "$tmp/help")
man_t=$(grep -A1 '^\.BR .*-\\-timeout' "$src/man/gpupoolctl.1" | sed -n 's/.*(default \([0-9]*\).*/\1/p')
[ -n "$help_t" ] && [ "$help_t" = "$man_t" ] || bad "default --timeout: --help says '$help_t', gpupoolctl(1) '$man_t'"

"$gpupoold" --help >"$tmp/dhelp"
sigs=$(grep -o 'SIG[A-Z]*' "$tmp/dhelp" | sort -u)
[ -n "$sigs" ] || bad "gpupoold --help names no signal"
awk '/^\.SH SIGNALS/ { on = 1; next } /^\.SH/ { on = 0 } on' "$src/man/gpupoold.8" >"$tmp/man_sigs"
for s in $sigs; do
  grep -q "^\.BR\{0,1\} .*$s" "$tmp/man_sigs" || bad "gpupoold(8) SIGNALS does not document $s, which gpupoold --help names"
done

head -20 "$src/config/gpupoold.conf" >"$tmp/conf_head"
grep -q 'systemctl reload gpupoold' "$tmp/conf_head" || bad "config/gpupoold.conf does not say to reload after a change"
if grep -q '^#   systemctl restart gpupoold' "$tmp/conf_head"; then
  bad "config/gpupoold.conf tells operators to restart after a change (drops every hold)"
fi

[ $fail -eq 0 ] && echo "ok: $(wc -l <"$tmp/help_cmds") commands ($(wc -l <"$tmp/admin") admin), signals $(echo $sigs)"
exit $fail
