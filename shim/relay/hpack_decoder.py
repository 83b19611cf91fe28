"""HPACK (RFC 7541) decoding for the relay: bounded in work and memory.

The relay reads a request's ``:path`` from every header block (all headers only for
intercepted calls) and must mirror the client's dynamic table exactly as the
runtime's decoder does. It does no more work than that:

- Values are Huffman-decoded only when needed: ``:path``, every header of an
  intercepted call, and an entry inserted into a non-empty table (its size counts).
  An entry that cannot fit in the table whatever it decodes to (a Huffman string of
  n bytes decodes to at least 8n/30 octets) just empties the table, undecoded.
- The header list size (RFC 9113 SETTINGS_MAX_HEADER_LIST_SIZE: name + value + 32 per
  field) is counted; past ``max_list_size`` decoding goes on (the table must stay in
  step) but no header is kept and ``HeaderListTooLarge`` is raised at the end. Values
  not decoded count with their encoded length.
- A dynamic table size update above ``allowed_max`` (what the shim advertised, once the
  client acknowledged it), or not at the start of a block, is a COMPRESSION_ERROR.
- ``:path`` values are cached per connection, and so is what a header block that left
  the table as it was decoded to (its ``:path`` and list size; gRPC clients index every
  header, so most requests repeat a short block of indices): at most ``path_cache_bytes``
  for both. Any change to the table forgets the blocks.
"""

from __future__ import annotations

from typing import NamedTuple

from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

from .http2 import COMPRESSION_ERROR, H2Error

_STATIC = HeaderTable.STATIC_TABLE
_STATIC_LEN = len(_STATIC)
_STATIC_SIZES = tuple(len(n) + len(v) + 32 for n, v in _STATIC)
_PATH = b":path"
_PATH_HUFFMAN = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH).encode(_PATH)
_CACHE_KEY_MAX = 512  # longer encoded :path values are decoded every time, never cached
_BLOCK_KEY_MAX = 128  # longer header blocks are decoded every time, never remembered
_CACHE_ENTRY_COST = 100  # what a remembered value costs beyond its bytes: objects and a dict slot
_ENTRY_OVERHEAD = 32


Snapshot = tuple[int, int, list[tuple[bytes, bytes]]]  # the dynamic table: max size, size, entries


class HeaderListTooLarge(Exception):
    """The block decoded fine (the table is in step) but its header list is over the limit."""

    def __init__(self, size: int, limit: int, inserted: bool) -> None:
        super().__init__(f"header list of at least {size} bytes, limit {limit}")
        self.size, self.limit, self.inserted = size, limit, inserted


