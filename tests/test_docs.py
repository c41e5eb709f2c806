"""Every code block of README.md and the user guide (docs/guide/*.md) runs here, so the
examples stay true.

- ```python blocks run each in a fresh interpreter (this one's), in a temporary directory;
- ```bash / ```sh blocks run with bash from the repository root;
- ```rust blocks are not compiled here: each must be a part of an example cargo builds
  (``engines/datafusion/examples/*.rs``), compared line by line without indentation;
- ```text, ```console and output blocks are not run.

A block preceded by ``<!-- not run in CI: REASON -->`` is skipped; only the blocks in
``SKIPPED`` may be (the README's two top commands, and blocks that start Ray).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
EXAMPLES = sorted((ROOT / "engines" / "datafusion" / "examples").glob("*.rs"))

PYTHON = {"python", "py"}
SHELL = {"bash", "sh", "shell"}
RUST = {"rust"}
NOT_RUN = {"", "text", "console", "output", "sql", "toml", "yaml"}

# The blocks that may carry the skip comment: (page, a line that block contains).
SKIPPED = {
    # run.sh builds the release extension and runs TPC-H SF1; test.sh is CI itself.
    ("README.md", "bash scripts/run.sh"),
    # Ray: a cluster of several machines, or a local Ray instance started by the example.
    ("README.md", 'runtime="ray"'),
    ("docs/guide/ray.md", "ray start --head --port=6379"),
    ("docs/guide/ray.md", 'ray_address="auto"'),
    ("docs/guide/ray.md", 'runtime="ray", ray_resources'),
}

FENCE = re.compile(r"^```([\w+-]*)\s*$")
SKIP = re.compile(r"^<!--\s*not run in CI:\s*(\S.*?)\s*-->\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    text: str
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page (fences at the start of a line)."""
    page = path.relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    found = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        i += 1
        body = []
        while i < len(lines) and lines[i].rstrip() != "```":
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{page}:{start + 1}: code block never closed"
        i += 1
        before = next((x for x in reversed(lines[:start]) if x.strip()), "")
        skip = SKIP.match(before.strip())
        found.append(
            Block(page, start + 1, m.group(1).lower(), "\n".join(body) + "\n", skip and skip[1])
        )
    return found


ALL = [b for p in PAGES for b in blocks(p)]


def of(langs: set[str]) -> list:
    return [pytest.param(b, id=b.id) for b in ALL if b.lang in langs and b.skip is None]


def test_every_block_has_a_known_language() -> None:
    known = PYTHON | SHELL | RUST | NOT_RUN
    assert [b.id for b in ALL if b.lang not in known] == []


def test_only_the_listed_blocks_are_skipped() -> None:
    skipped = [b for b in ALL if b.skip is not None]
    matched = {
        key: [b.id for b in skipped if b.page == key[0] and key[1] in b.text] for key in SKIPPED
    }
    assert {k: v for k, v in matched.items() if len(v) != 1} == {}, "each entry: one block"
    listed = {i for ids in matched.values() for i in ids}
    assert [b.id for b in skipped if b.id not in listed] == [], "skipped but not in SKIPPED"


def _env() -> dict[str, str]:
    """This interpreter's environment, its bin directory first (the ``flightshuffle`` command)."""
    env = dict(os.environ)
    # The examples run as a user runs them: with the default small-query threshold, not the
    # test suite's (conftest distributes every query).
    env.pop("FLIGHTSHUFFLE_SMALL_QUERY_ROWS", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _check(run: subprocess.CompletedProcess, block: Block) -> None:
    assert run.returncode == 0, (
        f"{block.id} exited {run.returncode}\n--- block\n{block.text}"
        f"--- stdout\n{run.stdout[-4000:]}\n--- stderr\n{run.stderr[-4000:]}"
    )


@pytest.mark.parametrize("block", of(PYTHON))
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(block.text)
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    _check(run, block)


@pytest.mark.parametrize("block", of(SHELL))
def test_shell_block_runs(block: Block) -> None:
    run = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.text],
        cwd=ROOT,
        env=_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    _check(run, block)


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("block", of(RUST))
def test_rust_block_is_part_of_a_built_example(block: Block) -> None:
    want = _lines(block.text)
    assert want, f"{block.id}: empty block"
    for example in EXAMPLES:
        have = _lines(example.read_text())
        if any(have[i : i + len(want)] == want for i in range(len(have) - len(want) + 1)):
            return
    names = [e.relative_to(ROOT).as_posix() for e in EXAMPLES]
    pytest.fail(f"{block.id}: not a part of any of {names}")


def test_the_readme_starts_with_the_two_commands() -> None:
    first = ALL[0]
    assert first.page == "README.md" and first.lang == "bash"
    assert _lines(first.text)[0].startswith("bash scripts/run.sh")
    assert _lines(first.text)[1].startswith("bash scripts/test.sh")
    assert len(_lines(first.text)) == 2
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_every_relative_link_of_the_readme_resolves_inside_the_repository() -> None:
    text = (ROOT / "README.md").read_text()
    # Links inside code blocks are code, not links.
    text = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    targets = LINK.findall(text) + REF_LINK.findall(text)
    assert targets, "the README links into the docs"
    bad = []
    for target in targets:
        if target.startswith("#"):
            continue
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            bad.append(f"{target}: points outside the repository")
            continue
        path = (ROOT / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(ROOT):
            bad.append(f"{target}: outside the repository")
        elif not path.exists():
            bad.append(f"{target}: no such file")
    assert bad == []
