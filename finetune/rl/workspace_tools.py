"""Runs inside the execution sandbox (finetune/rl/harness.py starts it in a child, with the system's
Python and no import from the appliance): one tool call of an episode's agent on its workspace,
the episode's own tmpfs at /workspace, which outlives each call. What it prints is the observation.

TOOL (the environment) is {"name": ..., "arguments": {...}}, checked against the tool's schema by
the host first. Every path is relative to the workspace and stays in it: an absolute path, a `..`
part, or a path that resolves elsewhere through a link is refused (the sandbox would contain it
anyway: nothing of the host but its programs is there). Exit status 0: the tool did its work; 2:
it was refused, saying why.
"""

import json
import os
import stat
import sys
from collections.abc import Callable

WORKSPACE = "/workspace"
MAX_LISTED = 500  # entries of a listing
MAX_FOUND = 200  # lines a search returns
MAX_READ = 1 << 20  # bytes of a file searched
MAX_OUTPUT = 1 << 17  # what a tool prints, at most: far below the sandbox's output limit, which ends it
MAX_PARTS = 32  # directories deep a path may go


class Refused(Exception):
    pass


def inside(path: str) -> str:
    """`path` in the workspace, or Refused naming why not."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise Refused("a path is a non-empty string")
    if path.startswith("/") or ".." in path.split("/"):
        raise Refused(f"{path[:200]!r}: paths are relative to the workspace, without '..'")
    if path.count("/") >= MAX_PARTS:
        raise Refused(f"{path[:200]!r}: more than {MAX_PARTS} parts")
    full = os.path.normpath(os.path.join(WORKSPACE, path))
    real = os.path.realpath(full)
    if real != WORKSPACE and not real.startswith(WORKSPACE + "/"):
        raise Refused(f"{path[:200]!r} leads out of the workspace")
    return full


def list_files(path: str = ".") -> str:
    top = inside(path)
    lines: list[str] = []
    for root, dirs, files in os.walk(top):
        dirs.sort()
        for name in [*(d + "/" for d in dirs), *sorted(files)]:
            lines.append(os.path.relpath(os.path.join(root, name), WORKSPACE) + ("/" if name.endswith("/") else ""))
            if len(lines) >= MAX_LISTED:
                return "\n".join(lines) + f"\n(first {MAX_LISTED} entries)"
    return "\n".join(lines) if lines else "(empty)"


def read_file(path: str, start_line: int = 1, end_line: int | None = None) -> str:
    full = inside(path)
    if not stat.S_ISREG(os.stat(full).st_mode):
        raise Refused(f"{path[:200]!r} is not a file")
    with open(full, "rb") as handle:
        text = handle.read(MAX_OUTPUT).decode("utf-8", "replace")
    lines = text.splitlines()
    end = len(lines) if end_line is None else min(end_line, len(lines))
    return "\n".join(f"{n}: {lines[n - 1]}" for n in range(max(1, start_line), end + 1)) or "(no such lines)"


def write_file(path: str, content: str) -> str:
    full = inside(path)  # its directories resolve inside: a link among them is followed only inside
    if os.path.lexists(full) and not stat.S_ISREG(os.lstat(full).st_mode):
        raise Refused(f"{path[:200]!r} is there and is not a file")
    os.makedirs(os.path.dirname(full), exist_ok=True)
    # O_NOFOLLOW: a link put where the file goes is refused, not written through.
    descriptor = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(content)
    return f"wrote {len(content.encode('utf-8'))} bytes to {path}"


def files_under(top: str) -> list[str]:
    if os.path.isfile(top):
        return [top]
    found = []
    for root, dirs, files in os.walk(top):
        dirs.sort()
        found += [os.path.join(root, name) for name in sorted(files)]
    return found


def search(text: str, path: str = ".") -> str:
    if not isinstance(text, str) or not text:
        raise Refused("search for a non-empty text")
    found: list[str] = []
    for full in files_under(inside(path)):
        if not stat.S_ISREG(os.lstat(full).st_mode):
            continue
        with open(full, "rb") as handle:
            content = handle.read(MAX_READ).decode("utf-8", "replace")
        for number, line in enumerate(content.splitlines(), 1):
            if text in line:
                found.append(f"{os.path.relpath(full, WORKSPACE)}:{number}: {line[:1000]}")
                if len(found) >= MAX_FOUND:
                    return "\n".join(found) + f"\n(first {MAX_FOUND} lines)"
    return "\n".join(found) if found else "(no match)"


def digest() -> str:
    """SHA-256 of the workspace: each entry's path, mode and content (a file's digest, a link's
    target), each field length-prefixed, in order; an entry it cannot read counts as its error.
    Not one of the agent's tools: the host asks for it at the end of an episode."""
    import hashlib

    total = hashlib.sha256()

    def field(data: bytes) -> None:
        total.update(len(data).to_bytes(8, "big") + data)

    for root, dirs, files in os.walk(WORKSPACE):
        dirs.sort()
        for name in [*dirs, *sorted(files)]:
            full = os.path.join(root, name)
            field(os.path.relpath(full, WORKSPACE).encode("utf-8", "surrogateescape"))
            try:
                mode = os.lstat(full).st_mode
                field(str(mode).encode())
                if stat.S_ISLNK(mode):
                    field(os.readlink(full).encode("utf-8", "surrogateescape"))
                elif stat.S_ISREG(mode):
                    with open(full, "rb") as handle:
                        field(hashlib.file_digest(handle, "sha256").digest())
            except OSError as exc:
                field(f"error {exc.errno}".encode())
    return total.hexdigest()


TOOLS: dict[str, Callable[..., str]] = {"list_files": list_files, "read_file": read_file, "write_file": write_file,
                                        "search": search, "digest": digest}


def main() -> int:
    call = json.loads(os.environ.pop("TOOL"))
    try:
        tool = TOOLS[call["name"]]
        said = tool(**call["arguments"])
    except Refused as exc:
        print(f"refused: {exc}")
        return 2
    except (OSError, UnicodeError, RecursionError) as exc:
        print(f"refused: {type(exc).__name__}: {exc.strerror if isinstance(exc, OSError) else exc}"[:1000])
        return 2
    data = said.encode("utf-8", "replace")
    sys.stdout.write(data[:MAX_OUTPUT].decode("utf-8", "ignore"))
    if len(data) > MAX_OUTPUT:
        sys.stdout.write(f"\n... [{len(data) - MAX_OUTPUT:,} bytes more]")
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
