"""Refused requests are summarised per source and interval, so that no client can flood the
audit log."""

from __future__ import annotations

from appliance.changes import Target
from audit import AuditEvent
from serve.summaries import Refusals, cap_text


def refused(source: str, status: int = 401, resource: str = "/v1/x") -> AuditEvent:
    return AuditEvent(request_id="r", action="auth.denied", outcome="denied", status=status, source=source,
                      resource=resource)


def test_the_first_refusal_per_source_and_status_is_recorded_the_rest_summarised() -> None:
    clock = [0.0]
    refusals = Refusals(interval_s=10, max_sources=8, clock=lambda: clock[0])
    decided = [refusals.own_record(refused("10.0.0.1")) for _ in range(1000)]
    assert decided.count(True) == 1
    assert refusals.own_record(refused("10.0.0.1", status=404))
    assert refusals.own_record(refused("10.0.0.2"))
    assert refusals.due() == [], "the interval has not ended"
    clock[0] = 10.0
    [summary] = refusals.due()
    assert (summary.action, summary.source, summary.status, summary.count) == ("refused.summary", "10.0.0.1", 401, 999)
    assert refusals.own_record(refused("10.0.0.1")), "a new interval records the first again"


def test_admitted_requests_and_clients_that_left_are_never_summarised() -> None:
    refusals = Refusals(interval_s=10, max_sources=8)
    for status in (200, 499, 500, 503):
        assert all(refusals.own_record(refused("a", status)) for _ in range(3))


def test_sources_beyond_the_cap_are_summarised_together() -> None:
    clock = [0.0]
    refusals = Refusals(interval_s=10, max_sources=2, clock=lambda: clock[0])
    own = [refusals.own_record(refused(f"127.0.0.{n}")) for n in range(100)]
    assert own.count(True) == 3, "two sources apart, the rest as one"
    [summary] = refusals.due(all_now=True)
    assert summary.source == "*" and summary.count == 97


def test_capped_text_is_at_most_256_bytes_and_tells_long_texts_apart() -> None:
    long_a, long_b = "/v1/" + "a" * 65536, "/v1/" + "a" * 65535 + "b"
    assert len(cap_text(long_a).encode()) <= 256 and cap_text(long_a) != cap_text(long_b)
    assert cap_text("/v1/[link=x]\n\ud800") == "/v1/[link=x]??"
    assert len(cap_text("é" * 300).encode()) <= 256


def test_one_users_refusals_are_never_counted_under_another_and_a_summary_names_no_object() -> None:
    """A user trying another's key three times, then a second user refused once, from one source:
    each user's refusals are their own, and a summary says nothing of what the counted ones asked."""
    refusals = Refusals(interval_s=10, max_sources=8)

    def by(user: str, resource: str, key_name: str) -> AuditEvent:
        return AuditEvent(request_id="r", action="keys.revoke", outcome="denied", status=403, source="127.0.0.1",
                          username=user, resource=resource, key=key_name, model="m",
                          target=Target(kind="key", name=key_name))

    assert [refusals.own_record(by("mallory", f"/admin/keys/k{n}/revoke", f"k{n}")) for n in range(3)] == [
        True, False, False]
    assert refusals.own_record(by("bob", "/admin/users", "b")), "another user's first refusal: a record of its own"
    [summary] = refusals.due(all_now=True)
    assert (summary.username, summary.count) == ("mallory", 2)
    assert (summary.resource, summary.target, summary.model, summary.key) == (None, None, None, None)
