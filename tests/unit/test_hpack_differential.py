"""The relay's HPACK decoder (``shim.relay.hpack_decoder.Decoder``) against the ``hpack`` package, block by block.

The relay must decode every header block exactly as the runtime's decoder does, and keep its
copy of the client's dynamic table in step: a block it reads differently is a call routed or
checked on the wrong ``:path``. ``hpack`` (python-hyper's RFC 7541 implementation) is the
reference. Each "connection" is a sequence of blocks fed to a fresh pair of decoders; after
every block both return the same header list and hold the same dynamic table, or both refuse
the block (after a refusal the relay closes the connection, so the sequence ends there).

Blocks come from a seeded generator that writes every representation of RFC 7541 section 6:
indexed (static and dynamic), literal with incremental indexing / without indexing / never
indexed (indexed name and new name), Huffman-coded or raw strings, dynamic table size updates
(several at the start of a block, shrinking to 0 and growing back), entries larger than the
table. Then the same blocks corrupted (bytes flipped, cut short, inserted) and plain random
bytes, where the two must agree on refusing. Valid blocks are checked both ways the relay decodes:
all headers (intercepted calls) and ``:path`` only (relayed calls; the table must still match).
Corrupted blocks only with all headers: for relayed calls the relay leaves values it does not
need undecoded, so a bad Huffman string there is the runtime's to refuse.

The shim advertises a table size to clients: the runtime's, at most ``settings.MAX_TABLE_SIZE``,
or 0 while it answers without a runtime (docs/design.md, the relay). Once the client has
acknowledged 0, it may only send a size update to 0, at the start of a block; a larger one, or
one after a header field, is a COMPRESSION_ERROR (RFC 7541 4.2, 6.3; h2spec hpack/6.3).
``allowed_max`` is the decoder's name for the advertised size.

Deterministic (fixed seeds): 3,000 valid blocks, then up to 3,000 corrupted or random ones (a
connection ends at its first refused block); about 5 s.
"""

from __future__ import annotations

import random

import hpack
import pytest
from hpack.table import HeaderTable

from shim.relay.http2 import COMPRESSION_ERROR, H2Error
from shim.relay.hpack_decoder import Decoder
from tests.support.h2raw import hpack_int as integer
from tests.support.h2raw import hpack_string as string

STATIC = HeaderTable.STATIC_TABLE
NAMES = [b":path", b":authority", b"content-type", b"te", b"grpc-timeout", b"user-agent",
         b"authorization", b"x-request-id", b"traceparent", b"grpc-accept-encoding"]
CONNECTIONS = 300
BLOCKS_PER_CONNECTION = 10


# --------------------------------------------------------------------------- an HPACK writer

class Writer:
    """Random header blocks; ``table`` mirrors the peer's dynamic table (newest first)."""

    def __init__(self, rng: random.Random, max_size: int = 4096) -> None:
        self.rng = rng
        self.allowed = max_size
        self.max_size = max_size
        self.table: list[tuple[bytes, bytes]] = []

    def _size(self) -> int:
        return sum(len(n) + len(v) + 32 for n, v in self.table)

    def _insert(self, name: bytes, value: bytes) -> None:
        self.table.insert(0, (name, value))
        while self._size() > self.max_size:
            self.table.pop()

    def _resize(self, size: int) -> None:
        self.max_size = size
        while self._size() > self.max_size:
            self.table.pop()

    def _bytes(self) -> bytes:
        r = self.rng
        kind = r.random()
        if kind < 0.4:
            n = r.choice((0, 1, 3, 8, 20, 60))
            return bytes(r.choice(b"abcdefghijklmnopqrstuvwxyz0123456789-_/.") for _ in range(n))
        if kind < 0.7:
            return bytes(r.getrandbits(8) for _ in range(r.randrange(0, 40)))  # any octet, EOS-free Huffman
        if kind < 0.95:
            return r.choice([v for _, v in STATIC if v] + [b"/runtime.v1.ImageService/PullImage"])
        return b"x" * r.choice((1000, 4100, 9000))  # larger than the table: empties it

    def _name(self) -> bytes:
        r = self.rng
        return r.choice(NAMES) if r.random() < 0.7 else self._bytes().lower() or b"x"

    def field(self) -> bytes:
        r = self.rng
        choice = r.random()
        huffman = r.random() < 0.5
        n_static = len(STATIC)
        if choice < 0.3:  # indexed
            if self.table and r.random() < 0.5:
                return integer(n_static + 1 + r.randrange(len(self.table)), 7, 0x80)
            return integer(r.randrange(1, n_static + 1), 7, 0x80)
        prefix, first = r.choice(((6, 0x40), (4, 0x00), (4, 0x10)))  # incremental / without / never indexed
        if r.random() < 0.5:  # indexed name
            if self.table and r.random() < 0.3:
                index = n_static + 1 + r.randrange(len(self.table))
                name = self.table[index - n_static - 1][0]
            else:
                index = r.randrange(1, n_static + 1)
                name = STATIC[index - 1][0]
            head = integer(index, prefix, first)
        else:
            name = self._name()
            head = integer(0, prefix, first) + string(name, r.random() < 0.5)
        value = self._bytes()
        if first == 0x40:
            self._insert(name, value)
        return head + string(value, huffman)

    def block(self) -> bytes:
        r = self.rng
        out = bytearray()
        for _ in range(r.choice((0, 0, 0, 0, 1, 2))):  # size updates, only at the start
            size = min(self.allowed, r.choice((0, 0, 64, 200, self.allowed, r.randrange(self.allowed + 1))))
            self._resize(size)
            out += integer(size, 5, 0x20)
        for _ in range(r.randrange(0, 12)):
            out += self.field()
        return bytes(out)


