"""The locked JSON registry (appliance.registry) the adapter, host, dataset and task-set
registries are kept in: no change lost to a concurrent writer, no silent reset of a corrupt file."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest
from pydantic import BaseModel

from appliance.errors import StateError
from appliance.registry import JsonRegistry


class Record(BaseModel):
    writer: int
    number: int


def registry(path: Path, mode: int = 0o600) -> JsonRegistry[dict[str, Record]]:
    return JsonRegistry(path, dict[str, Record], "the test registry", mode=mode)


def add_names(path: Path, writer: int, count: int) -> None:
    """One writer process: `count` changes, each adding one name of its own."""
    for number in range(count):
        with registry(path).change() as records:
            records[f"w{writer}-{number}"] = Record(writer=writer, number=number)


@pytest.mark.integration
def test_two_processes_writing_at_once_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "state" / "records.json"
    context = multiprocessing.get_context("spawn")  # a fresh interpreter each: no lock state shared by fork
    writers = [context.Process(target=add_names, args=(path, writer, 50)) for writer in (1, 2)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(timeout=120)
        assert process.exitcode == 0
    records = registry(path).read()
    assert len(records) == 100
    assert {(r.writer, r.number) for r in records.values()} == {(w, n) for w in (1, 2) for n in range(50)}


def test_an_absent_file_is_the_empty_registry_and_a_change_creates_it(tmp_path: Path) -> None:
    path = tmp_path / "records.json"
    assert registry(path).read() == {}
    with registry(path).change() as records:
        records["b"] = Record(writer=0, number=2)
        records["a"] = Record(writer=0, number=1)
    assert list(registry(path).read()) == ["a", "b"], "written in name order"


def test_a_failed_change_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "records.json"
    with registry(path).change() as records:
        records["a"] = Record(writer=0, number=1)
    before = path.read_bytes()
    with pytest.raises(RuntimeError), registry(path).change() as records:
        records["b"] = Record(writer=0, number=2)
        raise RuntimeError("refused halfway")
    assert path.read_bytes() == before


@pytest.mark.parametrize("content", [b"{not json", b'{"a": {"writer": "one"}}', b"[1, 2]"])
def test_a_corrupt_file_is_an_error_naming_it_and_is_never_reset(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "records.json"
    path.write_bytes(content)
    with pytest.raises(StateError, match=f"the test registry {path} is unreadable") as raised:
        registry(path).read()
    assert str(path) in (raised.value.hint or "")
    with pytest.raises(StateError, match="is unreadable"), registry(path).change() as records:
        records["a"] = Record(writer=0, number=1)
    assert path.read_bytes() == content, "the corrupt file is left for the operator to restore"


def test_a_file_that_cannot_be_read_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "records.json"
    path.mkdir()  # unreadable as a file, even for root
    with pytest.raises(StateError, match=f"the test registry {path} is unreadable"):
        registry(path).read()


@pytest.mark.parametrize("mode", [0o600, 0o644])
def test_the_file_gets_its_mode_whatever_the_umask_and_the_lock_is_private(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "records.json"
    old = os.umask(0)
    try:
        with registry(path, mode).change() as records:
            records["a"] = Record(writer=0, number=1)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == mode
    assert registry(path).lock_path.stat().st_mode & 0o777 == 0o600
