"""The group's owner key: a secret that rank 0 of an EP group keeps on disk.

The sidecar stores, with a group's plan, the owner digest of the lifetime
that stored it, and a restart inherits the stored plan only when its ranks
send the same digest (``moe_sidecar.core.policy.owner``): a stranger that
squatted every slot of the group cannot make the real ranks build its plan.
Unlike the group proof, which is drawn anew for every lifetime, the key
outlives lifetimes: rank 0 reads it from a file (created on first use, 32
random bytes, mode 0600) in :data:`~moe_sidecar.core.defaults.ENV_KEY_DIR`
(default ``$XDG_STATE_HOME/moe-sidecar/keys``, else
``~/.local/state/moe-sidecar/keys``), named by the digest of the group name,
and shares it with the proof (:mod:`moe_sidecar.client.agreement`). Every
rank sends :func:`owner_digest`, SHA-256 of the key and the group name.

The key is read as OpenSSH reads a private key, since whoever can choose
the file chooses the group's owner: the directory (opened once, and the file
opened inside it, so neither can be swapped between the check and the read)
must be owned by this process's user and writable by no one else; the file
is opened without following a symbolic link and must be a regular file of
this user with no group or other permission bits. Anything else raises
:class:`UnsafeOwnerKey`, one line naming the path, what is wrong and the
fix, and rank 0 proposes nothing with it. A key is made by writing a file of
its own (``O_CREAT | O_EXCL``, mode 0600) and hard-linking it into place,
which never replaces an existing key: ranks that start at once read the
one key that was linked first.

A rank 0 that merely cannot read or make its key (a read-only home, a file
of another size) logs a warning and sends no digest: the group's next
restart then rebuilds once instead of inheriting its plan, and nothing else
changes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from moe_sidecar.core.defaults import ENV_KEY_DIR
from moe_sidecar.core.errors import InvalidArgument, PermissionDenied, quote_name

__all__ = [
    "OWNER_KEY_BYTES",
    "UnsafeOwnerKey",
    "key_directory",
    "key_path",
    "load_owner_key",
    "owner_digest",
    "owner_digest_of",
    "owner_key_or_none",
]

OWNER_KEY_BYTES: Final = 32
"""Random bytes of a group's owner key."""

_log = logging.getLogger(__name__)

_OTHERS_WRITE: Final = stat.S_IWGRP | stat.S_IWOTH
_OTHERS_ANY: Final = stat.S_IRWXG | stat.S_IRWXO


class UnsafeOwnerKey(PermissionDenied):
    """The owner key file or its directory could have been chosen by someone
    other than this process's user (a symbolic link, not a regular file,
    another owner, group or other permission bits): its key is not used, and
    the rank raises before its first proposal. ``message`` is one line: the
    path, what is wrong, the fix."""

    def __init__(self, what: str, path: Path, problem: str, fix: str) -> None:
        super().__init__(f"owner key {what} {path}: {problem}; {fix}")
        self.path = path
        """The refused file or directory."""


