"""The address forms of a sidecar: ``unix:///abs/path``, ``unix:rel/path`` or ``host:port``.

One syntax for ``--listen`` and for every client target (``--target``,
``MOE_SIDECAR_TARGET``), so the daemon and the client parse an address alike.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ADDRESS_FORMS",
    "MAX_UNIX_PATH_BYTES",
    "AddressError",
    "ListenAddress",
    "is_loopback",
    "parse_listen_address",
]

MAX_UNIX_PATH_BYTES = 107
"""Linux's ``sun_path`` holds 108 bytes including the terminating NUL."""


class AddressError(ValueError):
    """An address is malformed; the message names where it came from and the forms expected."""


@dataclass(frozen=True)
class ListenAddress:
    """One parsed ``--listen`` value: a Unix socket path or a TCP host and port."""

    target: str
    """The address as given, which is also what a client dials."""
    unix_path: Path | None = None
    host: str = ""
    port: int = 0

    @property
    def is_unix(self) -> bool:
        return self.unix_path is not None


ADDRESS_FORMS = "'unix:///absolute/path.sock', 'unix:relative/path.sock' or 'host:port'"


def parse_listen_address(value: str, field: str = "listen") -> ListenAddress:
    """Parses ``unix:///abs/path``, ``unix:rel/path`` or ``host:port``.

    The same forms serve ``--listen`` and every client target
    (``--target``, ``MOE_SIDECAR_TARGET``); ``field`` names the source in errors.

    Raises:
        AddressError: the address is malformed, the socket path too long, or
            the port out of range (the message names ``field`` and the
            forms expected).
    """
    if value.startswith("unix:"):
        raw = value[len("unix://") :] if value.startswith("unix://") else value[len("unix:") :]
        if value.startswith("unix://") and raw and not raw.startswith("/"):
            raise AddressError(
                f"{field}={value!r}: 'unix://' takes an absolute path ('unix:///run/x.sock'); "
                f"a relative one is 'unix:{raw}'"
            )
        if not raw:
            raise AddressError(f"{field}={value!r}: a Unix socket address needs a path")
        if len(raw.encode()) > MAX_UNIX_PATH_BYTES:
            raise AddressError(
                f"{field}={value!r}: the socket path is {len(raw.encode())} bytes; "
                f"Linux allows at most {MAX_UNIX_PATH_BYTES}"
            )
        return ListenAddress(target=value, unix_path=Path(raw))
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or "/" in value:
        raise AddressError(f"{field}={value!r}: expected {ADDRESS_FORMS} (e.g. 127.0.0.1:50051)")
    if host.startswith("[") != host.endswith("]"):
        raise AddressError(f"{field}={value!r}: unbalanced brackets around an IPv6 host")
    try:
        port = int(port_text)
    except ValueError:
        raise AddressError(
            f"{field}={value!r}: port {port_text!r} is not a number; expected {ADDRESS_FORMS}"
        ) from None
    if not 0 <= port <= 65535:
        raise AddressError(f"{field}={value!r}: port {port} is not in [0, 65535]")
    return ListenAddress(target=value, host=host, port=port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (of a ``host:port``) is a loopback address."""
    bare = host[1:-1] if host.startswith("[") else host
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False
