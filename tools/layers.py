#!/usr/bin/env python3
"""The daemon's layers, read from its object files, and the rule that keeps them.

Each object file of daemon/ defines some global symbols and uses others (`nm`): a file that
uses a symbol another file defines calls that file. From those edges this reports the pairs
of files tied together, the calls that run against the layers, the circles (strongly
connected sets of files) and, with --check, fails when a call runs up a layer or a circle of
more than two files exists.

Layers, top to bottom (a file's layer is its folder under daemon/; a call may go to its own
layer or any layer below, never above):

  main.c    (daemon/ itself) the command line, signals, the start of everything below;
            config_wait.c, the life with an invalid configuration
  server/   in its own order, top to bottom: listen, conn (bytes, frames, fairness),
            dispatch, the handlers and waiters, replies, then fences and send (sending)
  peers/    other gpupoolds, beside the handlers: use the registry. Inside, top to bottom:
            peers.c (start, stop), fetching and serving, the link and the stager, UCX
  replicas/ copies of a version on other devices, beside the handlers: use the registry
  registry/ names, bundles, holds, slabs, leases, tenants, files
  service/  config, metrics, systemd: what every layer above may use; they reach up only
            through callbacks they are given

Usage: layers.py [--check] [--verbose] [--flat] OBJECT...   (object files or directories of
the gpupoold_core and gpupoold targets of a build, e.g. build/release/daemon/CMakeFiles)
"""
import argparse
import os
import subprocess
import sys

# Folder (or, for files still at daemon/'s top, file stem) -> layer rank: higher is above.
RANK = {"main": 50, "server": 40, "peers": 30, "replicas": 30, "registry": 20, "service": 10}
LAYER_OF_FOLDER = {"service": "service", "server": "server", "peers": "peers",
                   "registry": "registry", "replicas": "replicas"}
TARGETS = ("gpupoold_core.dir", "gpupoold.dir")
# Inside server/, the order requests take (a stem not listed is a handler's rank).
SERVER_RANK = {"listen": 46, "conn": 45, "dispatch": 44, "replies": 42, "fences": 41,
               "send": 41}
SERVER_HANDLERS = 43
PEERS_RANK = {"peers": 34, "peers_fetch": 33, "peers_serve": 33, "peers_link": 32,
              "peers_stage": 32, "peers_ucx": 31, "peers_prefault": 31}


def objects(paths):
    out = []
    for p in paths:
        if os.path.isdir(p):
            for root, _, files in os.walk(p):
                out += [os.path.join(root, f) for f in files if f.endswith(".o")]
        else:
            out.append(p)
    return sorted(o for o in out if unit_name(o))


def unit_name(path):
    """.../gpupoold_core.dir/registry/names.c.o -> registry/names.c; None outside the daemon"""
    for t in TARGETS:
        i = path.find(os.sep + t + os.sep)
        if i >= 0:
            rel = path[i + len(t) + 2:]
            return rel[:-2] if rel.endswith(".o") else rel
    return None


def symbols(obj):
    res = subprocess.run(["nm", "-g", obj], capture_output=True, text=True, check=True)
    defined, used = set(), set()
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "U":
            used.add(parts[1])
        elif len(parts) == 3 and parts[1] in "TDBRCVW":
            defined.add(parts[2])
    return defined, used


# Where each file of the flat daemon/ of before the folders belongs: lets the same counts be
# taken of an old tree (--flat).
FLAT = {"main": "main", "config": "service", "metrics": "service", "sd": "service",
        "listen": "server", "conn": "server", "dispatch": "server", "fences": "server",
        "handlers_admin": "server", "handlers_buffers": "server", "handlers_files": "server",
        "handlers_parts": "server", "replies": "server", "waiters": "server",
        "peers": "peers", "peers_link": "peers", "peers_fetch": "peers", "peers_serve": "peers",
        "peers_stage": "peers", "peers_ucx": "peers", "replicas": "replicas",
        "registry": "registry", "leases": "registry", "slabs": "registry",
        "holds": "registry", "tenants": "registry", "names": "registry",
        "bundles": "registry", "parts": "registry", "files": "registry",
        "fileops": "registry"}
USE_FLAT = False


