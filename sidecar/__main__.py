"""``python -m moe_sidecar [flags]`` is ``moe-sidecar serve [flags]``."""

from __future__ import annotations

import sys

from moe_sidecar.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
