"""safetensors files handled as bytes, never as tensors: read a header, build one, copy tensor
bytes between files in the kernel. Staging and pre-sharding write their files this way, so memory
stays a few chunks whatever the size of a tensor."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from appliance.errors import ApplianceError

CHUNK = 64 << 20
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1,
               "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}


class SafetensorsFileError(ApplianceError):
    """A safetensors file is unreadable or shorter than its header says."""


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header and where its data begins."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(8)
            if len(raw) < 8:
                raise SafetensorsFileError(f"{path}: truncated: no safetensors header")
            (length,) = struct.unpack("<Q", raw)
            header = handle.read(length)
    except OSError as exc:
        raise SafetensorsFileError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if len(header) < length:
        raise SafetensorsFileError(f"{path}: truncated inside its safetensors header")
    try:
        return json.loads(header), 8 + length
    except ValueError as exc:
        raise SafetensorsFileError(f"{path}: the safetensors header is not JSON: {exc}") from exc


def build_header(tensors: Iterable[tuple[str, str, list[int], int]], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and header of a file holding (name, dtype, shape, bytes) in that order."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape, size in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned, as safetensors does
    return struct.pack("<Q", len(raw)) + raw


def copy_range(src: int, dst: int, start: int, length: int, on_bytes: Callable[[int], None] = lambda n: None) -> None:
    """Append `length` bytes of `src` from `start` to `dst`: in the kernel where it can
    (copy_file_range), else through a bounded buffer."""
    position, remaining = start, length
    try:
        while remaining:
            done = os.copy_file_range(src, dst, min(remaining, CHUNK), position)
            if done == 0:
                raise SafetensorsFileError(f"source ended {remaining:,} bytes early (truncated while copying?)")
            position, remaining = position + done, remaining - done
            on_bytes(done)
    except OSError:  # another filesystem or kernel without it: plain reads and writes
        while remaining:
            chunk = os.pread(src, min(remaining, CHUNK), position)
            if not chunk:
                raise SafetensorsFileError(
                    f"source ended {remaining:,} bytes early (truncated while copying?)") from None
            write_all(dst, chunk)
            position, remaining = position + len(chunk), remaining - len(chunk)
            on_bytes(len(chunk))


def write_all(fd: int, data: bytes | memoryview) -> None:
    """os.write until every byte is written (it may write fewer)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]
