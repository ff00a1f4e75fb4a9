"""Every audited route declares its audit action where it is declared (its name), and no route
that can change state is ever recorded as a read or summarised as monitoring."""

from __future__ import annotations

import inspect

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from appliance.home import Home
from appliance.settings import Settings
from serve.audit_trail import AUDITED_PREFIXES, MONITORING, action_of
from serve.gateway import ROLES_UNDER, create_app

READ_SUFFIXES = (".list", ".read", ".query")


def audited_routes(home: Home) -> list[APIRoute]:
    app = create_app(Settings(), home)
    return [r for r in app.routes if isinstance(r, APIRoute) and r.path.startswith(AUDITED_PREFIXES)]


def test_every_audited_route_names_its_action(home: Home) -> None:
    routes = audited_routes(home)
    assert len(routes) >= 20
    for route in routes:
        assert route.name != route.endpoint.__name__, f"{route.path}: no audit action declared (name=...)"
        params = {name: "x" for name in route.param_convertors}
        scope = {"method": sorted(route.methods)[0], "path": route.path, "route": route, "path_params": params}
        assert action_of(scope, 200) == route.name.format(**params)


def test_no_state_changing_route_is_recorded_as_a_read(home: Home) -> None:
    for route in audited_routes(home):
        changes = bool(route.methods - {"GET", "HEAD"})
        if changes:
            assert not route.name.endswith(READ_SUFFIXES), f"{route.methods} {route.path} is named a read"
            assert route.openapi_extra != MONITORING, f"{route.methods} {route.path} would be summarised"
        elif route.openapi_extra == MONITORING:
            assert route.name.endswith(READ_SUFFIXES)


def test_reads_of_users_settings_and_the_audit_log_are_each_recorded(home: Home) -> None:
    summarised = {r.path for r in audited_routes(home) if r.openapi_extra == MONITORING}
    assert summarised == {"/admin/services", "/admin/system", "/admin/pools", "/admin/plans", "/admin/jobs",
                          "/admin/adapters", "/admin/adapters/{name}/canary", "/admin/rl/tasksets", "/admin/rl/runs",
                          "/admin/rl/exports",
                          "/admin/rl/exports/{export_id}", "/admin/routing", "/admin/cache", "/admin/batches",
                          "/admin/alerts", "/admin/charts", "/admin/datasets", "/admin/rl/episodes"}


def admitted_roles(dependant: Dependant) -> list[frozenset[str]]:
    """The roles each `requires(...)` among a route's dependencies admits."""
    found = []
    for dependency in dependant.dependencies:
        call = dependency.call
        if getattr(call, "__qualname__", "").startswith("requires.<locals>."):
            found.append(inspect.getclosurevars(call).nonlocals["wanted"])
        found += admitted_roles(dependency)
    return found


def test_the_gate_before_bodies_never_refuses_a_caller_a_route_admits(home: Home) -> None:
    """Callers are refused on their headers by prefix (ROLES_UNDER) before any body is read:
    every audited route requires roles, all of them among its prefix's."""
    for route in audited_routes(home):
        prefix = next(prefix for prefix in ROLES_UNDER if route.path.startswith(prefix))  # the first applies
        admitted = admitted_roles(route.dependant)
        assert admitted, f"{route.path}: no role required"
        assert all(roles <= ROLES_UNDER[prefix] for roles in admitted), route.path
