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

A rank 0 that cannot read or make its key (a read-only home, a file of
another size or readable by others) logs a warning and sends no digest:
the group's next restart then rebuilds once instead of inheriting its
plan, and nothing else changes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from moe_sidecar.core.defaults import ENV_KEY_DIR
from moe_sidecar.core.errors import InvalidArgument, quote_name

__all__ = [
    "OWNER_KEY_BYTES",
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


def _read_key(path: Path) -> bytes:
    """The key in ``path``.

    Raises:
        OSError: it cannot be read.
        InvalidArgument: it is not :data:`OWNER_KEY_BYTES` bytes, or others
            may read or write it (naming the path).
    """
    with path.open("rb") as file:
        mode = os.fstat(file.fileno()).st_mode
        key = file.read(OWNER_KEY_BYTES + 1)
    if stat.S_IMODE(mode) & 0o077:
        raise InvalidArgument.of(
            "owner key file", str(path), f"has mode {stat.S_IMODE(mode):o}; it must be 600"
        )
    if len(key) != OWNER_KEY_BYTES:
        raise InvalidArgument.of(
            "owner key file", str(path), f"holds {len(key)} bytes, not {OWNER_KEY_BYTES}"
        )
    return key


def load_owner_key(group: str, environ: Mapping[str, str]) -> bytes:
    """The owner key of ``group``, made (mode 0600, its directory 0700) on
    first use. A key is written whole to a file of its own and then linked
    into place, so two processes making one at once read the same key.

    Raises:
        OSError: the directory or the file cannot be made or read.
        InvalidArgument: the file is not a key (see :func:`_read_key`).
    """
    directory = key_directory(environ)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = key_path(directory, group)
    if not path.exists():
        drawn = directory / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
        descriptor = os.open(drawn, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(descriptor, "wb") as file:
                file.write(secrets.token_bytes(OWNER_KEY_BYTES))
                file.flush()
                os.fsync(file.fileno())
            os.link(drawn, path)
        except FileExistsError:
            pass  # another process made it first: its key is the group's
        finally:
            drawn.unlink(missing_ok=True)
    return _read_key(path)


def owner_key_or_none(group: str, environ: Mapping[str, str]) -> bytes | None:
    """:func:`load_owner_key`, or None (with a warning) when it fails: the
    ranks then send no owner digest, and the group's next restart rebuilds
    once instead of inheriting its stored plan."""
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
    group of one rank): its own key's (:func:`owner_key_or_none`)."""
    return owner_digest(owner_key_or_none(group, environ), group)
