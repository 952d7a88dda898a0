"""Every ```python block of README.md runs as written.

The blocks run in order in one fresh interpreter whose working folder is the test's own, as a
reader who pastes them one after the other into one Python session would: a block may use what
an earlier one made (``ll``, ``ds``, ``write_lake``, the folder ``data/lake/``), and nothing
else. A failing block's traceback names README.md and its lines.

A block may be preceded by an HTML comment saying what it needs from the test:

- ``<!-- readme-test: needs s3 -->``: the session's SeaweedFS (``tests/stores.py``) serves the
  README's ``data/lake/`` as ``s3://bucket/lake/``, and ``S3_ENDPOINT_URL``, ``S3_KEY`` and
  ``S3_SECRET`` in the environment reach it.

No block goes untested silently: a comment asking for anything else, a comment that does not
stand right above a ```python block, or a block fenced as another spelling of Python
(```py, ```python3, ```pycon) fails ``test_every_python_block_is_run``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

pytest_plugins = ["tests.stores"]

README = ROOT / "README.md"
FENCE = re.compile(r"^```(\S*)\s*$")
DIRECTIVE = re.compile(r"^<!--\s*readme-test:\s*(.*?)\s*-->\s*$")
#: What a ``readme-test`` comment may ask for.
KNOWN_NEEDS = {"needs s3"}
#: Fence languages that are Python under another name: the test would skip them.
OTHER_PYTHON_SPELLINGS = {"py", "py3", "python3", "pycon", "ipython", "pyi"}
#: Seconds the whole README gets.
TIMEOUT = 900


@dataclass(frozen=True)
class Block:
    """A ```python block: its code, the README line of its first code line, what it needs."""

    index: int
    section: str
    line: int
    code: str
    needs: tuple[str, ...]

    @property
    def name(self) -> str:
        """``NN-section-title``, for the test's id."""
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-")
        return f"{self.index:02d}-{slug or 'top'}"


def parse(text: str) -> tuple[list[Block], list[str]]:
    """The ```python blocks of a Markdown text, and what would keep one from being run."""
    lines = text.split("\n")
    blocks: list[Block] = []
    problems: list[str] = []
    section, pending, i = "", [], 0
    while i < len(lines):
        line = lines[i]
        directive, fence = DIRECTIVE.match(line), FENCE.match(line)
        if directive:
            pending.append((i + 1, directive.group(1)))
        elif fence:
            lang = fence.group(1)
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                problems.append(f"README.md:{i + 1}: a ``` fence that is never closed")
                break
            if lang in OTHER_PYTHON_SPELLINGS:
                problems.append(f"README.md:{i + 1}: fenced as {lang!r}: write ```python")
            if lang == "python":
                needs = tuple(what for _, what in pending)
                code = "\n".join(lines[i + 1 : end])
                blocks.append(Block(len(blocks), section, i + 2, code, needs))
            else:
                problems.extend(
                    f"README.md:{n}: readme-test comment above a ```{lang} block"
                    for n, _ in pending
                )
            pending, i = [], end
        elif line.strip():
            problems.extend(
                f"README.md:{n}: readme-test comment not right above a ```python block"
                for n, _ in pending
            )
            pending = []
            if line.startswith("## "):
                section = line[3:].strip()
        i += 1
    for block in blocks:
        problems.extend(
            f"README.md:{block.line - 1}: unknown readme-test need {what!r} (known: "
            f"{sorted(KNOWN_NEEDS)})"
            for what in block.needs
            if what not in KNOWN_NEEDS
        )
    return blocks, problems


BLOCKS, PROBLEMS = parse(README.read_text(encoding="utf-8"))

#: Runs in the interpreter under test: argv[1] the blocks (JSON), argv[2] the results (JSON
#: lines). Stops at the first failing block: the later ones build on it.
DRIVER = r"""
import json, os, sys, time, traceback

blocks = json.loads(open(sys.argv[1], encoding="utf-8").read())
served = False
namespace = {"__name__": "__main__"}
with open(sys.argv[2], "w", encoding="utf-8") as out:
    for block in blocks:
        began = time.monotonic()
        try:
            if "needs s3" in block["needs"] and not served:
                import fsspec

                fs = fsspec.filesystem(
                    "s3",
                    key=os.environ["S3_KEY"],
                    secret=os.environ["S3_SECRET"],
                    endpoint_url=os.environ["S3_ENDPOINT_URL"],
                )
                fs.mkdir("bucket")
                fs.put("data/lake/", "bucket/lake/", recursive=True)
                fs.invalidate_cache()
                served = True
            source = "\n" * (block["line"] - 1) + block["code"]
            exec(compile(source, block["path"], "exec"), namespace)
            result = {"index": block["index"], "ok": True}
        except BaseException:
            result = {"index": block["index"], "ok": False, "error": traceback.format_exc()}
        result["seconds"] = round(time.monotonic() - began, 2)
        out.write(json.dumps(result) + "\n")
        out.flush()
        if not result["ok"]:
            break
