#!/usr/bin/env python3
"""Who sets and who reads the thread's error message in C sources.

Every function of the given files is read (a definition starts at column 0 and its body ends
at the next "}" at column 0, as clang-format writes them) and each call in it that records a
message in the thread-local buffer (gpupool__err, gpupool__error_report), reads it raw
(gpupool__errmsg) or takes it into a value (gpupool__error_take) is listed with its function.
Public functions (gpupool_ but not gpupool__) are the entry points, where a value becomes the
thread's message. Below them a failure's message is taken into a gpupool__error at once and
passed up; --check fails when a function below the public ones reads the message raw (to
wrap it, log it or save it in a buffer of its own), which is how saved-and-restored messages
came to be overwritten by the cleanup that ran between.

--values FILE (repeatable) names files whose functions below the public ones do not record a
message at all: every failure there is a gpupool__error value filled for the caller
(gpupool__error_set, _take, _prefix), which the public entry point reports. The client's
transport (conn.c) and connecting (connect.c) are such files: a connection's failure, kept
with the connection, reaches the caller as a value, never through the thread's message.

Usage: errors.py [--check] [--values FILE]... FILE...
"""
import os
import argparse
import re
import sys

CALLS = re.compile(r"\b(gpupool__err|gpupool__errmsg|gpupool__error_report|gpupool__error_take)\s*\(")
DEF = re.compile(r"^[A-Za-z_][^;=]*?\b([A-Za-z_]\w*)\s*\(")


def strip(text):
    """text with comments and string/char literals blanked (line breaks kept)"""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + " " * (j - i - 1) + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def functions(path):
    """(name, first line, [lines of the body]) for each function defined in path"""
    lines = strip(open(path, encoding="utf-8").read()).split("\n")
    i = 0
    while i < len(lines):
        m = DEF.match(lines[i])
        if m and not lines[i].startswith(("typedef", "struct", "enum", "union", "#")):
            # The definition's head runs to a line ending in "{"; a declaration ends in ";".
            j = i
            while j < len(lines) and not lines[j].rstrip().endswith(("{", ";")) and lines[j].strip() != "}":
                j += 1
            if j < len(lines) and lines[j].rstrip().endswith("{") and "=" not in lines[i].split("(")[0]:
                k = j + 1
                while k < len(lines) and not lines[k].startswith("}"):
                    k += 1
                yield m.group(1), i + 1, lines[i:k + 1]
                i = k + 1
                continue
        i += 1


def public(name):
    return name.startswith("gpupool_") and not name.startswith("gpupool__")


KIND = {"gpupool__errmsg": "re-read", "gpupool__err": "record", "gpupool__error_report": "record",
        "gpupool__error_take": "take"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--values", action="append", default=[], metavar="FILE")
    ap.add_argument("files", nargs="*")
    a = ap.parse_args()
    values = {os.path.realpath(p) for p in a.values}
    below = {"re-read": 0, "record": 0, "take": 0}
    public_n = 0
    recorded = 0  # records below the public functions of a --values file
    for path in a.files + [p for p in a.values if p not in a.files]:
        in_values = os.path.realpath(path) in values
        for name, line, body in functions(path):
            for k, text in enumerate(body):
                for m in CALLS.finditer(text):
                    kind = KIND[m.group(1)]
                    if public(name):
                        public_n += 1
                        continue
                    below[kind] += 1
                    bad = kind == "re-read" or (in_values and kind == "record")
                    recorded += in_values and kind == "record"
                    if not a.check or bad:
                        print(f"{path}:{line + k}: {name}: {m.group(1)} ({kind})")
    print(f"below the public functions: {below['re-read']} re-reads of the thread's message "
          f"(gpupool__errmsg), {below['record']} records (gpupool__err), {below['take']} takes into a "
          f"value (gpupool__error_take); {public_n} calls in public functions", file=sys.stderr)
    if a.check and below["re-read"]:
        print("the thread's message is read above only by gpupool__error_take, at once, into a value "
              "(common/errors.h); pass the value up and report it in the public function",
              file=sys.stderr)
        return 1
    if a.check and recorded:
        print(f"{recorded} records below the public functions of a --values file: fill the caller's "
              "gpupool__error (gpupool__error_set) and let the public function report it",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
