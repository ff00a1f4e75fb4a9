"""The TUI's datasets screen: names and digests whole at 80x24 and 120x40 with the footer still on
one line, the selected dataset's facts below the table (or why the gateway would not give them),
and removal asked first, then the admin API's own route, nothing when declined. Against the fake
admin API of tests/unit/test_tui.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from textual.pilot import Pilot

from appliance.admin_client import Refused
from appliance.home import Home
from tests.support.pilot import until
from tests.unit.test_tui import HASH, Fake, dataset, sample_answers, screen_lines, select, show, shown_text, with_fake

if TYPE_CHECKING:
    from tui.app import AdminApp

LONG = "customer-support-tickets-2026-q1-redacted"  # 41 characters


class Deleting(Fake):
    """The fake admin API, answering a dataset's removal as the route does."""

    async def call(self, method: str, path: str, **kwargs: Any) -> Any:
        if method == "DELETE":
            self.calls.append((method, path, None))
            name = path.rsplit("/", 1)[1]
            return {"name": name, "sha256": HASH, "deleted": [HASH]}
        return await super().call(method, path, **kwargs)

    def deleted(self) -> list[str]:
        return [path for method, path, _ in self.calls if method == "DELETE"]


def run(home: Home, scenario: Any, answers: dict[str, Any] | None = None, size: tuple[int, int] = (80, 24)) -> None:
    async def swapped(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        deleting = Deleting(fake.answers)
        app.client = deleting  # type: ignore[assignment]
        await scenario(pilot, app, deleting)

    with_fake(home, answers or sample_answers(), swapped, size=size)


def test_names_and_digests_are_whole_at_80x24_and_the_footer_fits(home: Home) -> None:
    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await show(pilot, "D")
        lines = screen_lines(app)
        assert all(len(line) <= 80 for line in lines)
        assert any("support-faq" in line and "0e" * 32 in line for line in lines), "\n".join(lines)
        assert any(" faq " in line and HASH in line for line in lines), "\n".join(lines)
        assert lines[-1].startswith("d Dashboard") and "D Data" in lines[-1] and "q Quit" in lines[-1], lines[-1]
        assert "Datasets (x: remove)" in "\n".join(lines)
        await select(pilot, "datasets", "support-faq")
        await until(pilot, lambda: "support-faq trains on" in shown_text(app, "dataset"), "the details")
        shown = shown_text(app, "dataset")
        assert "0e" * 32 in shown and "SFT rows: 120 (108 train, 12 eval), stored 2026-12-02 10:00" in shown
        assert "from support-faq.jsonl; sensitive data: email 2 (redact)" in shown
        assert "1 older version: " + "3c" * 8 in shown
        assert ("GET", "/datasets/support-faq", None) in fake.calls

    run(home, scenario)


def test_a_long_name_and_its_digest_are_whole_at_120x40(home: Home) -> None:
    answers = {**sample_answers(), "/datasets": [{"name": LONG, "sha256": HASH}],
               f"/datasets/{LONG}": dataset(LONG, HASH)}

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await show(pilot, "D")
        await until(pilot, lambda: f"{LONG} trains on" in shown_text(app, "dataset"), "the details")
        lines = screen_lines(app)
        assert any(LONG in line and HASH in line for line in lines), "\n".join(lines)
        assert any(HASH in line for line in shown_text(app, "dataset").splitlines())

    run(home, scenario, answers, size=(120, 40))


def test_removing_asks_then_calls_the_route_and_nothing_when_declined(home: Home) -> None:
    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Deleting) -> None:
        await show(pilot, "D")
        await select(pilot, "datasets", "faq")
        await pilot.press("x")
        await until(pilot, lambda: type(app.screen).__name__ == "Confirm", "the question")
        assert "Remove dataset 'faq'?" in shown_text(app, "question")
        await pilot.press("n")
        await until(pilot, lambda: type(app.screen).__name__ != "Confirm", "the question gone")
        assert fake.deleted() == [], "declined: nothing asked"
        await pilot.press("x")
        await until(pilot, lambda: type(app.screen).__name__ == "Confirm", "the question again")
        await pilot.press("y")
        await until(pilot, lambda: fake.deleted() == ["/datasets/faq"], "the removal")

    run(home, scenario)  # type: ignore[arg-type]


def test_nothing_to_remove_is_not_offered_and_a_refusal_is_said_in_place(home: Home) -> None:
    answers = {**sample_answers(), "/datasets": [{"name": "faq", "sha256": HASH}],
               "/datasets/faq": Refused(409, "dataset 'faq' in the artifact store was changed since it was added")}

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Deleting) -> None:
        await show(pilot, "D")
        await until(pilot, lambda: "was changed" in shown_text(app, "dataset"), "the refusal")
        assert shown_text(app, "dataset").startswith("faq: dataset 'faq' in the artifact store was changed")
        fake.answers["/datasets"] = []
        app.screen.reload()  # type: ignore[attr-defined]
        await until(pilot, lambda: "No datasets yet" in shown_text(app, "datasets-empty"), "the empty note")
        await pilot.press("x")
        await pilot.pause(0.2)
        assert type(app.screen).__name__ == "Datasets" and fake.deleted() == []
        assert "x: remove" not in "\n".join(screen_lines(app))

    run(home, scenario, answers)  # type: ignore[arg-type]
