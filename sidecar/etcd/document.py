"""What a node accepts of a plan document in etcd, and how it signs its own.

Pure but for :func:`read_key_file`.

Anyone who can write under the prefix can write any bytes, so a document
read from etcd is untrusted until it passes, in order:

1. its size: longer than ``max_document_bytes`` is set aside unread;
2. its authentication, when the cluster has a key (``--store-key-file``): the
   value must be ``MAC_PREFIX + hex(HMAC-SHA256(key, etcd key + "\\n" + body))
   + "\\n" + body``; the MAC binds the document to its key, so one group's
   document cannot be replayed under another group's key;
3. its decoding and ranges (:func:`~moe_sidecar.store.row_codec.decode_cluster_plan`
   runs the core's limits; the owner id, when there is one, is 64 hex
   digits), and the key naming the group it holds;
4. its plausibility against the group here: an epoch or generation more than
   ``max_epoch_lead`` / ``max_generation_lead`` past this node's is set
   aside (a real group never jumps that far; a forged one would refuse every
   later growth, or every reset).

A document that fails is a :class:`DocumentRefused`, naming why; the replica
counts and logs it, never merges it, and replaces it with its own join at
the next write.

Without a key, documents are written bare and a signed one is read without
checking its MAC (so nodes can be given the key one by one; a node with
the key refuses bare documents).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

from moe_sidecar.config.values import (
    DEFAULT_STORE_MAX_DOCUMENT_BYTES,
    DEFAULT_STORE_MAX_EPOCH_LEAD,
    DEFAULT_STORE_MAX_GENERATION_LEAD,
)
from moe_sidecar.core.cluster import ClusterPlan
from moe_sidecar.store.row_codec import RowError, decode_cluster_plan, encode_cluster_plan

__all__ = [
    "MAC_PREFIX",
    "MIN_KEY_BYTES",
    "DocumentRefused",
    "DocumentRules",
    "open_document",
    "read_key_file",
    "seal_document",
]

MAC_PREFIX = b"moe-sidecar-hmac-sha256:"
"""How a signed document starts; 64 hex digits and a newline follow."""
MIN_KEY_BYTES = 16
"""The shortest key accepted: guessing one must not be practical."""
_MAC_HEX = 64


class DocumentRefused(Exception):
    """A document in etcd that this node does not accept (``reason`` says why)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        """One of ``too_big``, ``unauthenticated``, ``bad_mac``, ``unreadable``,
        ``wrong_key``, ``implausible``."""
        self.message = message


@dataclass(frozen=True)
class DocumentRules:
    """What this node accepts of etcd's documents (the ``--store-*`` flags)."""

    max_document_bytes: int = DEFAULT_STORE_MAX_DOCUMENT_BYTES
    max_generation_lead: int = DEFAULT_STORE_MAX_GENERATION_LEAD
    max_epoch_lead: int = DEFAULT_STORE_MAX_EPOCH_LEAD
    key: bytes | None = None
    """The cluster's HMAC key (None: documents are not authenticated)."""


def read_key_file(path: Path) -> bytes:
    """The key in ``path`` (a trailing newline dropped).

    Raises:
        ValueError: the file cannot be read or holds fewer than
            :data:`MIN_KEY_BYTES` bytes (the message names the path, never the key).
    """
    try:
        key = path.read_bytes().rstrip(b"\r\n")
    except OSError as error:
        raise ValueError(
            f"--store-key-file {str(path)!r}: cannot read it: {error.strerror}"
        ) from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"--store-key-file {str(path)!r}: holds {len(key)} bytes; a key needs at least "
            f"{MIN_KEY_BYTES} (e.g. head -c 32 /dev/urandom | base64 > FILE)"
        )
    return key


def _mac(key: bytes, etcd_key: bytes, body: bytes) -> bytes:
    return hmac.new(key, etcd_key + b"\n" + body, hashlib.sha256).hexdigest().encode()


def seal_document(rules: DocumentRules, etcd_key: bytes, doc: ClusterPlan) -> bytes:
    """The value to write under ``etcd_key`` for ``doc`` (signed when there is a key)."""
    body = encode_cluster_plan(doc)
    if rules.key is None:
        return body
    return MAC_PREFIX + _mac(rules.key, etcd_key, body) + b"\n" + body


def open_document(
    rules: DocumentRules, etcd_key: bytes, value: bytes, name: str, local: ClusterPlan | None
) -> ClusterPlan:
    """The document under ``etcd_key`` (group ``name``), if this node accepts it.

    ``local`` is the group as this node holds it (None: not here yet).

    Raises:
        DocumentRefused: the value fails a check of the module docstring.
    """
    if len(value) > rules.max_document_bytes:
        raise DocumentRefused(
            "too_big",
            f"{len(value)} bytes; --store-max-document-bytes is {rules.max_document_bytes}",
        )
    body = _authenticated_body(rules, etcd_key, value)
    try:
        doc = decode_cluster_plan(body)
    except RowError as error:
        raise DocumentRefused("unreadable", str(error)) from None
    if doc.name != name:
        raise DocumentRefused("wrong_key", f"the key holds group {doc.name!r}")
    _check_plausible(rules, doc, local)
    return doc


def _authenticated_body(rules: DocumentRules, etcd_key: bytes, value: bytes) -> bytes:
    signed = value.startswith(MAC_PREFIX)
    if rules.key is None:
        if not signed:
            return value
        return value[len(MAC_PREFIX) + _MAC_HEX + 1 :]
    if not signed:
        raise DocumentRefused(
            "unauthenticated", "it carries no HMAC and this node has --store-key-file"
        )
    mac = value[len(MAC_PREFIX) : len(MAC_PREFIX) + _MAC_HEX]
    body = value[len(MAC_PREFIX) + _MAC_HEX + 1 :]
    if not hmac.compare_digest(mac, _mac(rules.key, etcd_key, body)):
        raise DocumentRefused("bad_mac", "its HMAC does not match this node's --store-key-file")
    return body


def _check_plausible(rules: DocumentRules, doc: ClusterPlan, local: ClusterPlan | None) -> None:
    epoch = local.epoch if local is not None else 0
    generation = local.generation if local is not None else 0
    if doc.epoch - epoch > rules.max_epoch_lead:
        raise DocumentRefused(
            "implausible",
            f"epoch {doc.epoch} is more than --store-max-epoch-lead={rules.max_epoch_lead} "
            f"past this node's {epoch}",
        )
    if doc.generation - generation > rules.max_generation_lead:
        raise DocumentRefused(
            "implausible",
            f"generation {doc.generation} is more than --store-max-generation-lead="
            f"{rules.max_generation_lead} past this node's {generation}",
        )