"""


@pytest.fixture(scope="module")
def readme_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Run every block once; each block's result by index, and the interpreter's output."""
    work = tmp_path_factory.mktemp("readme")
    env = dict(os.environ)
    if any("needs s3" in b.needs for b in BLOCKS):
        store = request.getfixturevalue("s3_store")
        options = store.storage_options
        env |= {
            "S3_ENDPOINT_URL": options["endpoint_url"],
            "S3_KEY": options["key"],
            "S3_SECRET": options["secret"],
        }
    spec = [
        {"index": b.index, "line": b.line, "code": b.code, "needs": b.needs, "path": str(README)}
        for b in BLOCKS
    ]
    (work / "blocks.json").write_text(json.dumps(spec), encoding="utf-8")
    results = work / "results.jsonl"
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(work / "blocks.json"), str(results)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    lines = results.read_text(encoding="utf-8").splitlines() if results.exists() else []
    by_index = {r["index"]: r for r in map(json.loads, lines)}
    return {
        "results": by_index,
        "output": (proc.stdout + proc.stderr)[-4000:],
        "rc": proc.returncode,
    }


def test_every_python_block_is_run() -> None:
    assert not PROBLEMS, "\n".join(PROBLEMS)
    assert len(BLOCKS) >= 10, f"found {len(BLOCKS)} ```python blocks in README.md"


@pytest.mark.slow  # the whole README at once (about 15 s) and an S3 server
@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_readme_block(block: Block, readme_run: dict[str, Any]) -> None:
    result = readme_run["results"].get(block.index)
    if result is None:
        failed = [r for r in readme_run["results"].values() if not r["ok"]]
        why = (
            f"block {failed[0]['index']} failed first"
            if failed
            else f"the interpreter exited with {readme_run['rc']}: {readme_run['output']}"
        )
        pytest.fail(f"README.md:{block.line} ({block.section}) was not run: {why}")
    assert result["ok"], f"README.md:{block.line} ({block.section}) failed:\n{result['error']}"


def test_parse_finds_what_would_go_untested() -> None:
    text = "\n".join(
        [
            "## A",
            "<!-- readme-test: needs s3 -->",
            "```python",
            "x = 1",
            "```",
            "<!-- readme-test: needs gpu -->",
            "```python",
            "```",
            "<!-- readme-test: needs s3 -->",
            "",
            "prose",
            "```py",
            "y = 2",
            "```",
            "<!-- readme-test: needs s3 -->",
            "```bash",
            "```",
        ]
    )
    blocks, problems = parse(text)
    assert [(b.section, b.line, b.code, b.needs) for b in blocks] == [
        ("A", 4, "x = 1", ("needs s3",)),
        ("A", 8, "", ("needs gpu",)),
    ]
    assert problems == [
        "README.md:9: readme-test comment not right above a ```python block",
        "README.md:12: fenced as 'py': write ```python",
        "README.md:15: readme-test comment above a ```bash block",
        "README.md:7: unknown readme-test need 'needs gpu' (known: ['needs s3'])",
    ]


@pytest.mark.slow
def test_train_ft_demo_runs_with_no_other_arguments(tmp_path: Path) -> None:
    """The README's ``python examples/train_ft.py --demo``: a lake and logs of its own, quiet."""
    command = "python examples/train_ft.py --demo"
    assert f"`{command}`" in README.read_text(encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"} | {"TMPDIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, *command.split()[1:]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert len(output.splitlines()) < 50, output[-3000:]
    (work,) = tmp_path.glob("train_ft-*")  # the folder it made, and named
    assert f"logs go to {work / 'logs'}" in run.stdout
    assert sorted(p.name for p in (work / "logs").glob("*.jsonl")) == [
        f"replica{i}.jsonl" for i in range(4)
    ]
    summary = json.loads(run.stdout.splitlines()[-1])
    assert summary["exactly_once"] is True
    assert summary["epochs"][0]["rows"] == 6000