def corrupt(rng: random.Random, block: bytes) -> bytes:
    data = bytearray(block or b"\x00")
    for _ in range(rng.randrange(1, 4)):
        what = rng.random()
        i = rng.randrange(len(data))
        if what < 0.4:
            data[i] ^= 1 << rng.randrange(8)
        elif what < 0.6:
            data[i] = rng.getrandbits(8)
        elif what < 0.8:
            del data[i:]
            if not data:
                data.append(rng.getrandbits(8))
        else:
            data[i:i] = bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 4)))
    return bytes(data)


# --------------------------------------------------------------------------- the comparison


def reference(allowed: int = 4096) -> hpack.Decoder:
    ref = hpack.Decoder(max_header_list_size=1 << 30)
    ref.max_allowed_table_size = allowed
    return ref


def ref_table(ref: hpack.Decoder) -> list[tuple[bytes, bytes]]:
    return [(bytes(n), bytes(v)) for n, v in ref.header_table.dynamic_entries]


def feed(ours: Decoder, ref: hpack.Decoder, block: bytes, full: bool = True) -> bool:
    """Decode ``block`` with both; assert they agree. True if both accepted it.

    ``full=False`` is the relay's path for relayed calls: only ``:path`` is returned, but the
    dynamic table must be exactly the same.
    """
    before = list(ours.dynamic)
    try:
        expected = [(bytes(n), bytes(v)) for n, v in ref.decode(block, raw=True)]
    except hpack.HPACKError as e:
        expected_error: Exception | None = e
    else:
        expected_error = None
    try:
        path, headers, inserted = ours.decode(block, full=full)
    except H2Error as e:
        assert expected_error is not None, f"shim refused a block hpack decodes: {e}; block {block.hex()}"
        assert e.code == COMPRESSION_ERROR, f"refused with code {e.code}, not COMPRESSION_ERROR: {e}"
        return False
    assert expected_error is None, f"shim accepted a block hpack refuses ({expected_error!r}); block {block.hex()}"
    if full:
        assert headers == expected, f"block {block.hex()}"
    paths = [v for n, v in expected if n == b":path"]
    assert path == (paths[-1] if paths else None)
    assert ours.dynamic == ref_table(ref), f"dynamic tables differ after block {block.hex()}"
    assert ours.max_size == ref.header_table.maxsize
    if ours.dynamic != before:
        assert inserted, "the block changed the table but the decoder says it did not (it must reach the runtime)"
    return True


def connections(seed: int):
    rng = random.Random(seed)
    for _ in range(CONNECTIONS):
        writer = Writer(rng)
        yield rng, [writer.block() for _ in range(BLOCKS_PER_CONNECTION)]


@pytest.mark.parametrize("full", [True, False], ids=["intercepted", "relayed"])
def test_valid_blocks_decode_exactly_like_hpack(full: bool) -> None:
    accepted = 0
    for _, blocks in connections(13):
        ours, ref = Decoder(4096), reference()
        for block in blocks:
            assert feed(ours, ref, block, full), f"valid block refused: {block.hex()}"
            accepted += 1
    assert accepted == CONNECTIONS * BLOCKS_PER_CONNECTION


def test_corrupted_and_random_blocks_are_refused_exactly_when_hpack_refuses() -> None:
    refused = accepted = 0
    for rng, blocks in connections(1013):
        ours, ref = Decoder(4096), reference()
        for block in blocks:
            if rng.random() < 0.1:
                block = bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 30)))
            else:
                block = corrupt(rng, block)
            if feed(ours, ref, block):
                accepted += 1
            else:
                refused += 1
                break  # a COMPRESSION_ERROR ends the connection
    # both outcomes are exercised, many times
    assert refused > 200 and accepted > 100, (refused, accepted)


# --------------------------------------------------------------------------- table size 0 advertised


def acknowledged_zero() -> tuple[Decoder, hpack.Decoder]:
    """Decoders after the client acknowledged SETTINGS_HEADER_TABLE_SIZE = 0 (entries still held)."""
    ours, ref = Decoder(4096), reference()
    warmup = string(b"x-before", False)
    block = b"\x40" + warmup + string(b"ack", False)  # one entry in the 4096-byte table
    assert feed(ours, ref, block)
    ours.allowed_max = 0
    ref.max_allowed_table_size = 0
    return ours, ref


def test_after_table_size_zero_only_an_update_to_zero_at_block_start_is_accepted() -> None:
    rng = random.Random(7)
    # an update above the advertised 0 is refused, whatever its size
    for size in (1, 32, 4096, 4097, 1 << 20):
        ours, ref = acknowledged_zero()
        block = integer(size, 5, 0x20) + b"\x82"
        assert not feed(ours, ref, block), f"size update to {size} accepted after table size 0 was advertised"
    # an update after a header field is refused (RFC 7541 4.2)
    ours, ref = acknowledged_zero()
    assert not feed(ours, ref, b"\x82" + integer(0, 5, 0x20))
    # the update to 0 empties the table; afterwards the stale entry is gone, and an
    # incrementally indexed literal is decoded but never stored
    ours, ref = acknowledged_zero()
    assert feed(ours, ref, integer(0, 5, 0x20) + b"\x82" + b"\x40" + string(b"x-new", True) + string(b"v", False))
    assert ours.dynamic == [] and ours.max_size == 0
    assert not feed(ours, ref, b"\xbe")  # index 62: the dynamic table is empty
    # random valid blocks keep decoding exactly like hpack with a 0-byte table
    ours, ref = acknowledged_zero()
    writer = Writer(rng, max_size=0)
    assert feed(ours, ref, integer(0, 5, 0x20) + writer.field())
    for _ in range(300):
        assert feed(ours, ref, writer.block())
