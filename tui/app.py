"""`appliance tui`: the administrator's terminal app. It takes the cached login at start (or logs
in with the device-code flow) and holds it as its own session, so a later `appliance token` for
another user leaves it as it is; it reaches the appliance only through the gateway's admin API and
metrics."""

from __future__ import annotations

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from appliance import connection as connections
from appliance import login
from appliance.admin_client import AdminClient, NotLoggedIn, Unreachable
from appliance.home import Home
from appliance.settings import Settings
from tui.audit_log import AuditLog
from tui.dashboard import Dashboard
from tui.datasets import Datasets
from tui.dialogs import DIALOG_CSS
from tui.episodes import Episodes
from tui.keys import Keys
from tui.models import Models
from tui.panel import Panel
from tui.rl_runs import RlRuns
from tui.training import Training
from tui.users import Users


class Login(ModalScreen[bool]):
    """The device authorization grant: shows where to approve and waits (in a thread) for it."""

    DEFAULT_CSS = DIALOG_CSS
    BINDINGS = [Binding("r", "start", "Retry"), Binding("escape", "dismiss(False)", "Cancel")]

    app: AdminApp

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static("Log in to the appliance's Keycloak", id="login-title")
            yield Static("Asking Keycloak for a device code ...", id="login-text", markup=False)
            yield Button("Cancel (Esc)", id="login-cancel")

    def on_mount(self) -> None:
        self.action_start()

    def on_button_pressed(self) -> None:
        self.dismiss(False)

    def action_start(self) -> None:
        self.run_worker(self._login, thread=True, exclusive=True)

    def _show(self, url: str, code: str) -> None:
        self.app.call_from_thread(self.query_one("#login-text", Static).update,
                                  f"Open {url}\nin a browser, sign in and approve the code {code}.\n"
                                  "Waiting for the approval ...")

    def _login(self) -> None:
        try:
            token = login.device_login(self.app.session.connection, self._show)
        except login.LoginError as exc:
            self.app.call_from_thread(self.query_one("#login-text", Static).update,
                                      f"Login failed: {exc.one_line()}\nPress r to try again.")
            return
        self.app.session.adopt(token)
        self.app.call_from_thread(self.dismiss, True)


class AdminApp(App[None]):
    TITLE = "appliance"
    # Episodes has no key in the footer, which fills 80 columns with one more: the RL screen's E leads there.
    MODES = {"dashboard": Dashboard, "models": Models, "training": Training, "datasets": Datasets, "rl": RlRuns,
             "episodes": Episodes, "users": Users, "keys": Keys, "audit": AuditLog}
    BINDINGS = [Binding("d", "switch_mode('dashboard')", "Dashboard"),
                Binding("m", "switch_mode('models')", "Models"),
                Binding("j", "switch_mode('training')", "Jobs"),
                Binding("D", "switch_mode('datasets')", "Data"),
                Binding("e", "switch_mode('rl')", "RL"),
                Binding("u", "switch_mode('users')", "Users"),
                Binding("k", "switch_mode('keys')", "Keys"),
                Binding("a", "switch_mode('audit')", "Audit"),
                Binding("L", "login", "Login", show=False),
                Binding("q", "quit", "Quit")]

    def __init__(self, settings: Settings, home: Home) -> None:
        super().__init__()
        self.settings = settings
        self.home = home
        self.session = login.Session(connections.current(lambda: (settings, home)), again="press L to log in again")
        self.client = AdminClient(self.session.connection, session=self.session)

    async def on_mount(self) -> None:
        self.sub_title = self.client.base_url
        await self.switch_mode("dashboard")
        try:
            self.sub_title = f"{await self.client.username()} @ {self.client.base_url}"
        except NotLoggedIn:
            self.action_login()
        except Unreachable:
            pass  # the dashboard's banner says so and keeps retrying

    def action_login(self) -> None:
        def done(ok: bool | None) -> None:
            if ok:
                self.run_worker(self._logged_in)  # type: ignore[arg-type]  # textual's WorkType solves to Never for coroutine functions

        self.push_screen(Login(), done)

    async def _logged_in(self) -> None:
        self.sub_title = f"{await self.client.username()} @ {self.client.base_url}"
        if isinstance(self.screen, Panel):
            self.screen.reload()

    async def on_unmount(self) -> None:
        await self.client.close()
