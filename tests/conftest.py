"""What every test shares: the owner keys its ranks make stay in its own directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_sidecar.core.defaults import ENV_KEY_DIR


@pytest.fixture(autouse=True)
def owner_key_dir(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """Rank 0's owner keys (``moe_sidecar.client.owner_key``) go to a directory
    of the test's, never the user's state directory; rank processes the test
    spawns inherit it. One directory per test, so a restart within a test
    finds the key its first lifetime made."""
    directory = tmp_path_factory.mktemp("owner-keys")
    monkeypatch.setenv(ENV_KEY_DIR, str(directory))
    return directory
