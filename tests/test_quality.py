"""The code stays clean: ruff and mypy, as configured in pyproject.toml, find nothing."""

from __future__ import annotations

from tests.conftest import run_module as _run


def test_ruff_finds_nothing() -> None:
    result = _run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_applied() -> None:
    result = _run("ruff", "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_finds_nothing() -> None:
    result = _run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr
