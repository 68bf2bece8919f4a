"""docs/configuration.md's `serve` table names every flag `moe-sidecar serve` takes,
with its environment variable, and no flag it does not take."""

from __future__ import annotations

import argparse
import re

import pytest

from moe_sidecar.config import add_serve_arguments
from moe_sidecar.core.defaults import ENV_PREFIX
from tests.dockerfile import REPO

pytestmark = pytest.mark.timeout(30)


def _serve_flags() -> set[str]:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return {
        flag
        for action in parser._actions
        for flag in action.option_strings
        if flag.startswith("--") and flag != "--help"
    }


def _documented_rows() -> list[tuple[str, str]]:
    """The flag and env columns of every row of the `serve` flags table."""
    text = (REPO / "docs" / "configuration.md").read_text()
    start = text.index("## `serve` flags")
    end = text.index("\n## ", start + 1)
    cell = r"((?:[^|\\]|\\.)*)"  # a cell may hold an escaped pipe: `auto\|json\|text`
    rows = re.findall(rf"^\| {cell} \| {cell} \|", text[start:end], re.MULTILINE)
    return [(flag, env) for flag, env in rows if flag.startswith("`--")]


def test_every_serve_flag_is_documented_once_and_no_other() -> None:
    documented = [
        flag for column, _ in _documented_rows() for flag in re.findall(r"`(--[a-z0-9-]+)", column)
    ]
    assert len(documented) == len(set(documented)), "a flag has two rows"
    assert set(documented) == _serve_flags()


def test_every_documented_flag_names_its_environment_variable() -> None:
    for flag_column, env_column in _documented_rows():
        for flag in re.findall(r"`--((?!no-)[a-z0-9-]+)", flag_column):
            env = ENV_PREFIX + flag.replace("-", "_").upper()
            assert f"`{env}`" in env_column, (flag, env_column)
