#!/usr/bin/env python3
"""Import circles between the top-level modules of each crate.

    scripts/module-graph.py [--dot]

A module `a` depends on `b` when a file of `a` (its `a.rs`, or any file under `a/`) names
`crate::b` (in a `use` or a path) or `super::b` from a top-level file. Unit test modules
(`*_tests.rs`, and everything after a `#[cfg(test)]` line) do not count: tests may reach
anywhere. Prints every circle (a strongly connected set of more than one module) per crate
and exits 1 when there is any; `--dot` prints the graphs in Graphviz syntax instead.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRATES = ["schema", "kvstore", "model", "retrieval", "remote", "ingest", "serve", "bench", "."]


def top_modules(src):
    """Top-level module name of every non-test source file under `src`."""
    out = {}
    for dirpath, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs") or f.endswith("_tests.rs"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, src)
            first = rel.split(os.sep)[0]
            name = first[:-3] if first.endswith(".rs") else first
            if name in ("lib", "main"):
                continue
            out[path] = name
    return out


def code_of(path):
    """The file's text up to its first `#[cfg(test)]` (unit tests do not count)."""
    text = open(path, encoding="utf-8").read()
    cut = text.find("#[cfg(test)]")
    text = text if cut < 0 else text[:cut]
    # Comments name modules too ("see crate::x"): drop them.
    return re.sub(r"//[^\n]*", "", text)


def graph(src):
    files = top_modules(src)
    names = set(files.values())
    edges = {n: set() for n in names}
    for path, mod in files.items():
        code = code_of(path)
        for m in re.finditer(r"\bcrate::(\w+)", code):
            dep = m.group(1)
            if dep in names and dep != mod:
                edges[mod].add(dep)
        # `super::x` from a top-level file is the crate root's module x.
        if os.path.dirname(path) == src:
            for m in re.finditer(r"\bsuper::(\w+)", code):
                dep = m.group(1)
                if dep in names and dep != mod:
                    edges[mod].add(dep)
        # `use crate::{a, b::c}` groups.
        for m in re.finditer(r"\bcrate::\{([^}]*)\}", code):
            for part in m.group(1).split(","):
                dep = part.strip().split("::")[0]
                if dep in names and dep != mod:
                    edges[mod].add(dep)
    return edges


def circles(edges):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
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
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main():
    dot = "--dot" in sys.argv[1:]
    found = 0
    for crate in CRATES:
        src = os.path.join(ROOT, crate, "src")
        if not os.path.isdir(src):
            continue
        edges = graph(src)
        name = "ragkv" if crate == "." else crate
        if dot:
            print(f'digraph "{name}" {{')
            for a in sorted(edges):
                for b in sorted(edges[a]):
                    print(f'  "{a}" -> "{b}";')
            print("}")
            continue
        for comp in circles(edges):
            found += 1
            inner = {a: sorted(b for b in edges[a] if b in comp) for a in comp}
            desc = "; ".join(f"{a} -> {', '.join(bs)}" for a, bs in inner.items())
            print(f"{name}: circle of {len(comp)} modules: {desc}")
    if not dot:
        print(f"{found} import circle(s)" if found else "no import circles")
    sys.exit(1 if found and not dot else 0)


if __name__ == "__main__":
    main()
