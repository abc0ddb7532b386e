#!/usr/bin/env python3
"""Fails when two or more source files of a crate import each other, directly or in a circle.

Why: a circle means no file of it can be read, tested or changed on its own; every piece
should sit below the files that use it.

The rule. Each crate root (src/lib.rs, src/main.rs, src/bin/*.rs) is walked through its
`mod` declarations (`foo.rs` or `foo/mod.rs`, nested modules, `#[path]`, every `#[cfg]`
branch); an inline `mod x { ... }` (such as `#[cfg(test)] mod tests`) is part of its file.
File A has an edge to file B when code in A (comments and strings do not count) names an
item of B:
  * a `use` path (`use crate::a::B`, `use super::B`, `use self::child::B`, `use child::B`);
  * a path in code (`crate::a::b()`, `super::X`, `child::Y::new()`).
A path is resolved to the file that defines the item: through modules, and through `use`
re-exports (`crate::Error` re-exported by lib.rs from error.rs is an edge to error.rs, not
to lib.rs).

The module tree itself is not an import: a file and the files of its own ancestor modules
(lib.rs or a mod.rs and the children it declares, at any depth) are one unit, so edges
between them are not counted: a parent declaring, re-exporting and dispatching to its
children, and children using the items their parent file defines for them, is how a Rust
module is built. Every other edge counts, so a child of A importing B while B imports A is
still a circle. `--strict` counts the edges between a file and its ancestors too (then only
a parent re-exporting its descendants with `pub use` is exempt).

Skipped: tests/, benches/, examples/, fuzz/ and target/ (they sit on top of a crate's
library and are not part of its module tree).

Usage: python3 ops/check-import-cycles.py [--strict] [--edges] [repo root]
Exit status 1 when there is a cycle, with one chain of `file:line` steps per cycle (the line
of the first import of the next file); `--edges` also prints every edge.
"""

import os
import re
import sys
from collections import defaultdict, deque

SKIP_DIRS = {"tests", "benches", "examples", "fuzz", "target", ".git"}
IDENT = r"(?:r#)?[A-Za-z_][A-Za-z0-9_]*"


def strip_code(text):
    """The text with comments, strings and char literals blanked (newlines kept for line numbers)."""
    out = []
    i, n = 0, len(text)

    def blank(s):
        return "".join("\n" if c == "\n" else " " for c in s)

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(blank(text[i:j]))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(blank(text[i:j]))
            i = j
        elif re.match(r'b?r#*"', text[i : i + 40]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'b?r(#*)"', text[i:])
            end = '"' + m.group(1)
            j = text.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append(blank(text[i:j]))
            i = j
        elif c == '"' or (c == "b" and text.startswith('b"', i) and (i == 0 or not text[i - 1].isalnum())):
            j = i + (2 if c == "b" else 1)
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j += 1
            out.append(blank(text[i:j]))
            i = j
        elif c == "'":
            # A char literal ('a', '\n', '\u{1F600}') or a lifetime ('a): only the former is blanked.
            m = re.match(r"'(?:\\(?:u\{[0-9a-fA-F]+\}|x[0-9a-fA-F]{2}|.)|[^\\'])'", text[i:])
            if m:
                out.append(blank(m.group(0)))
                i += m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


class Module:
    def __init__(self, path, file, parent):
        self.path = path  # tuple of names from the crate root
        self.file = file
        self.parent = parent
        self.children = {}  # name -> Module
        self.uses = {}  # name -> (segments, line, is_pub)
        self.globs = []  # (segments, line, is_pub)


def split_use_tree(tree):
    """Leaves of a use tree: (segments, alias or None, is_glob)."""
    tree = re.sub(r"\s+", "", re.sub(r"\s+as\s+", "@", tree))
    leaves = []

    def split_top(body):
        parts, depth, cur = [], 0, ""
        for ch in body:
            depth += {"{": 1, "}": -1}.get(ch, 0)
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        parts.append(cur)
        return parts

    def walk(prefix, s):
        if "{" in s:
            head, _, rest = s.partition("{")
            head_segs = [x for x in head.split("::") if x]
            for part in split_top(rest[: rest.rfind("}")]):
                if part:
                    walk(prefix + head_segs, part)
            return
        s, _, alias = s.partition("@")
        segs = [x for x in s.split("::") if x]
        if segs and segs[-1] == "*":
            leaves.append((prefix + segs[:-1], None, True))
        elif segs and segs[-1] == "self":
            leaves.append((prefix + segs[:-1], alias or None, False))
        else:
            leaves.append((prefix + segs, alias or None, False))

    walk([], tree)
    return leaves


