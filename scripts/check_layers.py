"""Import circles between files: fails (exit 1) if any file of a tree reaches itself through
imports, and prints each circle. The crate root (`lib.rs`: re-exports and generated wire
messages) is not a node. Rust: `use crate::`/`super::`/`self::` statements and inline
`crate::a::b` paths, resolved to the file that defines the module; Python: `flightshuffle.x` (and `flightshuffle_bench.x`)
imports between the package's modules. Test-only files (`tests.rs`, `#[cfg(test)]` blocks at
the end of a file) are left out: tests may reach anywhere.

    python scripts/check_layers.py [--verbose]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUST_TREES = ["exchange/src", "engines/datafusion/src", "python/src"]
PY_PACKAGES = {
    "python/flightshuffle": "flightshuffle",
    "bench/flightshuffle_bench": "flightshuffle_bench",
}

USE = re.compile(r"\buse\s+((?:crate|super|self)\b[^;]*);", re.DOTALL)
INLINE = re.compile(r"\b((?:crate|super)(?:::[A-Za-z_][A-Za-z0-9_]*)+)")


def strip(text: str) -> str:
    """The file without comments, strings, and its trailing `#[cfg(test)] mod ...` block."""
    cut = re.search(r"\n#\[cfg\(test\)\]\s*\n\s*mod\s+\w+\s*\{", text)
    if cut:
        text = text[: cut.start()]
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def expand(path: str) -> list[str]:
    """`a::{b, c::{d, e}}` as `a::b`, `a::c::d`, `a::c::e`."""
    path = re.sub(r"\s+", "", path)
    i = path.find("{")
    if i < 0:
        return [path.split(" as ")[0]]
    head, body = path[:i], path[i + 1 : path.rfind("}")]
    parts, depth, cur = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    if cur:
        parts.append(cur)
    return [x for p in parts if p for x in expand(head + p)]


def module_of(tree: Path, file: Path) -> list[str]:
    rel = file.relative_to(tree).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return parts


def rust_graph(tree: Path) -> dict[str, set[str]]:
    files = {
        tuple(module_of(tree, f)): f
        for f in tree.rglob("*.rs")
        if f.name != "tests.rs" and "bin" not in f.relative_to(tree).parts
    }
    graph: dict[str, set[str]] = {}
    for mod, f in files.items():
        text = strip(f.read_text())
        paths = [p for u in USE.findall(text) for p in expand(u)] + INLINE.findall(text)
        # paths through this file's own child modules (`mod pull;` ... `pull::Mapped`)
        children = re.findall(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", text, re.MULTILINE)
        for child in children:
            pat = rf"(?<![\w:])((?:use\s+)?{child}(?:::[A-Za-z_{{][^;\s]*)+)"
            for m in re.findall(pat, text):
                m = m.removeprefix("use").strip()
                paths += ["self::" + e for e in expand(m)]
        out = graph.setdefault(str(f.relative_to(ROOT)), set())
        for p in paths:
            segs = p.split("::")
            if segs[0] == "crate":
                base: list[str] = []
            else:
                base = list(mod)
                # `super` is the parent module, `self` this one
                while segs and segs[0] in ("super", "self"):
                    if segs[0] == "super":
                        base = base[:-1]
                    segs = segs[1:]
                segs = ["crate", *segs]
            target = base + [s for s in segs[1:] if s != "*"]
            # the longest prefix that is a file
            for n in range(len(target), -1, -1):
                key = tuple(target[:n])
                if key in files:
                    # the crate root is the crate's public face (its re-exports) and holds the
                    # generated wire messages: not a layer of its own
                    if key != mod and key != ():
                        out.add(str(files[key].relative_to(ROOT)))
                    break
    return graph


def py_graph(pkg: Path, package: str) -> dict[str, set[str]]:
    """Imports between the package's modules; `if TYPE_CHECKING:` blocks (never executed) are
    left out, and `from flightshuffle import mod` imports the module `mod`, not the package."""
    mods = {f.stem: f for f in pkg.glob("*.py")}
    graph: dict[str, set[str]] = {}
    pat = re.compile(
        rf"^\s*(?:from\s+{package}(?:\.(\w+))?\s+import\s+(\([^)]*\)|[\w, ]+)"
        rf"|import\s+{package}\.(\w+))",
        re.MULTILINE,
    )
    for name, f in mods.items():
        text = re.sub(
            r"^if TYPE_CHECKING:\n(?:[ \t]+[^\n]*\n|\n)+", "", f.read_text(), flags=re.MULTILINE
        )
        out = graph.setdefault(str(f.relative_to(ROOT)), set())
        for sub, names, imp in pat.findall(text):
            if sub or imp:
                targets = [sub or imp]
            else:
                listed = re.findall(r"\w+", re.sub(r"\bas\s+\w+", "", names))
                targets = [n for n in listed if n in mods]
                if any(n not in mods for n in listed):
                    targets.append("__init__")
            for t in targets:
                if t in mods and t != name:
                    out.add(str(mods[t].relative_to(ROOT)))
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    verbose = "--verbose" in sys.argv
    found = 0
    graphs = {t: rust_graph(ROOT / t) for t in RUST_TREES if (ROOT / t).exists()}
    for tree, name in PY_PACKAGES.items():
        graphs[tree] = py_graph(ROOT / tree, name)
    for tree, graph in graphs.items():
        cs = circles(graph)
        edges = sum(len(v) for v in graph.values())
        print(f"{tree}: {len(graph)} files, {edges} imports, {len(cs)} circle(s)")
        for c in cs:
            found += 1
            print(
                f"  circle of {len(c)}: {', '.join(Path(x).relative_to(tree).as_posix() for x in c)}"
            )
            if verbose:
                for a in c:
                    inside = sorted(b for b in graph[a] if b in c)
                    print(
                        f"    {Path(a).relative_to(tree)} -> {', '.join(str(Path(b).relative_to(tree)) for b in inside)}"
                    )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
