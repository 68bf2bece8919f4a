"""Every package of the checkout is installed by ``pip install .``.

The README's first command installs from the checkout without ``-e``; a
package directory missing from ``[tool.setuptools] packages`` is then absent
from the install, and the first import of it fails (``cannot import name ...``).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(10)

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_directory_is_listed() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {
        ".".join((name, *init.parent.relative_to(ROOT / directory).parts))
        for name, directory in setuptools["package-dir"].items()
        for init in (ROOT / directory).rglob("__init__.py")
    }
    missing = sorted(found - set(setuptools["packages"]))
    assert not missing, f"add to [tool.setuptools] packages: {missing}"
    stale = sorted(set(setuptools["packages"]) - found)
    assert not stale, f"[tool.setuptools] packages with no directory: {stale}"