def _integer(data: bytes, i: int, prefix_bits: int) -> tuple[int, int]:
    mask = (1 << prefix_bits) - 1
    value = data[i] & mask
    i += 1
    if value < mask:
        return value, i
    shift = 0
    while True:
        if i >= len(data):
            raise H2Error("truncated HPACK integer", COMPRESSION_ERROR)
        b = data[i]
        i += 1
        value += (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7
        if shift > 28:
            raise H2Error("HPACK integer too large", COMPRESSION_ERROR)


def _string(data: bytes, i: int, n: int) -> tuple[bytes, bool, int]:
    """Decoder._raw with the common one-byte length inline (it runs for every literal field)."""
    if i < n:
        b = data[i]
        length = b & 0x7F
        if length != 0x7F:
            end = i + 1 + length
            if end <= n:
                return data[i + 1:end], bool(b & 0x80), end
    return Decoder._raw(data, i)


def changes_table(block: bytes) -> bool:
    """True if decoding ``block`` changes the decoder's dynamic table (a literal with
    incremental indexing, or a table size update), read without decoding a value or
    knowing the table. A block it cannot read counts as changing it (the peer judges it)."""
    i, n = 0, len(block)
    try:
        while i < n:
            b = block[i]
            if b & 0x80:  # indexed field
                _, i = _integer(block, i, 7)
            elif b & 0x60:  # 01: literal with incremental indexing; 001: dynamic table size update
                return True
            else:  # 0000 / 0001: literal without indexing / never indexed
                index, i = _integer(block, i, 4)
                if index == 0:
                    _, _, i = _string(block, i, n)
                _, _, i = _string(block, i, n)
        return False
    except (H2Error, IndexError):
        return True


class CacheUse(NamedTuple):
    bytes: int  # charged against path_cache_bytes: both caches
    paths: int  # fields whose :path value is kept
    blocks: int  # header blocks whose :path is kept


class Decoder:
    """HPACK decoder that mirrors the peer's dynamic table.

    ``decode(block, full=False)`` returns ``(path, headers, inserted)``: the ``:path``
    value, all headers when ``full`` (for intercepted calls), and whether the block
    changed the dynamic table (then it must still reach the runtime's decoder).
    """

    def __init__(self, max_size: int = 4096, max_list_size: int = 1 << 24, path_cache_bytes: int = 16384) -> None:
        self.max_size = max_size
        self.allowed_max = max_size  # the largest table size the peer may switch to
        self.max_list_size = max_list_size
        self.size = 0
        self.dynamic: list[tuple[bytes, bytes]] = []  # newest first
        self.path_cache_bytes = path_cache_bytes
        self._path_cache: dict[bytes, bytes] = {}
        self._cache_used = 0
        # header blocks that left the table as it was -> (:path, header list size); valid
        # while the table does not change (``_forget_blocks``)
        self._blocks: dict[bytes, tuple[bytes | None, int]] = {}
        self._blocks_used = 0

    def snapshot(self) -> Snapshot:
        return self.max_size, self.size, list(self.dynamic)

    def restore(self, snap: Snapshot) -> None:
        self.max_size, self.size, self.dynamic = snap[0], snap[1], list(snap[2])
        self._forget_blocks()

    def cache_use(self) -> CacheUse:
        """What the caches hold now (``bytes`` is what counts against ``path_cache_bytes``)."""
        return CacheUse(self._cache_used, len(self._path_cache), len(self._blocks))

    def clear_cache(self) -> None:
        self._forget_blocks()
        self._path_cache.clear()
        self._cache_used = 0

    def _forget_blocks(self) -> None:
        """The table changed: what a remembered block decodes to may have too."""
        if self._blocks:
            self._blocks.clear()
            self._cache_used -= self._blocks_used
            self._blocks_used = 0

    def path_of(self, data: bytes) -> tuple[bytes | None, Snapshot | None]:
        """A new request's header block: its ``:path``, and the table as it was before
        the block if the block changed it (``restore`` it to decode the block again).

        A block decoded before that left the table as it was, with the table unchanged
        since, is not decoded again.
        """
        known = self._blocks.get(data)
        if known is not None:
            if known[1] > self.max_list_size:
                raise HeaderListTooLarge(known[1], self.max_list_size, False)
            return known[0], None
        before = self.snapshot()
        path, _, inserted, listed = self._decode(data, False)
        if inserted:
            return path, before
        if len(data) <= _BLOCK_KEY_MAX:
            cost = len(data) + _CACHE_ENTRY_COST
            if self._cache_used + cost <= self.path_cache_bytes:
                self._blocks[data] = (path, listed)
                self._blocks_used += cost
                self._cache_used += cost
        return path, None

    def _entry(self, index: int) -> tuple[bytes, bytes]:
        if 0 < index <= _STATIC_LEN:
            return _STATIC[index - 1]
        j = index - _STATIC_LEN - 1
        if 0 <= j < len(self.dynamic):
            return self.dynamic[j]
        raise H2Error(f"HPACK index {index} out of range", COMPRESSION_ERROR)

    @staticmethod
    def _raw(data: bytes, i: int) -> tuple[bytes, bool, int]:
        """The encoded string at ``i``: (bytes as sent, Huffman-coded?, next index)."""
        if i >= len(data):
            raise H2Error("truncated HPACK string", COMPRESSION_ERROR)
        huffman = bool(data[i] & 0x80)
        length, i = _integer(data, i, 7)
        end = i + length
        if end > len(data):
            raise H2Error("truncated HPACK string", COMPRESSION_ERROR)
        return data[i:end], huffman, end

    @staticmethod
    def _decoded(raw: bytes, huffman: bool) -> bytes:
        if not huffman:
            return raw
        try:
            return decode_huffman(raw)
        except Exception as e:  # noqa: BLE001  (hpack raises several types for a bad string: all the peer's fault)
            raise H2Error(f"bad Huffman string: {e}", COMPRESSION_ERROR) from None

    def _path(self, data: bytes, i: int) -> tuple[bytes, int]:
        if i >= len(data):
            raise H2Error("truncated HPACK string", COMPRESSION_ERROR)
        length, j = _integer(data, i, 7)
        key = data[i:j + length]
        cached = self._path_cache.get(key)
        if cached is not None:
            return cached, j + length
        raw, huffman, end = self._raw(data, i)
        value = self._decoded(raw, huffman)
        cost = len(key) + len(value) + _CACHE_ENTRY_COST
        if len(key) <= _CACHE_KEY_MAX and self._cache_used + cost <= self.path_cache_bytes:
            self._path_cache[key] = value
            self._cache_used += cost
        return value, end

    def _insert(self, name: bytes, value: bytes) -> None:
        self._forget_blocks()
        self.dynamic.insert(0, (name, value))
        self.size += len(name) + len(value) + _ENTRY_OVERHEAD
        self._evict()

    def _evict(self) -> None:
        while self.size > self.max_size and self.dynamic:
            n, v = self.dynamic.pop()
            self.size -= len(n) + len(v) + _ENTRY_OVERHEAD

    def _cannot_fit(self, name_len: int, raw: bytes, huffman: bool) -> bool:
        least = len(raw) * 8 // 30 if huffman else len(raw)
        return name_len + least + _ENTRY_OVERHEAD > self.max_size

    def decode(self, data: bytes, full: bool = False) -> tuple[bytes | None, list[tuple[bytes, bytes]], bool]:
        path, headers, inserted, _ = self._decode(data, full)
        return path, headers, inserted

    def _decode(self, data: bytes, full: bool) -> tuple[bytes | None, list[tuple[bytes, bytes]], bool, int]:
        i, n = 0, len(data)
        path: bytes | None = None
        headers: list[tuple[bytes, bytes]] = []
        inserted = False
        listed = 0  # header list size so far
        limit = self.max_list_size
        first = True
        while i < n:
            b = data[i]
            if b & 0x80:  # indexed
                if b != 0xFF:
                    index = b & 0x7F
                    i += 1
                else:
                    index, i = _integer(data, i, 7)
                if 0 < index <= _STATIC_LEN:
                    name, value = _STATIC[index - 1]
                    listed += _STATIC_SIZES[index - 1]
                else:
                    name, value = self._entry(index)
                    listed += len(name) + len(value) + _ENTRY_OVERHEAD
                if name == _PATH:
                    path = value
                if full and listed <= limit:
                    headers.append((name, value))
                first = False
                continue
            if b & 0xE0 == 0x20:  # dynamic table size update
                size, i = _integer(data, i, 5)
                if not first:
                    raise H2Error("HPACK table size update after a header field", COMPRESSION_ERROR)
                if size > self.allowed_max:
                    raise H2Error(f"HPACK table size update to {size}, above the advertised {self.allowed_max}",
                                  COMPRESSION_ERROR)
                self._forget_blocks()
                self.max_size = size
                self._evict()
                inserted = True
                continue
            first = False
            indexing = bool(b & 0x40)
            index = b & (0x3F if indexing else 0x0F)
            if index == (0x3F if indexing else 0x0F):
                index, i = _integer(data, i, 6 if indexing else 4)
            else:
                i += 1
            if index:
                name = self._entry(index)[0]
            else:
                raw, huffman, i = _string(data, i, n)
                if full or (indexing and self.max_size and not self._cannot_fit(0, raw, huffman)):
                    name = self._decoded(raw, huffman)
                elif raw == _PATH or (huffman and raw == _PATH_HUFFMAN):
                    name = _PATH
                else:  # a name we have no use for: only its length counts
                    name = raw
            if name == _PATH:
                value, i = self._path(data, i)
                path = value
            else:
                raw, huffman, i = _string(data, i, n)
                if full or (indexing and self.max_size and not self._cannot_fit(len(name), raw, huffman)):
                    value = self._decoded(raw, huffman)
                else:
                    value = raw
                    if indexing:  # the entry cannot fit (or the table is 0 bytes): it empties the table
                        had_entries = bool(self.dynamic)
                        self._forget_blocks()
                        self.dynamic.clear()
                        self.size = 0
                        inserted = inserted or had_entries
                        indexing = False
            listed += len(name) + len(value) + _ENTRY_OVERHEAD
            if full and listed <= limit:
                headers.append((name, value))
            if indexing:
                had_entries = bool(self.dynamic)
                self._insert(name, value)
                inserted = inserted or had_entries or bool(self.dynamic)  # a 0-size table stays empty
        if listed > limit:
            raise HeaderListTooLarge(listed, limit, inserted)
        return path, headers, inserted, listed
