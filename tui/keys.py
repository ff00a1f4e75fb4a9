"""Keys: the API keys applications call with (yours, or everyone's for an administrator); create
one (shown once), change an active one's limits, revoke an active one. Below the table, the
selected key's own limits: the models it may use and its own token budget."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Label, Static

from appliance.api_keys import KeyState
from tui.dialogs import Detail, Field, Form
from tui.panel import Panel

EXPIRIES = ("90d", "30d", "7d", "365d", "never")
ALL, NONE = "all", "none"  # in the limits form: no model limit, no token budget of its own


class Keys(Panel):
    DEFAULT_CSS = Panel.DEFAULT_CSS + """
    #keys { height: 1fr; }
    #key-limits { height: auto; padding: 0 1; }
    Label { padding: 0 1; text-style: bold; }
    """
    # Listed in the title (the footer lists the screens).
    BINDINGS = [Binding("n", "create", "create", show=False), Binding("l", "limit", "limits", show=False),
                Binding("x", "revoke", "revoke", show=False)]
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
        if action in ("limit", "revoke"):  # only an active key's limits matter (api_keys.limit)
            name = self.selected("keys")
            return name is not None and self.keys.get(name, {}).get("state") not in (KeyState.REVOKED, KeyState.EXPIRED)
        return True

    def show_keys(self) -> None:
        self.query_one("#keys-title", Label).update(self.titled("API keys", ["create", "limit", "revoke"]))
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

    def action_limit(self) -> None:
        """Ask for the selected key's new limits (its present ones filled in), then whether, then
        change them; the route validates them as it does a new key's."""
        row = self.selected("keys")
        if row is None or row not in self.keys:
            return
        key = self.keys[row]
        name, owner = key["name"], key["owner"]

        def chosen(values: dict[str, str] | None) -> None:
            if values is None:
                return
            models, budget = values["models"], values["tokens"]
            limits = {"name": name, "owner": owner,
                      "models": None if models == ALL else models.replace(",", " ").split(),
                      "tokens_per_minute": None if budget == NONE else _number(budget)}
            self.act(lambda: self.client.call("PATCH", f"/keys/{name}", params={"owner": owner},
                                              json={field: limits[field] for field in ("models", "tokens_per_minute")}),
                     f"API key {name} of {owner} limits changed", f"Change the limits of API key {name!r}? "
                     f"From its next request: {_own(limits)}.")

        self.app.push_screen(Form(f"Limits of API key {name} of {owner}", [
            Field("models", f"models, comma-separated ({ALL}: any its owner may use)",
                  value=", ".join(key.get("models") or ()) or ALL),
            Field("tokens", f"its own tokens a minute ({NONE}: its owner's budget only)",
                  value=str(key.get("tokens_per_minute") or NONE))]), chosen)

    def action_revoke(self) -> None:
        row = self.selected("keys")
        if row is not None and row in self.keys:
            name, owner = self.keys[row]["name"], self.keys[row]["owner"]
            self.act(lambda: self.client.call("POST", f"/keys/{name}/revoke", params={"owner": owner}),
                     f"API key {name} of {owner} revoked",
                     f"Revoke API key {name!r} of {owner}? Its next request is refused.")


def limits(key: dict[str, Any]) -> str:
    """A key's own limits: the models it may use and its token budget (unset: its owner's)."""
    return f"{key['name']} of {key['owner']}: {_own(key)}"


def _own(key: dict[str, Any]) -> str:
    models = f"models {', '.join(key['models'])}" if key.get("models") else f"any model {key['owner']} may use"
    budget = (f"{key['tokens_per_minute']} tokens/min of its own, within {key['owner']}'s"
              if key.get("tokens_per_minute") else f"{key['owner']}'s token budget only")
    return f"{models}; {budget}"


def _number(text: str) -> int | str:
    """`text` as a whole number; as it is otherwise, for the route to refuse naming the field."""
    try:
        return int(text)
    except ValueError:
        return text


def _day(stamp: str | None) -> str:
    return stamp[:16].replace("T", " ") if stamp else ""
