"""Wire-level cases: serialized messages broken on purpose, and raw bytes.

Mutations of a valid serialization (each names its family in the report):

* ``truncated``: cut at a random byte (often mid-varint or mid-field);
* ``bitflip``: 1-8 random bits flipped;
* ``unknown_field``: a field number the message does not have, of a random wire type;
* ``field_zero``: a field with number 0 (never valid);
* ``bad_utf8``: a string field (field 1 of the message, or the prompt text) holding invalid UTF-8;
* ``wrong_wire_type``: a known field number with another wire type;
* ``overlong_varint``: an 11-byte varint;
* ``bad_length``: a length prefix past the end;
* ``deep_groups``: start-group tags nested 10,000 deep;
* ``garbage``: random bytes, 0 B to 1 MiB.
"""

from __future__ import annotations

import random

MUTATIONS = ("truncated", "bitflip", "unknown_field", "field_zero", "bad_utf8", "wrong_wire_type",
             "overlong_varint", "bad_length", "deep_groups")
BAD_UTF8 = [b"\xff", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"abc\x80def"]


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def tag(field_number: int, wire_type: int) -> bytes:
    return varint((field_number << 3) | wire_type)


def _payload(rng: random.Random, wire_type: int) -> bytes:
    if wire_type == 0:
        return varint(rng.getrandbits(rng.choice((7, 32, 64))))
    if wire_type == 1:
        return rng.randbytes(8)
    if wire_type == 5:
        return rng.randbytes(4)
    body = rng.randbytes(rng.randint(0, 64))
    return varint(len(body)) + body


def mutate(data: bytes, rng: random.Random, kind: str) -> bytes:
    """``data`` (a serialized message) broken in the way ``kind`` names."""
    if kind == "truncated":
        return data[: rng.randrange(0, max(len(data), 1))]
    if kind == "bitflip":
        buf = bytearray(data or b"\x00")
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        return bytes(buf)
    if kind == "unknown_field":
        wire_type = rng.choice((0, 1, 2, 5))
        return data + tag(rng.randint(100, 2**29 - 1), wire_type) + _payload(rng, wire_type)
    if kind == "field_zero":
        wire_type = rng.choice((0, 2))
        return tag(0, wire_type) + _payload(rng, wire_type) + data
    if kind == "bad_utf8":
        bad = rng.choice(BAD_UTF8)
        return data + tag(1, 2) + varint(len(bad)) + bad
    if kind == "wrong_wire_type":
        return data + tag(rng.randint(1, 8), rng.choice((0, 1, 5, 2))) + _payload(rng, rng.choice((0, 1, 2, 5)))
    if kind == "overlong_varint":
        return data + tag(rng.randint(1, 8), 0) + b"\xff" * 10 + b"\x01"
    if kind == "bad_length":
        return data + tag(rng.randint(1, 8), 2) + varint(rng.choice((2**31, 2**32 - 1, 1000))) + b"x"
    if kind == "deep_groups":
        return data + tag(rng.randint(1, 8), 3) * 10_000
    raise ValueError(f"unknown mutation {kind!r}")


def garbage(rng: random.Random) -> bytes:
    size = rng.choice((0, 1, 2, rng.randint(3, 64), rng.randint(65, 4096), 1 << 20))
    return rng.randbytes(size)
