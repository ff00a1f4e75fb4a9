"""The realm roles the appliance uses: what realm provisioning creates, what the gateway and the
admin API require, what adapters are served to, and what the CLI and the TUI offer."""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """A user may hold several; the first of ROLE_ORDER decides their limits."""

    ADMIN = "admin"
    USER = "user"
    TRAINER = "trainer"
    AUDITOR = "auditor"
    RL_POLICY = "rl-policy"  # the RL service identity's: it calls a GRPO run's policy while it trains


# The most generous first: a user's limits are those of the first role they hold.
ROLE_ORDER = (Role.ADMIN, Role.TRAINER, Role.AUDITOR, Role.USER, Role.RL_POLICY)
