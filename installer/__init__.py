"""Installation: the demo model, the embedded Keycloak and its realm; profiling, planning,
staging and bundles live in their own modules."""

from installer.demo_model import prepare, verify
from installer.keycloak import install as install_keycloak
from installer.keycloak import keycloak_programs
from installer.realm import provision

__all__ = ["install_keycloak", "keycloak_programs", "prepare", "provision", "verify"]
