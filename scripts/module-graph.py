#!/usr/bin/env python3
"""Import circles between sibling modules, in every crate and every directory module.

    scripts/module-graph.py [--dot]

Siblings are the modules of one directory (the crate root's `src/`, or a module's own
directory such as `serve/src/pipeline/`). Module `a` depends on its sibling `b` when a file of
`a` (its `a.rs`, or any file under `a/`) names `b` by its crate path (`crate::b`,
`crate::pipeline::b`, in a `use` or a path), or by `super::b` from a file directly beside it
(`super::super::b` from one level down). Unit test modules
(`*_tests.rs`, and everything after a `#[cfg(test)]` line) do not count: tests may reach
anywhere. Prints every circle (a strongly connected set of more than one module) per crate
and exits 1 when there is any; `--dot` prints the graphs in Graphviz syntax instead.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRATES = ["schema", "kvstore", "model", "retrieval", "remote", "ingest", "serve", "bench", "."]


def children(src, d):
    """Child module name of every non-test source file under module directory `d`."""
    out = {}
    for dirpath, _, files in os.walk(d):
        for f in files:
            if not f.endswith(".rs") or f.endswith("_tests.rs"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, d)
            first = rel.split(os.sep)[0]
            name = first[:-3] if first.endswith(".rs") else first
            # The directory's own module file is the parent, not a child.
            if name in ("lib", "main", "mod") and os.sep not in rel:
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


def graph(src, d):
    """Edges between the child modules of directory `d` (the crate root when `d` is `src`)."""
    files = children(src, d)
    names = set(files.values())
    edges = {n: set() for n in names}
    rel = os.path.relpath(d, src)
    # How a file anywhere in the crate names a child of `d`: crate::PATH::child.
    prefix = "crate::" if rel == "." else "crate::" + "::".join(rel.split(os.sep)) + "::"
    pat = re.escape(prefix)
    for path, mod in files.items():
        code = code_of(path)
        here = os.path.dirname(path)
        # `super::x` from a file directly in `d` is a sibling; from a file one level down
        # (`d/a/x.rs`), `super::super::x` is.
        ups = []
        if here == d:
            ups.append(r"(?<!::)\bsuper::")
        elif os.path.dirname(here) == d:
            ups.append(r"(?<!::)\bsuper::super::")
        for head in [pat] + ups:
            for m in re.finditer(head + r"(\w+)", code):
                dep = m.group(1)
                if dep in names and dep != mod:
                    edges[mod].add(dep)
            # `use crate::{a, b::c}` groups.
            for m in re.finditer(head + r"\{([^}]*)\}", code):
                for part in m.group(1).split(","):
                    dep = part.strip().split("::")[0]
                    if dep in names and dep != mod:
                        edges[mod].add(dep)
    return edges


def module_dirs(src):
    """The crate root and every directory module under it."""
    out = [src]
    for dirpath, dirs, _ in os.walk(src):
        for x in sorted(dirs):
            out.append(os.path.join(dirpath, x))
    return out


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
        crate_name = "ragkv" if crate == "." else crate
        for d in module_dirs(src):
            edges = graph(src, d)
            rel = os.path.relpath(d, src)
            name = crate_name if rel == "." else crate_name + "::" + "::".join(rel.split(os.sep))
            if dot:
                if any(edges.values()):
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
