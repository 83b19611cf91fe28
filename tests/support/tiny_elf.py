"""A static x86-64 Linux program of a few hundred bytes, made without a compiler.

``hello_program(message)`` returns an ELF executable that writes ``message`` to stdout
and exits 0: enough for a container image whose process must run (images fabricated by
:mod:`tests.support.oci` have no binaries). x86-64 only.
"""

from __future__ import annotations

import platform
import struct

BASE = 0x400000
_EHDR, _PHDR = 64, 56


def supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def hello_program(message: bytes) -> bytes:
    code_offset = _EHDR + _PHDR
    code = (
        b"\xb8\x01\x00\x00\x00"  # mov eax, 1 (write)
        b"\xbf\x01\x00\x00\x00"  # mov edi, 1 (stdout)
        b"\x48\x8d\x35" + struct.pack("<i", 16)  # lea rsi, [rip + 16]: the message after the code
        + b"\xba" + struct.pack("<I", len(message))  # mov edx, len
        + b"\x0f\x05"  # syscall
        b"\xb8\x3c\x00\x00\x00"  # mov eax, 60 (exit)
        b"\x31\xff"  # xor edi, edi
        b"\x0f\x05"  # syscall
    )
    assert len(code) == 33  # the lea's displacement above counts on it
    size = code_offset + len(code) + len(message)
    ehdr = (b"\x7fELF\x02\x01\x01\x00" + b"\x00" * 8
            + struct.pack("<HHIQQQIHHHHHH", 2, 0x3E, 1, BASE + code_offset, _EHDR, 0, 0, _EHDR, _PHDR, 1, 0, 0, 0))
    phdr = struct.pack("<IIQQQQQQ", 1, 5, 0, BASE, BASE, size, size, 0x1000)  # PT_LOAD, R+X
    return ehdr + phdr + code + message
