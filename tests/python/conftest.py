"""Shared set-up of the Python package's tests (run against the installed wheel: `pip install .`
into a virtual environment, then `python -m pytest tests/python`; `.ci/run` does both).

MOEINFER_CLI names the `moeinfer` executable the CLI-equality tests compare against (default:
build/moeinfer of this checkout; those tests are skipped when neither exists)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "models"
DEMO = REPO / "models" / "demo"


def fixture_names() -> list[str]:
    return sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.json").is_file())


def reference(name: str) -> dict:
    return json.loads((FIXTURES / name / "reference.json").read_text())


def cli_binary() -> pathlib.Path | None:
    given = os.environ.get("MOEINFER_CLI")
    if given:
        path = pathlib.Path(given)
        assert path.is_file(), f"MOEINFER_CLI={given} does not exist"
        return path
    default = REPO / "build" / "moeinfer"
    return default if default.is_file() else None


def run_module(*args: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """`python -m moeinfer ARGS` with this interpreter (the installed wheel)."""
    result = subprocess.run([sys.executable, "-m", "moeinfer", *args], capture_output=True,
                            text=True, cwd=REPO, **kwargs)
    if check:
        assert result.returncode == 0, f"python -m moeinfer {' '.join(args)}:\n{result.stderr}"
    return result


@pytest.fixture(scope="session")
def demo_llm():
    import moeinfer
    return moeinfer.LLM(DEMO)


@pytest.fixture(scope="session")
def cli():
    binary = cli_binary()
    if binary is None:
        pytest.skip("no moeinfer executable (build/moeinfer or MOEINFER_CLI)")
    return binary
