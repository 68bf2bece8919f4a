"""Rank 0's owner key on disk (``moe_sidecar.client.owner_key``): made once,
mode 0600, read back the same; a key that cannot be used means no digest."""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path

import pytest

from moe_sidecar.client.owner_key import (
    OWNER_KEY_BYTES,
    key_directory,
    key_path,
    load_owner_key,
    owner_digest,
    owner_digest_of,
    owner_key_or_none,
)
from moe_sidecar.core.defaults import ENV_KEY_DIR
from moe_sidecar.core.errors import InvalidArgument

pytestmark = pytest.mark.timeout(10)

GROUP = "deepseek-v3:fp4/tp1-ep8/pp0"


def test_the_key_directory_is_the_variable_else_the_users_state_directory(tmp_path: Path) -> None:
    assert key_directory({ENV_KEY_DIR: str(tmp_path)}) == tmp_path
    assert key_directory({"XDG_STATE_HOME": "/state"}) == Path("/state/moe-sidecar/keys")
    home = Path.home() / ".local" / "state" / "moe-sidecar" / "keys"
    assert key_directory({"XDG_STATE_HOME": "relative"}) == home
    assert key_directory({}) == home


def test_a_key_is_made_once_with_mode_0600_and_read_back(tmp_path: Path) -> None:
    environ = {ENV_KEY_DIR: str(tmp_path / "keys")}
    key = load_owner_key(GROUP, environ)
    path = key_path(tmp_path / "keys", GROUP)
    assert path.name == hashlib.sha256(GROUP.encode()).hexdigest() + ".key"
    assert len(key) == OWNER_KEY_BYTES and path.read_bytes() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert load_owner_key(GROUP, environ) == key
    assert load_owner_key("another/group", environ) != key
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(
        key_path(path.parent, g).name for g in (GROUP, "another/group")
    )  # no file left behind but the keys
    digest = owner_digest(key, GROUP)
    assert digest == hashlib.sha256(key + GROUP.encode()).hexdigest()
    assert owner_digest_of(GROUP, environ) == digest
    assert owner_digest(None, GROUP) == ""


@pytest.mark.parametrize(
    ("content", "mode", "needle"),
    [
        (b"short", 0o600, "holds 5 bytes, not 32"),
        (b"k" * 32, 0o644, "has mode 644; it must be 600"),
    ],
)
def test_a_file_that_is_no_key_is_refused_and_means_no_digest(
    tmp_path: Path, content: bytes, mode: int, needle: str, caplog: pytest.LogCaptureFixture
) -> None:
    environ = {ENV_KEY_DIR: str(tmp_path)}
    path = key_path(tmp_path, GROUP)
    path.write_bytes(content)
    os.chmod(path, mode)
    with pytest.raises(InvalidArgument, match=needle) as error:
        load_owner_key(GROUP, environ)
    assert str(path) in error.value.message
    with caplog.at_level(logging.WARNING):
        assert owner_key_or_none(GROUP, environ) is None
    assert "rebuilds instead of inheriting the stored plan" in caplog.text
    assert owner_digest_of(GROUP, environ) == ""
