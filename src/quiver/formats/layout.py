"""Constants and the fixed-size preamble of the `.qctx` format (docs/FORMAT.md)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"QCTX\r\n\x1a\n"
SECTION_MAGIC = b"QSEC\r\n\x1a\n"
MAJOR = 1
MINOR = 7  # 1.1: graphs[].updateable; 1.2: weights[].encoding; 1.3: narrow section tensors; 1.4: tuning;
# 1.5: weights[].crc32; 1.6: graphs[].prepared; 1.7: deflated skeletons (graphs[].compression)
DEFLATED_SKELETONS = 0x1  # preamble flag (1.7): skeleton regions may be deflated; older readers refuse the file
PREAMBLE = struct.Struct("<8sHHIQQQ32sQ")
PREAMBLE_SIZE = PREAMBLE.size  # 80
DATA_START = 4096
ALIGNMENT = 64
PAGE_ALIGNMENT = 4096
PAGE_ALIGN_FROM = 65536  # tensors at least this large start on a page
MAX_HEADER = 64 * 1024 * 1024
MAX_RANK = 32
INLINE_LIMIT = 1024  # initializers smaller than this stay inside the skeleton
WEIGHT_LOCATION = "quiver-weight"  # external_data location of skeleton initializers


@dataclass(frozen=True)
class Preamble:
    major: int
    minor: int
    flags: int
    header_offset: int
    header_length: int
    file_length: int
    header_sha256: bytes
    reserved: int = 0

    def pack(self, magic: bytes = MAGIC) -> bytes:
        return PREAMBLE.pack(
            magic,
            self.major,
            self.minor,
            self.flags,
            self.header_offset,
            self.header_length,
            self.file_length,
            self.header_sha256,
            self.reserved,
        )

    @classmethod
    def unpack(cls, data: bytes) -> tuple[bytes, Preamble]:
        magic, *fields = PREAMBLE.unpack(data)
        return magic, cls(*fields)


def align_for(length: int) -> int:
    return PAGE_ALIGNMENT if length >= PAGE_ALIGN_FROM else ALIGNMENT


def align_up(offset: int, alignment: int) -> int:
    return (offset + alignment - 1) // alignment * alignment
