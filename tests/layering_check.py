#!/usr/bin/env python3
"""keel's include graph follows its floor plan: each folder of include/keel
is one room, and a header includes only from its own folder or the folders
below it in the tree (ALLOWED, drawn in docs/architecture.md). A folder's
`internal/` subfolder is part of it. No include cycle exists. Run by the
`layering` test (tests/CMakeLists.txt):

    python3 tests/layering_check.py include/keel
"""
import os
import re
import sys

# What each folder may include, itself included. A tree, not a line:
# provider (adapters for real clients) and durable (state that outlives a
# process) are siblings on compose; asio runs pipelines over provider;
# store implements durable's contracts; fleet is pipeline policies that
# need a store.
BELOW = {
    "core": [],
    "policy": ["core"],
    "compose": ["policy"],
    "provider": ["compose"],
    "asio": ["provider"],
    "durable": ["compose"],
    "observe": ["durable"],
    "store": ["durable"],
    "fleet": ["store"],
    "testing": ["observe", "store", "provider"],
}


def reachable(folder):
    seen = {folder}
    todo = [folder]
    while todo:
        for b in BELOW[todo.pop()]:
            if b not in seen:
                seen.add(b)
                todo.append(b)
    return seen


ALLOWED = {f: reachable(f) for f in BELOW}
# The umbrella: what needs no client library of its own.
ALLOWED["keel.hpp"] = {"core", "policy", "compose", "provider", "durable", "observe"}
INCLUDE = re.compile(r'^\s*#\s*include\s+"keel/([^"]+)"', re.M)


def folder_of(rel):
    parts = rel.split("/")
    if len(parts) == 1:
        return rel if rel == "keel.hpp" else None
    return parts[0] if parts[0] in BELOW else None


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
        mine = folder_of(rel)
        if mine is None:
            errors.append(f"{rel}: not in a folder of the floor plan ({', '.join(BELOW)})")
            continue
        for d in deps:
            if d not in graph:
                errors.append(f"{rel}: includes keel/{d}, which does not exist")
                continue
            theirs = folder_of(d)
            if theirs is None:
                continue  # reported on its own line
            if theirs not in ALLOWED[mine]:
                errors.append(f"{rel} ({mine}/) includes keel/{d} ({theirs}/), which is not below it")
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
