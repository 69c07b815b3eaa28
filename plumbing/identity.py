"""Identities are minted, not counted: incarnations, ids and transfer secrets.

Anything that crosses a process boundary and can outlive a restart carries a value minted
here: every process start mints its ``incarnation``; the gateway mints worker ids and
request ids, the decode worker channel ids, transfer ids and transfer secrets. All come from
``secrets`` (the OS's CSPRNG), so a restarted process can never reuse its predecessor's ids
and nobody can guess the next one (``docs/architecture.md``, "Identities").

The frame tag binds a KV channel op to one transfer: both ends compute it from the transfer
id and its secret, the sender frames its pages with it, and the receiver refuses a frame
whose tag is not the one of the transfer it posted the receive for. The secret itself never
travels on the KV channel.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

TRANSFER_SECRET_BYTES = 16


def mint_id() -> int:
    """A random non-zero 64-bit id (a ``uint64`` on the wire; 0 stays "unset")."""
    while True:
        value = secrets.randbits(64)
        if value:
            return value


def mint_secret() -> bytes:
    """A transfer secret: ``TRANSFER_SECRET_BYTES`` random bytes."""
    return secrets.token_bytes(TRANSFER_SECRET_BYTES)


def secrets_match(presented: bytes, expected: bytes) -> bool:
    """Constant-time comparison of a presented secret with the minted one."""
    return hmac.compare_digest(bytes(presented), bytes(expected))


def frame_tag(transfer_id: int, secret: bytes) -> int:
    """The int64 tag of one transfer's frames: a keyed BLAKE2b digest of its id."""
    digest = hashlib.blake2b(transfer_id.to_bytes(8, "little"), key=bytes(secret), digest_size=8)
    return int.from_bytes(digest.digest(), "little", signed=True)
