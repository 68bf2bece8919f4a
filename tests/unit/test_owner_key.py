"""Rank 0's owner key on disk (``moe_sidecar.client.owner_key``): made once,
mode 0600, read back the same, read as OpenSSH reads a private key (a key
someone else could have chosen is refused, one line naming the path, what
is wrong and the fix), made atomically by ranks starting at once; a key
that merely cannot be used means no digest."""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from moe_sidecar.client.owner_key import (
    OWNER_KEY_BYTES,
    UnsafeOwnerKey,
    key_directory,
    key_path,
    load_owner_key,
    owner_digest,
    owner_digest_of,
    owner_key_or_none,
)
from moe_sidecar.core.defaults import ENV_KEY_DIR
from moe_sidecar.core.errors import InvalidArgument, PermissionDenied

pytestmark = pytest.mark.timeout(10)

GROUP = "deepseek-v3:fp4/tp1-ep8/pp0"
NOBODY = 65534
"""The uid of ``nobody``: another user's file, made by chown as root."""
AS_ROOT = pytest.mark.skipif(
    os.geteuid() != 0, reason="only root can make a file of another uid (chown)"
)


def _keys(tmp_path: Path) -> Path:
    directory = tmp_path / "keys"
    directory.mkdir(mode=0o700)
    return directory


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


def test_a_key_made_under_a_umask_that_takes_the_owners_bits_is_still_0600(
    tmp_path: Path,
) -> None:
    directory = _keys(tmp_path)
    before = os.umask(0o277)
    try:
        key = load_owner_key(GROUP, {ENV_KEY_DIR: str(directory)})
    finally:
        os.umask(before)
    path = key_path(directory, GROUP)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_bytes() == key


def test_a_directory_of_this_user_writable_by_no_one_else_is_taken(tmp_path: Path) -> None:
    # 0755, as a home's state directory often is: others may list, not write.
    directory = _keys(tmp_path)
    directory.chmod(0o755)
    assert len(load_owner_key(GROUP, {ENV_KEY_DIR: str(directory)})) == OWNER_KEY_BYTES


def test_a_directory_rank_0_makes_inside_a_0777_volume_is_taken(tmp_path: Path) -> None:
    # An emptyDir (or a volume an fsGroup made group-writable) at /keys, the
    # key directory /keys/owner: rank 0 makes it 0700, and that is what counts.
    volume = tmp_path / "volume"
    volume.mkdir()
    volume.chmod(0o777)
    environ = {ENV_KEY_DIR: str(volume / "owner")}
    assert len(load_owner_key(GROUP, environ)) == OWNER_KEY_BYTES
    assert stat.S_IMODE((volume / "owner").stat().st_mode) == 0o700
    with pytest.raises(UnsafeOwnerKey, match="writable by group or others; chmod 700"):
        load_owner_key(GROUP, {ENV_KEY_DIR: str(volume)})


def test_a_file_of_another_size_is_refused_and_means_no_digest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = _keys(tmp_path)
    environ = {ENV_KEY_DIR: str(directory)}
    path = key_path(directory, GROUP)
    path.write_bytes(b"short")
    path.chmod(0o600)
    with pytest.raises(InvalidArgument, match="holds 5 bytes, not 32") as error:
        load_owner_key(GROUP, environ)
    assert str(path) in error.value.message
    with caplog.at_level(logging.WARNING):
        assert owner_key_or_none(GROUP, environ) is None
    assert "rebuilds instead of inheriting the stored plan" in caplog.text
    assert owner_digest_of(GROUP, environ) == ""


def test_a_directory_that_cannot_be_made_means_no_digest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    in_the_way = tmp_path / "a-file"
    in_the_way.write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        assert owner_key_or_none(GROUP, {ENV_KEY_DIR: str(in_the_way / "keys")}) is None
    assert "no owner key" in caplog.text


# --- what another user could have chosen ------------------------------------


