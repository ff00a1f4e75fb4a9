"""Installation: the demo model, the embedded Keycloak and its realm, PostgreSQL, monitoring;
profiling, planning, staging, bundles and backups, each in a module of its own.

Nothing is imported here: `appliance up` reads program specs from some of these modules, and
importing one must not import the rest.
"""

__all__: list[str] = []
