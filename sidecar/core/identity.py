"""A rank's lifetime: a secret the rank holds, an id the sidecar keeps.

Each manager (one process lifetime of one rank) makes a random token and
sends it with every proposal and commit. The sidecar never keeps or shows
the token: at its boundary (the wire codec, or the embedded transport) the
token becomes its SHA-256 digest, the lifetime's id, which is what the
decision core compares and what is stored. Operators see :func:`short_id`,
a prefix of the digest, which cannot be turned back into the token. So a
process that can reach the coordinator cannot act as another rank's lifetime
by reading ``GetGroup``, ``Watch``, logs or metrics.

A group's proof is a second secret of the same kind: one token for every
rank of one lifetime of an EP group, drawn by rank 0 and shared over the
group's CPU group before the first proposal, so only the group's real ranks
hold it. It crosses the boundary the same way (:func:`proof_id`); an empty
proof (a client older than proofs) stays empty.

A group's owner digest is a third: SHA-256 of the owner key that rank 0
keeps on disk (it outlives lifetimes) and the group name, which every rank
of a lifetime sends. It crosses the boundary hashed again (:func:`owner_id`),
so what is stored, and replicated to other nodes, is not what a rank sends.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Final

from moe_sidecar.core.errors import InvalidArgument
from moe_sidecar.core.limits import MAX_NAME_LENGTH

__all__ = [
    "MIN_SECRET_LENGTH",
    "OWNER_DIGEST_LENGTH",
    "SHORT_ID_LENGTH",
    "lifetime_id",
    "new_group_secret",
    "new_lifetime_secret",
    "owner_id",
    "proof_id",
    "short_id",
]

MIN_SECRET_LENGTH: Final = 16
"""Shortest token accepted: guessing one must not be practical."""
SHORT_ID_LENGTH: Final = 12
"""Hex digits of the id operators are shown."""


def new_lifetime_secret() -> str:
    """A fresh lifetime token: 128 random bits as 32 hex digits."""
    return secrets.token_hex(16)


def new_group_secret() -> str:
    """A fresh group proof token (rank 0 draws it): 128 random bits as 32 hex digits."""
    return secrets.token_hex(16)


def lifetime_id(secret: str, field: str = "lifetime") -> str:
    """The id (hex SHA-256) of a lifetime token.

    Raises:
        InvalidArgument: the token is shorter than :data:`MIN_SECRET_LENGTH`,
            longer than the name limit, or not printable ASCII (naming
            ``field``; the message never repeats the token).
    """
    if not isinstance(secret, str) or not MIN_SECRET_LENGTH <= len(secret) <= MAX_NAME_LENGTH:
        length = len(secret) if isinstance(secret, str) else None
        raise InvalidArgument(
            f"{field}: a lifetime token of {length} characters; it must be a random secret of "
            f"{MIN_SECRET_LENGTH} to {MAX_NAME_LENGTH} printable characters",
            field=field,
            value=length,
        )
    if not (secret.isascii() and secret.isprintable()):
        raise InvalidArgument(
            f"{field}: a lifetime token must be printable ASCII", field=field, value=None
        )
    return hashlib.sha256(secret.encode()).hexdigest()


def short_id(lifetime: str) -> str:
    """What operators are shown of a lifetime id."""
    return lifetime[:SHORT_ID_LENGTH]


def proof_id(secret: str, field: str = "group_proof") -> str:
    """The id (hex SHA-256) of a group proof token; empty stays empty (no proof).

    Raises:
        InvalidArgument: a non-empty token that is not a usable secret (see
            :func:`lifetime_id`; the message names ``field``, never the token).
    """
    if isinstance(secret, str) and not secret:
        return ""
    return lifetime_id(secret, field)


OWNER_DIGEST_LENGTH: Final = 64
"""Hex digits of an owner digest (a SHA-256)."""


def owner_id(digest: str, field: str = "owner_digest") -> str:
    """The id (hex SHA-256) of an owner digest; empty stays empty (no owner).

    Raises:
        InvalidArgument: a non-empty digest that is not 64 lowercase hex
            digits (naming ``field``, never the digest).
    """
    if isinstance(digest, str) and not digest:
        return ""
    if (
        not isinstance(digest, str)
        or len(digest) != OWNER_DIGEST_LENGTH
        or digest.strip("0123456789abcdef")
    ):
        length = len(digest) if isinstance(digest, str) else None
        raise InvalidArgument(
            f"{field}: {length} characters that are not an owner digest; it must be empty or "
            f"the {OWNER_DIGEST_LENGTH} lowercase hex digits of a SHA-256",
            field=field,
            value=length,
        )
    return hashlib.sha256(b"owner:" + digest.encode()).hexdigest()