def layer(unit):
    if "/" in unit:
        return LAYER_OF_FOLDER.get(unit.split("/", 1)[0])
    if USE_FLAT:
        return FLAT.get(unit.split(".", 1)[0])
    return "main"  # daemon/ itself: main.c and what only it uses


def rank(unit):
    name = layer(unit)
    stem = os.path.basename(unit).split(".", 1)[0]
    if name == "server":
        return SERVER_RANK.get(stem, SERVER_HANDLERS)
    if name == "peers":
        return PEERS_RANK.get(stem, RANK[name])
    return RANK[name]


def sccs(nodes, edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def has_long_circle(comp, edges):
    """Whether a strongly connected set of files holds a circle of more than two files. It
    holds none exactly when every call inside it is answered by one back (a one-way call
    u -> v closes a longer circle through the way back from v to u) and its pairs form a
    tree (a cycle of pairs is a longer circle)."""
    inside = set(comp)
    pairs = set()
    for u in comp:
        for v in edges.get(u, ()):
            if v in inside:
                if u not in edges.get(v, ()):
                    return True
                pairs.add(tuple(sorted((u, v))))
    return len(pairs) != len(comp) - 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="fail on an upward call or a circle of more than two files")
    ap.add_argument("--verbose", action="store_true", help="list every edge")
    ap.add_argument("--flat", action="store_true",
                    help="place files of a flat daemon/ (before the layer folders) by name")
    ap.add_argument("dirs", nargs="+")
    args = ap.parse_args()
    global USE_FLAT
    USE_FLAT = args.flat
    defs, uses = {}, {}
    for obj in objects([os.path.abspath(d) for d in args.dirs]):
        u = unit_name(obj)
        defs[u], uses[u] = symbols(obj)
    owner = {}
    for u, ds in defs.items():
        for s in ds:
            owner[s] = u
    edges, why = {}, {}
    for u, us in uses.items():
        for s in us:
            v = owner.get(s)
            if v and v != u:
                edges.setdefault(u, set()).add(v)
                why.setdefault((u, v), []).append(s)
    units = sorted(defs)
    n = len(units)
    pairs = set()
    for u, vs in edges.items():
        for v in vs:
            pairs.add(tuple(sorted((u, v))))
    both = [p for p in pairs if p[1] in edges.get(p[0], ()) and p[0] in edges.get(p[1], ())]
    upward = []
    for (u, v), syms in sorted(why.items()):
        lu, lv = layer(u), layer(v)
        if lu and lv and rank(u) < rank(v):
            upward.append((u, v, sorted(syms)))
    circles = [c for c in sccs(units, edges) if len(c) > 1]

    print(f"files: {n}; pairs tied (a call either way): {len(pairs)} of {n * (n - 1) // 2}; "
          f"pairs calling each other both ways: {len(both)}; "
          f"calls: {sum(len(v) for v in edges.values())}")
    print(f"upward calls (file -> file of a higher layer): {len(upward)}")
    for u, v, syms in upward:
        print(f"  {u} -> {v}: {', '.join(syms)}")
    big = [c for c in circles if has_long_circle(c, edges)]
    print(f"strongly connected sets: {len(circles)} ({sum(len(c) for c in circles)} files), "
          f"holding a circle of more than two files: {len(big)}")
    for c in circles:
        print(f"  [{len(c)}] {' '.join(c)}")
    unplaced = [u for u in units if not layer(u)]
    if unplaced:
        print(f"files in no layer's folder: {len(unplaced)}: {' '.join(unplaced)}")
    if args.verbose:
        for (u, v), syms in sorted(why.items()):
            print(f"  {u} -> {v}: {', '.join(sorted(syms))}")
    if args.check:
        bad = []
        if upward:
            bad.append(f"{len(upward)} upward call(s): news goes up through a callback or an "
                       "event list the layer above drains, never a call")
        if big:
            bad.append(f"{len(big)} circle(s) of more than two files: move the shared part "
                       "down a layer, or report up through a callback")
        if unplaced:
            bad.append(f"{len(unplaced)} file(s) outside the layer folders: put each in its "
                       "layer's folder (docs/ARCHITECTURE.md)")
        if not units:
            bad.append("no object files found: pass the daemon's object directories")
        if bad:
            for b in bad:
                print(f"layers.py: {b}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