class Crate:
    def __init__(self, root_file, repo):
        self.repo = repo
        self.root = Module((), root_file, None)
        self.files = {}  # file -> list of (module, start, end) spans; file's own module first
        self.refs = []  # (file, line, module, segments, kind) kind: 'use', 'pub use', 'path'
        self.load(self.root, root_file, is_mod_rs=True)

    def load(self, module, file, is_mod_rs):
        with open(file, encoding="utf-8") as f:
            code = strip_code(f.read())
        self.files[file] = module
        base = os.path.dirname(file) if is_mod_rs else os.path.join(os.path.dirname(file), os.path.splitext(os.path.basename(file))[0])
        self.scan(module, file, code, base)

    def scan(self, module, file, code, base):
        """Reads `mod` declarations, inline modules, uses and paths of one file."""
        line_of = lambda pos: code.count("\n", 0, pos) + 1  # noqa: E731
        stack = [(module, base, -1)]  # (module, directory for its child files, brace depth it opened at)
        depth = 0
        pos = 0
        token = re.compile(
            r"(?P<attr>#\s*\[\s*path\s*=\s*)|(?P<mod>\bmod\s+(?P<name>" + IDENT + r")\s*(?P<end>[;{]))"
            r"|(?P<use>\b(?P<pub>pub(?:\s*\([^)]*\))?\s+)?use\s+(?P<tree>[^;]*);)"
            r"|(?P<open>\{)|(?P<close>\})"
            r"|(?P<path>(?<![A-Za-z0-9_:])(?:\$?crate|super|self|" + IDENT + r")(?:\s*::\s*(?:" + IDENT + r"))+)"
        )
        pending_path = None
        for m in token.finditer(code):
            current, cur_base, _ = stack[-1]
            if m.group("attr"):
                # The #[path] value is in a string, which strip_code blanked: read it from the raw file.
                with open(file, encoding="utf-8") as f:
                    raw = f.read()
                pm = re.match(r'#\s*\[\s*path\s*=\s*"([^"]*)"', raw[m.start() :])
                pending_path = pm.group(1) if pm else None
            elif m.group("mod"):
                name = m.group("name").removeprefix("r#")
                if m.group("end") == ";":
                    if pending_path:
                        child_file = os.path.normpath(os.path.join(os.path.dirname(file) if cur_base == base else cur_base, pending_path))
                        child_is_mod_rs = os.path.basename(child_file) == "mod.rs"
                    else:
                        child_file = os.path.join(cur_base, name + ".rs")
                        child_is_mod_rs = False
                        if not os.path.exists(child_file):
                            child_file = os.path.join(cur_base, name, "mod.rs")
                            child_is_mod_rs = True
                    pending_path = None
                    if not os.path.exists(child_file):
                        print(f"warning: {self.rel(file)}:{line_of(m.start())}: no file for mod {name}", file=sys.stderr)
                        continue
                    child = Module(current.path + (name,), child_file, current)
                    current.children[name] = child
                    self.load(child, child_file, child_is_mod_rs)
                else:
                    pending_path = None
                    child = Module(current.path + (name,), file, current)
                    current.children[name] = child
                    depth += 1
                    stack.append((child, os.path.join(cur_base, name), depth))
            elif m.group("use"):
                is_pub = bool(m.group("pub"))
                line = line_of(m.start())
                for segs, alias, glob in split_use_tree(m.group("tree")):
                    segs = [s.removeprefix("r#") for s in segs]
                    if not segs:
                        continue
                    if glob:
                        current.globs.append((segs, line, is_pub))
                    else:
                        current.uses[alias or segs[-1]] = (segs, line, is_pub)
                    self.refs.append((file, line, current, segs, "pub use" if is_pub else "use"))
            elif m.group("open"):
                depth += 1
            elif m.group("close"):
                if stack[-1][2] == depth:
                    stack.pop()
                depth -= 1
            elif m.group("path"):
                segs = [s.strip().removeprefix("r#") for s in m.group("path").split("::")]
                self.refs.append((file, line_of(m.start()), current, segs, "path"))

    def rel(self, file):
        return os.path.relpath(file, self.repo)

    def resolve(self, module, segs, hops=0):
        """The module a path lands in (the last module it passes through, re-exports followed),
        or None when it leaves the crate."""
        if hops > 16 or not segs:
            return None
        first, rest = segs[0], list(segs[1:])
        if first in ("crate", "$crate"):
            mod = self.root
        elif first == "super":
            mod = module.parent
        elif first == "self":
            mod = module
        elif first in module.children:
            mod, rest = module.children[first], rest
        elif first in module.uses:
            target, _, _ = module.uses[first]
            if target == segs[: len(target)] and len(target) == 1:
                return None  # `use foo;` of an extern crate
            return self.resolve(module, list(target) + rest, hops + 1)
        else:
            return None
        if mod is None:
            return None
        while rest:
            seg = rest[0]
            if seg == "super" and mod.parent is not None:
                mod, rest = mod.parent, rest[1:]
            elif seg == "self":
                rest = rest[1:]
            elif seg in mod.children:
                mod, rest = mod.children[seg], rest[1:]
            elif seg in mod.uses:
                target, _, _ = mod.uses[seg]
                found = self.resolve(mod, list(target) + rest[1:], hops + 1)
                return found if found is not None else mod
            else:
                break
        return mod

    def edges(self, strict=False):
        """{(from file, to file): first line in the from file}."""
        found = {}
        for file, line, module, segs, kind in self.refs:
            target = self.resolve(module, segs)
            if target is None or target.file == file:
                continue
            own, other = self.files[file], self.files[target.file]
            if kind == "pub use" and other.path[: len(own.path)] == own.path:
                continue  # re-exporting a descendant: the module tree, not a dependency
            if not strict and (other.path[: len(own.path)] == own.path or own.path[: len(other.path)] == other.path):
                continue  # between a file and its ancestor's file: the module tree
            key = (file, target.file)
            if key not in found or line < found[key]:
                found[key] = line
        return found


