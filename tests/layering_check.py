#!/usr/bin/env python3
"""keel's include graph reads as layers: each folder of include/keel is one
layer, a header includes only from its own layer or those below it, and no
include cycle exists. Run by the `layering` test (tests/CMakeLists.txt):

    python3 tests/layering_check.py include/keel
"""
import os
import re
import sys

# Bottom to top. detail/ holds internals: each is pinned to the lowest layer
# that uses it, so it may include only from that layer or below.
LAYERS = ["core", "policy", "compose", "provider", "asio", "durable", "observe", "store", "testing"]
DETAIL = {
    "boundary": "core",
    "thread_slot": "core",
    "short_key": "policy",
    "keyed_table": "policy",
    "client_pool": "store",
    "pg_connection": "store",
    "pg_store": "store",
    "redis_connection": "store",
    "redis_scripts": "store",
    "sqlite_db": "store",
    "stored_record": "durable",
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"keel/([^"]+)"', re.M)


def layer_of(rel):
    parts = rel.split("/")
    if len(parts) == 1:
        return "umbrella" if rel == "keel.hpp" else None
    if parts[0] == "detail":
        return DETAIL.get(os.path.splitext(parts[1])[0])
    return parts[0] if parts[0] in LAYERS else None


def rank(layer):
    return len(LAYERS) if layer == "umbrella" else LAYERS.index(layer)


def main(root):
    errors = []
    graph = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            if not n.endswith(".hpp"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, n), root).replace(os.sep, "/")
            with open(os.path.join(dirpath, n), encoding="utf-8") as f:
                graph[rel] = INCLUDE.findall(f.read())
    for rel, deps in sorted(graph.items()):
        mine = layer_of(rel)
        if mine is None:
            errors.append(f"{rel}: not in a layer folder ({', '.join(LAYERS)}, detail/ pinned in this script)")
            continue
        for d in deps:
            if d not in graph:
                errors.append(f"{rel}: includes keel/{d}, which does not exist")
                continue
            theirs = layer_of(d)
            if theirs is None:
                continue  # reported on its own line
            if rank(theirs) > rank(mine):
                errors.append(f"{rel} ({mine}) includes keel/{d} ({theirs}), a higher layer")
    # cycles: depth-first search
    state = {}

    def visit(node, stack):
        state[node] = 1
        for d in graph.get(node, []):
            if d not in graph:
                continue
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d] if d in stack else [node, d]
                errors.append("include cycle: " + " -> ".join(cycle))
            elif state.get(d) is None:
                visit(d, stack + [d])
        state[node] = 2

    for node in sorted(graph):
        if state.get(node) is None:
            visit(node, [node])
    for e in errors:
        print(e)
    print(f"layering: {len(graph)} headers, {len(errors)} problems")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "include/keel"))
