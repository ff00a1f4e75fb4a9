"""Keys: the API keys applications call with (yours, or everyone's for an administrator); create
one (shown once), revoke an active one. Below the table, the selected key's own limits: the models
it may use and its own token budget (set when it is created)."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Label, Static

from appliance.api_keys import KeyState
from tui.dialogs import Detail, Field, Form
from tui.panel import Panel

EXPIRIES = ("90d", "30d", "7d", "365d", "never")


class Keys(Panel):
    DEFAULT_CSS = Panel.DEFAULT_CSS + """
    #keys { height: 1fr; }
    #key-limits { height: auto; padding: 0 1; }
    Label { padding: 0 1; text-style: bold; }
    """
    # Listed in the title (the footer lists the screens).
    BINDINGS = [Binding("n", "create", "create", show=False), Binding("x", "revoke", "revoke", show=False)]
    EMPTY = {"keys": "No API keys yet: create one with n (or `appliance keys create NAME --user USER`)."}

    def __init__(self) -> None:
        super().__init__()
        self.keys: dict[str, dict[str, Any]] = {}

    def body(self) -> ComposeResult:
        yield Label("API keys", id="keys-title")
        yield from self.listing("keys")
        yield Static("", id="key-limits", markup=False)

    def on_mount(self) -> None:
        self.query_one("#keys", DataTable).add_columns("name", "owner", "state", "expires", "last used")

    async def load(self) -> None:
        keys = await self.client.call("GET", "/keys")
        # Rows by owner and name: a key's name is its owner's, and two users may share one.
        self.keys = {f"{key['owner']}/{key['name']}": key for key in keys}
        self.fill("keys", [(row, (key["name"], key["owner"], key["state"], _day(key["expires"]) or "never",
                                  _day(key["last_used"]) or "never")) for row, key in self.keys.items()])

    def offers(self, action: str, parameters: tuple[object, ...]) -> bool:
        if action == "revoke":
            name = self.selected("keys")
            return name is not None and self.keys.get(name, {}).get("state") not in (KeyState.REVOKED, KeyState.EXPIRED)
        return True

    def show_keys(self) -> None:
        self.query_one("#keys-title", Label).update(self.titled("API keys", ["create", "revoke"]))
        key = self.keys.get(self.selected("keys") or "")
        self.query_one("#key-limits", Static).update(limits(key) if key else "")

    def action_create(self) -> None:
        def chosen(values: dict[str, str] | None) -> None:
            if values is None:
                return

            async def create() -> None:
                expiry = None if values["expires"] == "never" else values["expires"]
                made: Any = await self.client.call("POST", "/keys", json={
                    "name": values["name"], "owner": values["owner"], "expires_in": expiry})
                self.app.push_screen(Detail(f"API key {made['name']} for {made['owner']}",
                                            f"The key (shown only now):\n{made['secret']}"))

            self.act(create, f"API key {values['name']} created")

        self.app.push_screen(Form("Create an API key", [Field("name", "name"), Field("owner", "user"),
                                                        Field("expires", "expires in", EXPIRIES)]), chosen)

    def action_revoke(self) -> None:
        row = self.selected("keys")
        if row is not None and row in self.keys:
            name, owner = self.keys[row]["name"], self.keys[row]["owner"]
            self.act(lambda: self.client.call("POST", f"/keys/{name}/revoke", params={"owner": owner}),
                     f"API key {name} of {owner} revoked",
                     f"Revoke API key {name!r} of {owner}? Its next request is refused.")


def limits(key: dict[str, Any]) -> str:
    """A key's own limits: the models it may use and its token budget (unset: its owner's)."""
    models = f"models {', '.join(key['models'])}" if key.get("models") else f"any model {key['owner']} may use"
    budget = (f"{key['tokens_per_minute']} tokens/min of its own, within {key['owner']}'s"
              if key.get("tokens_per_minute") else f"{key['owner']}'s token budget only")
    return f"{key['name']} of {key['owner']}: {models}; {budget}"


def _day(stamp: str | None) -> str:
    return stamp[:16].replace("T", " ") if stamp else ""
