""".ci/run with a stand-in scripts/test.sh: the environment at the README's default place (.venv in the
checkout), removed however the run ends; pytest's "no tests collected" (exit 5) is a failure; a .venv
that was there before is neither used nor deleted."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

STAND_IN = """#!/usr/bin/env bash
venv="${KCP_VENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv}"
mkdir -p "$venv/bin" && echo "$venv" > "$(dirname "$0")/../venv_used"
exit "$STAND_IN_RC"
"""


def _ci(tmp_path, rc, venv_before=False):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copytree(ROOT / ".ci", repo / ".ci")
    (repo / "scripts" / "test.sh").write_text(STAND_IN)
    if venv_before:
        (repo / ".venv").mkdir()
    env = {**os.environ, "STAND_IN_RC": str(rc), "KCP_VENV": str(tmp_path / "elsewhere")}
    done = subprocess.run(["bash", ".ci/run"], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    return repo, done


@pytest.mark.parametrize("rc,expected", [(0, 0), (1, 1), (5, 1)])
def test_ci_uses_the_default_venv_and_removes_it(tmp_path, rc, expected):
    repo, done = _ci(tmp_path, rc)
    assert done.returncode == expected, done.stderr
    assert (repo / "venv_used").read_text().strip() == str(repo / ".venv")     # not KCP_VENV
    assert not (repo / ".venv").exists()
    assert ("collected no tests" in done.stderr) == (rc == 5)


def test_ci_refuses_an_existing_venv(tmp_path):
    repo, done = _ci(tmp_path, 0, venv_before=True)
    assert done.returncode == 1 and "fresh clone" in done.stderr
    assert (repo / ".venv").is_dir() and not (repo / "venv_used").exists()
