"""README.md's examples run as written: every ```python block, and every `memplan ...` line of a
```bash / ```sh block, is read from README.md itself, so the README cannot drift from the code.

Each example runs in a fresh Python process in an empty directory (files it writes, such as
plan.json, land there), with this checkout first on the import path. The `make ...` set-up
lines are not run.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 300
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks(language: set[str]) -> list[tuple[int, str]]:
    """(line number, code) of each fenced block in one of ``language``."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) in language]


PYTHON_BLOCKS = _blocks({"python"})
CLI_LINES = [(line_no + i + 1, line.split("#", 1)[0].strip())
             for line_no, code in _blocks({"bash", "sh", "shell", "console"})
             for i, line in enumerate(code.splitlines()) if line.strip().startswith("memplan ")]


def _run(argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               MPLBACKEND="Agg", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_readme_is_short_and_its_examples_are_found():
    lines = README.read_text().splitlines()
    assert len(lines) < MAX_LINES, f"README.md has {len(lines)} lines; keep it under {MAX_LINES}"
    assert lines[0] == "# memplan"
    assert len(PYTHON_BLOCKS) >= 5, PYTHON_BLOCKS
    assert len(CLI_LINES) >= 2, CLI_LINES
    text = README.read_text()
    assert "make demo" in text and "make test" in text
    assert text.count("<!-- bench:start -->") == 1 and text.count("<!-- bench:end -->") == 1


def test_every_option_is_in_the_readme():
    """Every field of PlanOptions / StepOptions and every keyword of optimize and backend is named."""
    import dataclasses
    import inspect

    import memplan

    text = README.read_text()
    names = {f.name for cls in (memplan.PlanOptions, memplan.StepOptions) for f in dataclasses.fields(cls)}
    for fn in (memplan.optimize, memplan.backend):
        names |= {p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}
    missing = sorted(n for n in names if f"`{n}`" not in text and f"{n}=" not in text)
    assert not missing, f"options the README does not mention: {missing}"


def test_readme_links_point_at_files():
    text = README.read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert not missing, missing


@pytest.mark.slow
@pytest.mark.parametrize("line_no,code", PYTHON_BLOCKS, ids=[f"python-line-{n}" for n, _ in PYTHON_BLOCKS])
def test_python_example_runs(line_no, code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    done = _run([sys.executable, str(script)], tmp_path)
    assert done.returncode == 0, f"README.md line {line_no}:\n{code}\n--- stderr ---\n{done.stderr[-4000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("line_no,command", CLI_LINES, ids=[f"cli-line-{n}" for n, _ in CLI_LINES])
def test_cli_example_runs(line_no, command, tmp_path):
    argv = [sys.executable, "-m", "memplan.tools.cli", *shlex.split(command)[1:]]
    done = _run(argv, tmp_path)
    assert done.returncode == 0, f"README.md line {line_no}: {command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
