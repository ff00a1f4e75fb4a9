"""Modal dialogs: a yes/no confirmation, a small form, and a read-only detail view."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import RenderableType
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static

DIALOG_CSS = """
.dialog { width: 72; max-width: 100%; height: auto; max-height: 100%; border: thick $accent;
          background: $surface; padding: 0 1; }
.dialog Horizontal { height: auto; align-horizontal: right; }
.dialog Button { margin: 0 0 0 1; min-width: 8; }
.dialog .error { color: $error; }
"""


class Confirm(ModalScreen[bool]):
    """Ask before an action that changes the appliance; y/Enter confirms, n/Escape cancels."""

    DEFAULT_CSS = DIALOG_CSS
    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.question, id="question", markup=False)
            with Horizontal():
                yield Button("Yes (y)", id="yes", variant="warning")
                yield Button("No (n)", id="no", variant="primary")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)


@dataclass(frozen=True)
class Field:
    name: str
    label: str
    choices: tuple[str, ...] = ()  # a Select when given, else an Input
    value: str = ""
    password: bool = False


class Form(ModalScreen[dict[str, str] | None]):
    """A few named values; OK returns them (every field must be filled), Escape cancels."""

    DEFAULT_CSS = DIALOG_CSS
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, fields: list[Field]) -> None:
        super().__init__()
        self.title_text = title
        self.fields = fields

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text)
            for field in self.fields:
                yield Label(field.label)
                if field.choices:
                    yield Select([(c, c) for c in field.choices], value=field.value or field.choices[0],
                                 allow_blank=False, id=f"field-{field.name}")
                else:
                    yield Input(value=field.value, password=field.password, id=f"field-{field.name}")
            yield Static("", classes="error", id="form-error", markup=False)
            with Horizontal():
                yield Button("OK", id="ok", variant="primary")
                yield Button("Cancel", id="cancel")

    def values(self) -> dict[str, str]:
        found = {}
        for field in self.fields:
            widget = self.query_one(f"#field-{field.name}")
            found[field.name] = str(widget.value if isinstance(widget, Select | Input) else "").strip()
        return found

    def on_input_submitted(self) -> None:
        self.submit()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "ok":
            self.submit()
        else:
            self.dismiss(None)

    def submit(self) -> None:
        values = self.values()
        empty = [f.label for f in self.fields if not values[f.name]]
        if empty:
            self.query_one("#form-error", Static).update(f"{empty[0]} is required")
            return
        self.dismiss(values)

    def action_cancel(self) -> None:
        self.dismiss(None)


class Detail(ModalScreen[None]):
    """Read-only text or a laid-out view (a record, a generated password); Escape or Enter closes it."""

    DEFAULT_CSS = DIALOG_CSS
    BINDINGS = [Binding("escape,enter,q", "close", "Close")]

    def __init__(self, title: str, body: RenderableType) -> None:
        super().__init__()
        self.title_text = title
        self.body = body

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text)
            with VerticalScroll():
                yield Static(self.body, id="detail-body", markup=False)
            with Horizontal():
                yield Button("Close", id="close", variant="primary")

    def on_button_pressed(self) -> None:
        self.dismiss(None)

    def action_close(self) -> None:
        self.dismiss(None)
