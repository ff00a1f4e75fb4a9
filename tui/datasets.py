"""Datasets: the training datasets by name with the SHA-256 of the version each trains on, both
whole on an 80-column screen; below, the selected one's facts as `appliance data show` gives
them (read when the selection comes to it, its files checked against its digest by the gateway);
remove one, confirmed first (refused while a queued or running training job uses it)."""

from __future__ import annotations

from functools import partial
from typing import Any
from urllib.parse import quote

from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Label, Static

from appliance.admin_client import Refused
from appliance.datasets import Dataset, Version
from tui.panel import Panel

OLDER_SHOWN = 3  # older versions named below the one in use


class Datasets(Panel):
    DEFAULT_CSS = Panel.DEFAULT_CSS + """
    #datasets { height: 1fr; }
    #dataset { height: auto; padding: 0 1; }
    Label { padding: 0 1; text-style: bold; }
    """
    # Listed in the title (the footer lists the screens).
    BINDINGS = [Binding("x", "remove", "remove", show=False)]
    EMPTY = {"datasets": "No datasets yet: store one with `appliance data add FILE --name NAME` (an RL run's "
                         "export stores them too)."}

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, str] = {}  # name -> the digest of the version in use
        # What the selected dataset's line says, by (name, digest): read again once it has a new version.
        self.details: dict[tuple[str, str], str] = {}

    def body(self) -> ComposeResult:
        yield Label("Datasets", id="datasets-title")
        yield from self.listing("datasets")
        yield Static("", id="dataset", markup=False)

    def on_mount(self) -> None:
        self.query_one("#datasets", DataTable).add_columns("name", "sha256")

    async def load(self) -> None:
        listed: list[dict[str, Any]] = await self.client.call("GET", "/datasets")
        self.digests = {entry["name"]: entry["sha256"] for entry in listed}
        self.details = {key: text for key, text in self.details.items() if self.digests.get(key[0]) == key[1]}
        self.fill("datasets", [(name, (name, digest)) for name, digest in self.digests.items()])

    def _selection(self) -> tuple[str, str] | None:
        name = self.selected("datasets")
        return (name, self.digests[name]) if name in self.digests else None

    def offers(self, action: str, parameters: tuple[object, ...]) -> bool:
        if action == "remove":
            return self._selection() is not None
        return True

    def show_keys(self) -> None:
        self.query_one("#datasets-title", Label).update(self.titled("Datasets", ["remove"]))
        chosen = self._selection()
        self.query_one("#dataset", Static).update(self.details.get(chosen, "") if chosen else "")
        if chosen is not None and chosen not in self.details:
            self.run_worker(partial(self._guarded, partial(self._read, *chosen)),  # type: ignore[arg-type]  # textual's WorkType solves to Never for coroutine functions
                            group="dataset", exclusive=True)

    async def _read(self, name: str, digest: str) -> None:
        """The dataset's versions as `data show` reads them; what was wrong with it, if anything."""
        try:
            found = Dataset.model_validate(await self.client.call("GET", f"/datasets/{quote(name, safe='')}"))
            text = details(found)
        except Refused as exc:
            if exc.status not in (404, 409):  # gone since the list was read; files changed in the store
                raise
            text = f"{name}: {exc.reason}"
        self.details[(name, digest)] = text
        if self._selection() == (name, digest):
            self.query_one("#dataset", Static).update(text)

    def action_remove(self) -> None:
        chosen = self._selection()
        if chosen is not None:
            name = chosen[0]
            self.act(lambda: self.client.call("DELETE", f"/datasets/{quote(name, safe='')}"),
                     f"dataset {name} removed",
                     f"Remove dataset {name!r}? Its stored versions that no other dataset uses are deleted "
                     "(refused while a queued or running training job uses it).")


def details(dataset: Dataset) -> str:
    """A dataset's facts, short: the version in use (its whole digest, its rows, source, when
    stored, what the sensitive-data check found), then the older versions by digest."""
    current = next((v for v in dataset.versions if v.current), None)
    older = [v for v in dataset.versions if not v.current]
    lines = [f"{dataset.name}: no stored version is in use"] if current is None else [
        f"{dataset.name} trains on sha256 {current.sha256} (its files match it)",
        f"{current.kind or 'rows'}: {current.rows} ({current.train} train, {current.eval} eval), stored "
        f"{_time(current)}",
        f"from {current.source}; sensitive data: {_sensitive(current)}"]
    if older:
        named = ", ".join(f"{v.sha256[:16]} ({_time(v)})" for v in older[:OLDER_SHOWN])
        more = f" and {len(older) - OLDER_SHOWN} more" if len(older) > OLDER_SHOWN else ""
        lines.append(f"{len(older)} older version{'s' if len(older) > 1 else ''}: {named}{more}")
    return "\n".join(lines)


def _time(version: Version) -> str:
    return version.created[:16].replace("T", " ")


def _sensitive(version: Version) -> str:
    found = ", ".join(f"{kind} {n}" for kind, n in sorted(version.sensitive.items())) or "none"
    return f"{found} ({version.sensitive_action})"