def crate_roots(repo):
    roots = []
    for dirpath, dirnames, filenames in os.walk(repo):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        if "Cargo.toml" in filenames:
            src = os.path.join(dirpath, "src")
            for name in ("lib.rs", "main.rs"):
                if os.path.isfile(os.path.join(src, name)):
                    roots.append(os.path.join(src, name))
            bins = os.path.join(src, "bin")
            if os.path.isdir(bins):
                for name in sorted(os.listdir(bins)):
                    if name.endswith(".rs"):
                        roots.append(os.path.join(bins, name))
    return roots


def cycles(graph):
    """Strongly connected components of more than one file, each as the shortest cycles that
    together pass through every file of the component."""
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]

    def strong(v):
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    advanced = True
                    break
                elif w in on:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    result = []
    for comp in comps:
        members = set(comp)
        chains, seen = [], set()
        for start in comp:
            # Shortest way back to `start` within the component.
            prev, queue = {start: None}, deque([start])
            chain = None
            while queue and chain is None:
                v = queue.popleft()
                for w in sorted(graph.get(v, ())):
                    if w not in members:
                        continue
                    if w == start:
                        chain = [v]
                        while prev[chain[-1]] is not None:
                            chain.append(prev[chain[-1]])
                        chain.reverse()
                        break
                    if w not in prev:
                        prev[w] = v
                        queue.append(w)
            if chain:
                k = min(range(len(chain)), key=lambda i: chain[i])
                canon = tuple(chain[k:] + chain[:k])
                if canon not in seen:
                    seen.add(canon)
                    chains.append(list(canon))
        result.append((comp, chains))
    return result


def main():
    args = sys.argv[1:]
    strict = "--strict" in args
    show_edges = "--edges" in args
    rest = [a for a in args if not a.startswith("--")]
    repo = os.path.abspath(rest[0] if rest else os.path.join(os.path.dirname(__file__), ".."))
    failed = 0
    for root in crate_roots(repo):
        crate = Crate(root, repo)
        rel = crate.rel
        edges = crate.edges(strict)
        graph = defaultdict(set)
        for a, b in sorted(edges):
            graph[a].add(b)
            if show_edges:
                print(f"{rel(a)}:{edges[(a, b)]} -> {rel(b)}")
        for comp, chains in cycles(graph):
            failed += 1
            print(f"import cycle among {len(comp)} files of {rel(root)}: {', '.join(rel(f) for f in comp)}")
            for chain in chains:
                steps = [f"{rel(a)}:{edges[(a, b)]}" for a, b in zip(chain, chain[1:] + chain[:1])]
                print("  " + " -> ".join(steps) + f" -> {rel(chain[0])}")
    if failed:
        print(f"{failed} import cycle(s); move the shared piece into a module below the files that use it", file=sys.stderr)
        return 1
    print("no import cycle between source files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
