#!/bin/sh
# Every program an operator or a developer runs by hand answers --help: usage on stdout, exit
# status 0, at once. Each is given --help alone and must finish within the timeout (a program
# that took --help for a path or waited on a daemon would hang or fail here).
#
#   tests/service/help.sh PROGRAM...
set -u
fail=0
for p in "$@"; do
  out=$(timeout 20 "$p" --help </dev/null 2>/tmp/help-err.$$)
  rc=$?
  if [ $rc -eq 124 ]; then
    echo "FAIL: $p --help did not finish (hung)"; fail=1
  elif [ $rc -ne 0 ]; then
    echo "FAIL: $p --help exited $rc: $(head -c 300 /tmp/help-err.$$)"; fail=1
  elif ! printf '%s' "$out" | grep -qi '^usage:'; then
    echo "FAIL: $p --help printed no usage line on stdout: $(printf '%s' "$out" | head -c 300)"; fail=1
  else
    echo "ok: $(basename "$p") --help"
  fi
done
rm -f /tmp/help-err.$$
exit $fail
