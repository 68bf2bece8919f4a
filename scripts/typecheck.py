"""Runs mypy (strict, as configured in pyproject.toml) on the installed import names.

The repository keeps ``sidecar/`` and ``client/`` at the top, but they are
installed as ``moe_sidecar`` and ``moe_sidecar.client`` (``[tool.setuptools]
package-dir``). mypy finds modules by their paths and cannot follow
setuptools' editable-install import hook, so this script lays out, under
``build/typecheck/``, a tree of symbolic links with the installed names
(made from the same ``package-dir`` table, so the two cannot drift), points
mypy at it, and prints mypy's report with the repository's own paths.

    python scripts/typecheck.py            # what .ci/run does
    python scripts/typecheck.py --keep     # leave build/typecheck/ in place

Exits with mypy's status.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tomllib
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"
CHECKED_DIRECTORIES = ("tests", "bench", "scripts")
"""Checked by path beside the packages (they are not installed)."""


def package_dirs() -> dict[str, Path]:
    """``[tool.setuptools] package-dir`` of pyproject.toml: import name -> directory."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        table = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / directory for name, directory in table.items()}


def link_tree(mapping: dict[str, Path]) -> dict[Path, Path]:
    """Builds ``TREE`` so that each import name is a directory whose entries
    link to the mapped directory's entries. Returns link path -> real path."""
    if TREE.exists():
        shutil.rmtree(TREE)
    links: dict[Path, Path] = {}
    # Parents before children: moe_sidecar before moe_sidecar.client.
    for name in sorted(mapping, key=lambda n: n.count(".")):
        source = mapping[name]
        target = TREE.joinpath(*name.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for entry in sorted(source.iterdir()):
            if entry.name == "__pycache__" or (target / entry.name).exists():
                continue
            if entry.is_dir() and f"{name}.{entry.name}" in mapping:
                continue  # a mapped subpackage of its own
            (target / entry.name).symlink_to(entry)
            links[target / entry.name] = entry
    return links


def main(argv: list[str] | None = None) -> int:
    """Builds the link tree, runs mypy, maps its paths back; returns mypy's status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep build/typecheck/ afterwards")
    args = parser.parse_args(argv)
    mapping = package_dirs()
    links = link_tree(mapping)
    top = sorted({name.split(".")[0] for name in mapping})
    try:
        stdout, stderr, status = api.run(
            [
                "--config-file",
                str(ROOT / "pyproject.toml"),
                *[str(TREE / package) for package in top],
                *[str(ROOT / d) for d in CHECKED_DIRECTORIES],
            ]
        )
    finally:
        if not args.keep:
            shutil.rmtree(TREE, ignore_errors=True)
    # Longest link first, so a file inside a linked directory maps through it.
    for link, real in sorted(links.items(), key=lambda item: -len(str(item[0]))):
        for form in (str(link), str(link.relative_to(ROOT))):
            stdout = stdout.replace(form, str(real.relative_to(ROOT)))
    sys.stdout.write(stdout)
    sys.stderr.write(stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
