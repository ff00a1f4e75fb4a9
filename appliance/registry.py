"""A registry kept in one JSON file in the state directory (adapters, hosts, datasets, task sets):
typed by pydantic, read without a lock (the file is only ever replaced whole, so a reader sees the
old version or the new one), and changed read-modify-write under an exclusive lock, so two
processes changing it at once never lose each other's change.

A file that does not parse or validate is an error naming the file, never an empty registry: an
empty one written back would drop every record.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import TypeAdapter, ValidationError

from appliance.durable import replace_file
from appliance.errors import StateError

T = TypeVar("T")


_VALIDATORS: dict[object, TypeAdapter[Any]] = {}  # one per document type: building one compiles its schema


def _validator(shape: type[T]) -> TypeAdapter[T]:
    if shape not in _VALIDATORS:
        _VALIDATORS[shape] = TypeAdapter(shape)
    return _VALIDATORS[shape]


class JsonRegistry(Generic[T]):
    """The JSON file at `path` holding one value of type `shape` (a pydantic model, or a mapping
    of names to records); an absent file holds the empty value (`shape` validated from `{}`).
    `what` names it in errors ("the host registry"); `mode` is the file's permission bits."""

    def __init__(self, path: Path, shape: type[T], what: str, *, mode: int = 0o600) -> None:
        self.path = path
        self.what = what
        self.mode = mode
        self._shape = _validator(shape)

    @property
    def lock_path(self) -> Path:
        """The file whose exclusive lock a change holds (beside the registry, never replaced; named
        as the hand-written locks of the adapter and host registries were, so that a process still
        running the code from before an upgrade and a new one exclude each other)."""
        return self.path.with_name(f".{self.path.stem}.lock")

    def read(self) -> T:
        """The registry as it stands; StateError naming the file if it cannot be read or is not
        a valid registry."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return self._shape.validate_python({})
        except OSError as exc:
            raise self._unreadable(exc) from exc
        try:
            return self._shape.validate_json(data)
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            raise self._unreadable(exc) from exc

    @contextmanager
    def change(self) -> Iterator[T]:
        """The registry to change in the block, read under the lock and written back (atomically,
        before the lock is let go) only if the block succeeds. Not reentrant: a change inside
        another change of the same registry waits for itself."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            value = self.read()
            yield value
            replace_file(self.path, self._serialised(value), mode=self.mode)
        finally:
            os.close(lock)  # and with it the lock

    def _serialised(self, value: T) -> bytes:
        if isinstance(value, dict):  # records keyed by name, in name order: stable to read and diff
            value = dict(sorted(value.items()))  # type: ignore[assignment]
        return self._shape.dump_json(value, indent=1) + b"\n"

    def _unreadable(self, exc: Exception) -> StateError:
        return StateError(f"{self.what} {self.path} is unreadable: {_first_problem(exc)}",
                          hint=f"restore {self.path} from a backup")


def _first_problem(exc: Exception) -> str:
    """One line for what is wrong: a validation's first error (where, what) and how many more,
    never pydantic's whole dump with every input in it."""
    if isinstance(exc, ValidationError):
        errors = exc.errors()
        first = errors[0]
        where = ".".join(map(str, first["loc"])) or "the document"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return f"{where}: {first['msg']}{more}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