def key_directory(environ: Mapping[str, str]) -> Path:
    """Where owner keys are kept: ``MOE_SIDECAR_KEY_DIR``, else
    ``$XDG_STATE_HOME/moe-sidecar/keys`` (when absolute), else
    ``~/.local/state/moe-sidecar/keys``."""
    explicit = environ.get(ENV_KEY_DIR, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    state_home = environ.get("XDG_STATE_HOME", "").strip()
    if state_home and Path(state_home).is_absolute():
        return Path(state_home) / "moe-sidecar" / "keys"
    return Path.home() / ".local" / "state" / "moe-sidecar" / "keys"


def key_path(directory: Path, group: str) -> Path:
    """The key file of ``group``: named by the group name's digest, so any
    name makes a plain file name."""
    return directory / f"{hashlib.sha256(group.encode()).hexdigest()}.key"


def _remove(command: str) -> str:
    """The fix for a key file that must go: a new key costs one rebuild."""
    return (
        f"remove it ({command}); rank 0 makes a new key and the group's next restart rebuilds once"
    )


def _refuse_another_owner(what: str, path: Path, found: os.stat_result, fix: str) -> None:
    """Refuses ``path`` unless this process's user owns it.

    Raises:
        UnsafeOwnerKey: naming ``path``, its owner and ``fix``.
    """
    user = os.geteuid()
    if found.st_uid != user:
        raise UnsafeOwnerKey(
            what, path, f"is owned by uid {found.st_uid}, not this user (uid {user})", fix
        )


def _check_directory(directory: Path, descriptor: int) -> None:
    """Refuses the opened key directory unless this user owns it and no one
    else may write it.

    Raises:
        UnsafeOwnerKey: naming the directory, what is wrong and the fix.
    """
    found = os.fstat(descriptor)
    chown = f"chown {os.geteuid()} {directory} && chmod 700 {directory}"
    fix = f"{chown}, or set {ENV_KEY_DIR} to a directory of this user's"
    _refuse_another_owner("directory", directory, found, fix)
    mode = stat.S_IMODE(found.st_mode)
    if mode & _OTHERS_WRITE:
        raise UnsafeOwnerKey(
            "directory",
            directory,
            f"has mode {mode:o}, writable by group or others",
            f"chmod 700 {directory}",
        )


def _check_file(path: Path, found: os.stat_result) -> None:
    """Refuses the opened key file unless it is a regular file of this user
    with no group or other permission bits.

    Raises:
        UnsafeOwnerKey: naming the file, what is wrong and the fix.
    """
    if not stat.S_ISREG(found.st_mode):
        raise UnsafeOwnerKey("file", path, "is not a regular file", _remove(f"rm -r {path}"))
    _refuse_another_owner("file", path, found, _remove(f"rm {path}"))
    mode = stat.S_IMODE(found.st_mode)
    if mode & _OTHERS_ANY:
        raise UnsafeOwnerKey(
            "file", path, f"has mode {mode:o}, open to group or others", f"chmod 600 {path}"
        )


def _read_key(directory: Path, descriptor: int, name: str) -> bytes:
    """The key in the file ``name`` of the opened directory ``descriptor``.

    Raises:
        FileNotFoundError: there is no such file.
        OSError: it cannot be read.
        UnsafeOwnerKey: a symbolic link, not a regular file, another owner's
            or open to group or others (see :func:`_check_file`).
        InvalidArgument: it is not :data:`OWNER_KEY_BYTES` bytes (naming the path).
    """
    path = directory / name
    try:
        # O_NONBLOCK: a FIFO put in the key's place must not hang the open.
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        opened = os.open(name, flags, dir_fd=descriptor)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UnsafeOwnerKey(
                "file", path, "is a symbolic link", _remove(f"rm {path}")
            ) from error
        raise
    with os.fdopen(opened, "rb") as file:
        _check_file(path, os.fstat(file.fileno()))
        key = file.read(OWNER_KEY_BYTES + 1)
    if len(key) != OWNER_KEY_BYTES:
        raise InvalidArgument.of(
            "owner key file", str(path), f"holds {len(key)} bytes, not {OWNER_KEY_BYTES}"
        )
    return key


def _make_key(descriptor: int, name: str) -> None:
    """Links a new key to ``name`` in the opened directory unless a file of
    that name exists (then that file stays the key, whoever made it).

    Raises:
        OSError: the key cannot be written or linked.
    """
    drawn = f".{name}.{os.getpid()}.{secrets.token_hex(4)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    written = os.open(drawn, flags, 0o600, dir_fd=descriptor)
    try:
        with os.fdopen(written, "wb") as file:
            os.fchmod(file.fileno(), 0o600)  # a umask may only have taken bits away
            file.write(secrets.token_bytes(OWNER_KEY_BYTES))
            file.flush()
            os.fsync(file.fileno())
        # A link, unlike a rename, never replaces what another rank linked first.
        os.link(drawn, name, src_dir_fd=descriptor, dst_dir_fd=descriptor)
        os.fsync(descriptor)
    except FileExistsError:
        pass  # another process made it first: its key is the group's
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(drawn, dir_fd=descriptor)


def load_owner_key(group: str, environ: Mapping[str, str]) -> bytes:
    """The owner key of ``group``, made (mode 0600, its directory 0700) on
    first use, and read only from a file and a directory no one but this
    user could have chosen. Processes making it at once read the same key.

    Raises:
        UnsafeOwnerKey: the directory or the file is not safe to take a key
            from (one line naming the path, what is wrong and the fix).
        OSError: the directory or the file cannot be made or read.
        InvalidArgument: the file is not :data:`OWNER_KEY_BYTES` bytes.
    """
    directory = key_directory(environ)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    name = key_path(directory, group).name
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _check_directory(directory, descriptor)
        try:
            return _read_key(directory, descriptor, name)
        except FileNotFoundError:
            _make_key(descriptor, name)
        return _read_key(directory, descriptor, name)
    finally:
        os.close(descriptor)


def owner_key_or_none(group: str, environ: Mapping[str, str]) -> bytes | None:
    """:func:`load_owner_key`, or None (with a warning) when the key cannot be
    read or made: the ranks then send no owner digest, and the group's next
    restart rebuilds once instead of inheriting its stored plan.

    Raises:
        UnsafeOwnerKey: the key's file or directory is not safe (never None:
            a key someone else chose must stop the rank, not pass unseen).
    """
    try:
        return load_owner_key(group, environ)
    except (OSError, InvalidArgument) as error:
        _log.warning(
            "group %s: no owner key (%s); its ranks propose without an owner digest, so its "
            "next restart rebuilds instead of inheriting the stored plan (set %s to a "
            "directory this user can write)",
            quote_name(group),
            error,
            ENV_KEY_DIR,
        )
        return None


def owner_digest(key: bytes | None, group: str) -> str:
    """What every rank of ``group`` sends: SHA-256 (hex) of ``key`` and the
    group name; empty without a key."""
    if not key:
        return ""
    return hashlib.sha256(key + group.encode()).hexdigest()


def owner_digest_of(group: str, environ: Mapping[str, str]) -> str:
    """The owner digest of a group whose ranks need not share its key (a
    group of one rank): its own key's (:func:`owner_key_or_none`).

    Raises:
        UnsafeOwnerKey: see :func:`owner_key_or_none`.
    """
    return owner_digest(owner_key_or_none(group, environ), group)
