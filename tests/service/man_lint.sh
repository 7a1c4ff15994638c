#!/bin/sh
# Each man page renders without a single warning (groff -man -ww: every warning enabled).
#   tests/service/man_lint.sh PAGE...
command -v groff >/dev/null 2>&1 || { echo "groff is not installed (groff-base): skipped"; exit 77; }
fail=0
for p in "$@"; do
  w=$(groff -man -ww -z "$p" 2>&1)
  if [ $? -ne 0 ] || [ -n "$w" ]; then echo "FAIL: $p:"; echo "$w"; fail=1; else echo "ok: $p"; fi
done
exit $fail