def _squatters_key(tmp_path: Path) -> Path:
    """A well-formed key file of this user's, elsewhere: what a symlink points at."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    chosen = elsewhere / "chosen.key"
    chosen.write_bytes(b"s" * OWNER_KEY_BYTES)
    chosen.chmod(0o600)
    return chosen


def _symlink(tmp_path: Path, directory: Path) -> tuple[Path, str, str]:
    path = key_path(directory, GROUP)
    path.symlink_to(_squatters_key(tmp_path))
    return path, "is a symbolic link", f"remove it (rm {path})"


def _dangling_symlink(tmp_path: Path, directory: Path) -> tuple[Path, str, str]:
    # A key made through it would land where the link's maker chose.
    path = key_path(directory, GROUP)
    path.symlink_to(tmp_path / "where-the-squatter-reads")
    return path, "is a symbolic link", f"remove it (rm {path})"


def _mode_0644(tmp_path: Path, directory: Path) -> tuple[Path, str, str]:
    path = key_path(directory, GROUP)
    path.write_bytes(b"k" * OWNER_KEY_BYTES)
    path.chmod(0o644)
    return path, "has mode 644, open to group or others", f"chmod 600 {path}"


def _mode_0660(tmp_path: Path, directory: Path) -> tuple[Path, str, str]:
    path = key_path(directory, GROUP)
    path.write_bytes(b"k" * OWNER_KEY_BYTES)
    path.chmod(0o660)
    return path, "has mode 660, open to group or others", f"chmod 600 {path}"


def _directory_0777(tmp_path: Path, directory: Path) -> tuple[Path, str, str]:
    directory.chmod(0o777)
    return directory, "has mode 777, writable by group or others", f"chmod 700 {directory}"


def _directory_group_writable(tmp_path: Path, directory: Path) -> tuple[Path, str, str]:
    directory.chmod(0o770)
    return directory, "has mode 770, writable by group or others", f"chmod 700 {directory}"


def _fifo(tmp_path: Path, directory: Path) -> tuple[Path, str, str]:
    path = key_path(directory, GROUP)
    os.mkfifo(path, 0o600)  # opening it for reading must not hang
    return path, "is not a regular file", f"remove it (rm -r {path})"


def _file_of_another_uid(tmp_path: Path, directory: Path) -> tuple[Path, str, str]:
    path = key_path(directory, GROUP)
    path.write_bytes(b"k" * OWNER_KEY_BYTES)
    path.chmod(0o600)
    os.chown(path, NOBODY, NOBODY)
    return path, f"is owned by uid {NOBODY}, not this user (uid 0)", f"remove it (rm {path})"


def _directory_of_another_uid(tmp_path: Path, directory: Path) -> tuple[Path, str, str]:
    os.chown(directory, NOBODY, NOBODY)
    return (
        directory,
        f"is owned by uid {NOBODY}, not this user (uid 0)",
        f"chown 0 {directory} && chmod 700 {directory}",
    )


UNSAFE: list[object] = [
    pytest.param(_symlink, id="symlink"),
    pytest.param(_dangling_symlink, id="dangling-symlink"),
    pytest.param(_mode_0644, id="file-0644"),
    pytest.param(_mode_0660, id="file-0660"),
    pytest.param(_directory_0777, id="directory-0777"),
    pytest.param(_directory_group_writable, id="directory-0770"),
    pytest.param(_fifo, id="fifo"),
    pytest.param(_file_of_another_uid, id="file-of-another-uid", marks=AS_ROOT),
    pytest.param(_directory_of_another_uid, id="directory-of-another-uid", marks=AS_ROOT),
]


@pytest.mark.parametrize("make", UNSAFE)
def test_a_key_someone_else_could_have_chosen_is_refused_in_one_line(
    tmp_path: Path, make: Callable[[Path, Path], tuple[Path, str, str]]
) -> None:
    directory = _keys(tmp_path)
    environ = {ENV_KEY_DIR: str(directory)}
    path, problem, fix = make(tmp_path, directory)
    before = sorted(p.name for p in directory.iterdir())
    with pytest.raises(UnsafeOwnerKey) as error:
        load_owner_key(GROUP, environ)
    message = error.value.message
    assert "\n" not in message
    assert message.startswith(f"owner key {'directory' if path == directory else 'file'} {path}: ")
    assert problem in message and fix in message, message
    assert isinstance(error.value, PermissionDenied) and error.value.path == path
    # Not a warning and no digest: the refusal reaches the rank (and its
    # initialize(), before any proposal).
    with pytest.raises(UnsafeOwnerKey):
        owner_key_or_none(GROUP, environ)
    with pytest.raises(UnsafeOwnerKey):
        owner_digest_of(GROUP, environ)
    assert sorted(p.name for p in directory.iterdir()) == before  # nothing made or removed
    assert not (tmp_path / "where-the-squatter-reads").exists()


@pytest.mark.parametrize("make", [_mode_0644, _directory_0777])
def test_the_fix_the_refusal_names_makes_the_key_usable(
    tmp_path: Path, make: Callable[[Path, Path], tuple[Path, str, str]]
) -> None:
    directory = _keys(tmp_path)
    environ = {ENV_KEY_DIR: str(directory)}
    _, _, fix = make(tmp_path, directory)
    with pytest.raises(UnsafeOwnerKey):
        load_owner_key(GROUP, environ)
    subprocess.run(fix, shell=True, check=True, timeout=5)
    assert len(load_owner_key(GROUP, environ)) == OWNER_KEY_BYTES


# --- ranks starting at once ---------------------------------------------------

RACER = """
import sys
from moe_sidecar.client.owner_key import load_owner_key
print("ready", flush=True)
sys.stdin.readline()
print(load_owner_key(sys.argv[1], {"MOE_SIDECAR_KEY_DIR": sys.argv[2]}).hex(), flush=True)
"""
"""A process that makes (or reads) the key once the test says go on its stdin."""


@pytest.mark.timeout(90)
def test_eight_processes_making_the_key_at_once_all_read_one_key(tmp_path: Path) -> None:
    directory = tmp_path / "keys"  # made by the racers themselves
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, GROUP, str(directory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    try:
        for racer in racers:
            assert racer.stdout is not None and racer.stdout.readline() == "ready\n"
        for racer in racers:  # every one imported: all start within a moment
            assert racer.stdin is not None
            racer.stdin.write("go\n")
            racer.stdin.flush()
        outcomes = [racer.communicate(timeout=60) for racer in racers]
    finally:
        for racer in racers:
            if racer.poll() is None:
                racer.kill()
                racer.wait(timeout=10)
    assert [racer.returncode for racer in racers] == [0] * 8, [err for _, err in outcomes]
    keys = {out.strip() for out, _ in outcomes}
    path = key_path(directory, GROUP)
    assert keys == {path.read_bytes().hex()}, keys
    assert [p.name for p in directory.iterdir()] == [path.name]  # no drawn file left
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
