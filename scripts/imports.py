#!/usr/bin/env python3
"""The import graph of a crate's files, from their paths (`crate::`, `super::`, `self::`,
a child module's name in `use`), and any loop in it.

    python3 scripts/imports.py crates/tensor/src          # each file's imports, then loops
    python3 scripts/imports.py --check crates/*/src       # exit 1 if any crate has a loop

A name that `lib.rs` re-exports (or a `#[macro_export]` macro) counts as an import of the
file that defines it. Comments and string literals are ignored; `super` inside an inline
module (`mod tests { .. }`) names the file's own module.
"""
import collections
import glob
import os
import re
import sys


def modpath(root, f):
    parts = os.path.relpath(f, root)[:-3].split('/')
    if parts[-1] in ('mod', 'lib'):
        parts = parts[:-1]
    return tuple(parts)


def strip(txt):
    txt = re.sub(r'r(#+)".*?"\1', '""', txt, flags=re.S)
    txt = re.sub(r'r"[^"]*"', '""', txt)
    txt = re.sub(r"'(\\.|[^'\\\n])'", "' '", txt)
    txt = re.sub(r'"(\\.|[^"\\])*"', '""', txt)
    return re.sub(r'//[^\n]*', '', txt)


def graph(root):
    files = glob.glob(root + '/**/*.rs', recursive=True)
    mods = {modpath(root, f): f for f in files}
    reexp = {}
    lib = open(os.path.join(root, 'lib.rs')).read()
    for m in re.finditer(r'pub use ([a-z_:]+)::\{([^}]*)\};|pub use ([a-z_:]+)::([A-Za-z_]+);', lib):
        if m.group(1):
            for n in (x.strip() for x in m.group(2).split(',')):
                if n:
                    reexp[n] = m.group(1).split('::')
        else:
            reexp[m.group(4)] = m.group(3).split('::')
    for f in files:
        for m in re.finditer(r'#\[macro_export\][^\n]*\n(?:#\[[^\n]*\n)*macro_rules!\s*(\w+)', open(f).read()):
            reexp[m.group(1)] = list(modpath(root, f))

    def resolve(path):
        for i in range(len(path), 0, -1):
            if tuple(path[:i]) in mods:
                return tuple(path[:i])
        return ()

    edges = collections.defaultdict(set)
    token = re.compile(r'\bmod\s+\w+\s*\{|\{|\}|\b(crate|super|self)((?:::\w+)+|::\{[^}]*\})')
    for f in files:
        cur = modpath(root, f)
        txt = strip(open(f).read())
        inline, depth = [], 0
        for m in token.finditer(txt):
            t = m.group(0)
            if t.startswith('mod'):
                depth += 1
                inline.append(depth)
                continue
            if t == '{':
                depth += 1
                continue
            if t == '}':
                if inline and inline[-1] == depth:
                    inline.pop()
                depth -= 1
                continue
            kind, rest = m.group(1), m.group(2)
            paths = [s.strip().split('::') for s in rest[3:-1].split(',') if s.strip()] if rest.startswith('::{') else [rest[2:].split('::')]
            for segs in paths:
                if kind == 'crate':
                    base = []
                    if segs[0] in reexp:
                        segs = reexp[segs[0]] + segs[1:]
                elif kind == 'self' or inline:
                    base = list(cur)
                else:
                    base = list(cur[:-1])
                target = resolve(base + segs)
                if target != cur and target in mods:
                    edges[cur].add(target)
        for m in re.finditer(r'\buse\s+(?:\{\s*)?([a-z_]\w*)::', txt):
            child = cur + (m.group(1),)
            if child in mods:
                edges[cur].add(child)
    return mods, edges


def loops(mods, edges):
    index, low, stack, on, found, n = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
                found.append(comp)

    for v in sorted(mods):
        if v not in index:
            visit(v)
    return found


def name(t):
    return '/'.join(t) or 'lib'


def main(args):
    check = '--check' in args
    bad = False
    for root in [a for a in args if a != '--check']:
        mods, edges = graph(root)
        found = loops(mods, edges)
        bad |= bool(found)
        if not check:
            for v in sorted(mods):
                print(f"{name(v):28} -> {', '.join(sorted(name(t) for t in edges[v]))}")
        print(f"{root}: {len(mods)} files, " + ('no import loop' if not found else 'loops: ' + '; '.join(' <-> '.join(sorted(map(name, c))) for c in found)))
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
