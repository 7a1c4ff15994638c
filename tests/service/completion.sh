#!/usr/bin/env bash
# gpupoolctl's bash completion (tools/gpupoolctl.bash), as bash runs it: commands and options
# as `gpupoolctl --help` lists them, file names after --socket, and, against a live daemon,
# the keys of unpublish and the pids of drop-client.
#
#   tests/service/completion.sh COMPLETION_FILE GPUPOOLCTL GPUPOOLD SVC_HOLDER
set -u
comp=$1 ctl=$2 gpupoold=$3 holder=$4
tmp=$(mktemp -d)
dpid= hpid=
cleanup() {
  [ -z "$hpid" ] || kill "$hpid" 2>/dev/null
  [ -z "$dpid" ] || kill "$dpid" 2>/dev/null
  wait 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
fail=0
# shellcheck source=/dev/null
. "$comp" || { echo "FAIL: $comp does not load in bash"; exit 1; }
complete -p gpupoolctl >/dev/null 2>&1 || { echo "FAIL: $comp registers no completion for gpupoolctl"; exit 1; }

# What completing the last word of LINE offers (LINE ends with a space: an empty word).
offers() {
  local line=$1
  read -r -a COMP_WORDS <<<"$line"
  [[ $line == *" " ]] && COMP_WORDS+=("")
  COMP_WORDS[0]=$ctl
  COMP_CWORD=$((${#COMP_WORDS[@]} - 1))
  COMP_LINE=$line COMP_POINT=${#line}
  COMPREPLY=()
  _gpupoolctl
  [ ${#COMPREPLY[@]} -eq 0 ] || printf '%s\n' "${COMPREPLY[@]}" | sort | tr '\n' ' '
}
expect() { # LINE WANT: the offers are exactly WANT (sorted, space-separated)
  local got
  got=$(offers "$1")
  if [ "$got" != "$2" ]; then echo "FAIL: '$1' completes to '$got', not '$2'"; fail=1; else echo "ok: '$1' -> $got"; fi
}
has() { # LINE WORD: WORD is among the offers
  local got
  got=$(offers "$1")
  case " $got" in *" $2 "*) echo "ok: '$1' offers $2" ;; *) echo "FAIL: '$1' completes to '$got', without $2"; fail=1 ;; esac
}

cmds=$("$ctl" --help | sed -n '/^Commands:/,/^$/s/^  \([a-z][a-z-]*\).*/\1/p' | sort | tr '\n' ' ')
expect "gpupoolctl " "$cmds"
expect "gpupoolctl st" "stats status "
expect "gpupoolctl dr" "drop-client "
expect "gpupoolctl --j" "--json "
expect "gpupoolctl -s /nonexistent -j tr" "trim "
expect "gpupoolctl status " ""
touch "$tmp/gp-file"
expect "gpupoolctl --socket $tmp/gp-f" "$tmp/gp-file "

# Against a daemon: the names and the clients it knows.
"$gpupoold" --backend host --socket "$tmp/gp.sock" --pool name=default,kind=host,capacity=16M,slab=2M \
  --log-level warn 2>"$tmp/d.log" &
dpid=$!
for _ in $(seq 200); do [ -S "$tmp/gp.sock" ] && break; sleep 0.05; done
mkfifo "$tmp/in"
"$holder" "$tmp/gp.sock" completion comp/tensor 4096 closed <"$tmp/in" >"$tmp/h.out" &
hpid=$!
exec 3>"$tmp/in"
for _ in $(seq 200); do grep -q ready "$tmp/h.out" && break; sleep 0.05; done
grep -q ready "$tmp/h.out" || { echo "FAIL: svc_holder did not get ready"; cat "$tmp/d.log"; exit 1; }
expect "gpupoolctl -s $tmp/gp.sock unpublish uid:" "uid:$(id -u)/comp/tensor "
has "gpupoolctl --socket $tmp/gp.sock drop-client " "$hpid"
expect "gpupoolctl -s $tmp/gp.sock unpublish uid:$(id -u)/comp/tensor " ""
exec 3>&-
exit $fail
