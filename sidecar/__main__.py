"""``python -m moe_sidecar [flags]`` is ``moe-sidecar serve [flags]``;
``python -m moe_sidecar --version`` is ``moe-sidecar --version``."""

from __future__ import annotations

import sys

from moe_sidecar.cli import main

if __name__ == "__main__":
    flags = sys.argv[1:]
    sys.exit(main(flags if flags == ["--version"] else ["serve", *flags]))
