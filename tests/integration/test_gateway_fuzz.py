"""Schemathesis against the running gateway's own OpenAPI document (bounded run).

Any 5xx must be one the gateway meant (an OpenAI-shaped error such as engine_unavailable) or one
passed through from the engine; an unhandled exception in the gateway fails the test.
(Schemathesis' pytest plugin does not load under pytest 9 here, so Hypothesis drives each
operation's strategy directly.)
"""

from __future__ import annotations

import json
import re

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.integration.conftest import Running
from tests.integration.realm import Realm

# It fires every operation with made-up ids, cancels and retirements among them: job 1 may be another
# module's running job, so it has the session appliance to itself.
pytestmark = pytest.mark.session_exclusive

# Fuzzing these would stop the engine or lock out the admin mid-run.
SKIPPED = re.compile(r"^POST (/admin/services/|/admin/users/.+/disable$)")
EXAMPLES_PER_OPERATION = 20  # per operation; about 30 operations


def test_no_server_error_of_the_gateways_own(running: Running) -> None:
    realm = Realm(running)
    token = realm.admin_token()
    schema = schemathesis.openapi.from_url(f"{realm.gateway}/openapi.json")
    failures: list[str] = []
    tried = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        if SKIPPED.match(f"{operation.method.upper()} {operation.path}"):
            continue
        tried += 1

        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case) -> None:
            case.headers = {**(case.headers or {}), "Authorization": f"Bearer {token}"}
            if isinstance(case.body, dict):
                case.body["max_tokens"] = 4  # keep generation short; the gateway is under test
            response = case.call(timeout=120)
            if response.status_code >= 500:
                try:
                    error = json.loads(response.text)["error"]
                except (ValueError, KeyError, TypeError):
                    error = None
                assert error is not None, (f"unhandled {response.status_code} from {case.method} "
                                           f"{case.formatted_path}: {response.text[:300]}")

        try:
            check()
        except AssertionError as exc:
            failures.append(str(exc).splitlines()[0])
    assert tried >= 10
    assert not failures, "\n".join(failures)
