"""The design docs' size table is what `bench/house.py` measures at the two commits it names: the
table is generated, never written by hand, and a table edited by hand (or left behind by a change
to how the house is measured) fails here."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from bench import house

measure = cache(house.measure_revision)  # a commit's measures never change


def test_the_size_table_is_what_bench_house_measures_at_the_commits_it_names() -> None:
    shown = house.DOC_TABLE.search(house.DOC.read_text())
    assert shown is not None, f"{house.DOC}: no size table between its markers"
    base, head = shown.groups()
    assert shown.group(0) == house.doc_table(measure(base), measure(head))


def test_writing_the_table_replaces_it_between_its_markers_and_keeps_the_rest(tmp_path: Path) -> None:
    doc = tmp_path / "README.md"
    stale = ("<!-- size table: python -m bench.house --base 72fff8d --head 72fff8d --doc -->\n"
             "stale\n<!-- size table: end -->")
    doc.write_text(f"# Design\n\nbefore\n\n{stale}\n\nafter\n")
    base, head = measure("72fff8d"), measure("HEAD")
    house.write_doc(base, head, doc)
    assert doc.read_text() == f"# Design\n\nbefore\n\n{house.doc_table(base, head)}\n\nafter\n"


def test_a_doc_without_the_markers_is_refused_and_left_alone(tmp_path: Path) -> None:
    doc = tmp_path / "README.md"
    doc.write_text("# Design\n\nno table here\n")
    house_now = measure("HEAD")
    with pytest.raises(SystemExit, match="no single size table"):
        house.write_doc(house_now, house_now, doc)
    assert doc.read_text() == "# Design\n\nno table here\n"
