"""python-keycloak's errors become the core's, once, at the users boundary (the admin API, CLI and
TUI then answer them through the one error table)."""

from __future__ import annotations

import pytest
from keycloak.exceptions import KeycloakConnectionError, KeycloakPostError

from appliance.errors import ApplianceError, Conflict, NotFound, Unavailable
from appliance.roles import ROLE_ORDER, Role
from appliance.users import _keycloak


@pytest.mark.parametrize(("raised", "family", "says"), [
    (KeycloakPostError("exists", response_code=409), Conflict, "adding 'kate': a user with that name exists"),
    (KeycloakPostError("gone", response_code=404), NotFound, "no such user"),
    (KeycloakPostError("boom", response_code=500), Unavailable, "Keycloak refused (500)"),
    (KeycloakConnectionError("refused"), Unavailable, "Keycloak refused (no answer)"),
])
def test_keycloak_errors_are_translated_once(raised: Exception, family: type[ApplianceError], says: str) -> None:
    with pytest.raises(family, match=says.replace("(", r"\(").replace(")", r"\)")):
        with _keycloak("adding 'kate'"):
            raise raised


def test_every_role_has_a_rank() -> None:
    assert sorted(ROLE_ORDER) == sorted(Role)
