"""Sensitive data's settings: the kinds the scanner finds and what the gateway, dataset ingestion and
RL export do with each."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from appliance.settings.section import Section

SensitiveAction = Literal["block", "redact", "flag", "allow"]
DEFAULT_PROMPTS: dict[str, SensitiveAction] = {"payment_card": "block", "iban": "block", "secret": "block",
                                               "email": "flag", "phone": "flag", "national_id": "flag"}
DEFAULT_ANSWERS: dict[str, SensitiveAction] = {"payment_card": "redact", "iban": "redact", "secret": "redact",
                                               "email": "flag", "phone": "flag", "national_id": "flag"}


class CompliancePolicy(Section):
    """What the gateway does with each kind of sensitive data it finds: email, phone, payment_card,
    iban, secret, national_id, and the kinds of `compliance.patterns` and plug-in detectors (a kind
    not named keeps its built-in default; one without any: flag)."""

    IN_SUPERVISOR_CONFIG = False

    prompts: dict[str, SensitiveAction] = Field(
        default_factory=lambda: dict(DEFAULT_PROMPTS),
        description="In prompts: block (refuse the request), redact (before the engine sees it), flag (mark "
        "the audit record) or allow.")
    answers: dict[str, SensitiveAction] = Field(
        default_factory=lambda: dict(DEFAULT_ANSWERS),
        description="In answers: redact (before the client sees it, streamed answers included), flag or allow "
        "(an answer cannot be refused once it streams).")

    @field_validator("answers")
    @classmethod
    def _answers_not_blocked(cls, value: dict[str, SensitiveAction]) -> dict[str, SensitiveAction]:
        if blocked := sorted(kind for kind, action in value.items() if action == "block"):
            raise ValueError(f"{blocked}: an answer cannot be blocked (it may be streaming already); use redact")
        return value


class RolePolicy(CompliancePolicy):
    """A role's own actions, for the kinds it names (the rest: the default policy's)."""

    prompts: dict[str, SensitiveAction] = Field(default_factory=dict)
    answers: dict[str, SensitiveAction] = Field(default_factory=dict)


class ComplianceSettings(Section):
    """Sensitive data, wherever it is screened: the one scanner's kinds (built in, `patterns`,
    plug-in `detectors`) and what each use does with a finding. The gateway screens every prompt
    before the engine sees it and every answer before the client does, as the caller's roles'
    policy says (`default`, `roles`: a user holding several roles gets, kind by kind, the most
    generous of their policies); dataset ingestion (`appliance data add`) and RL export screen
    every training row (`training_data`)."""

    IN_SUPERVISOR_CONFIG = False

    patterns: dict[str, str] = Field(
        default_factory=dict, description="Further kinds to find in prompts, answers and training data: name = "
        "regular expression (Python `regex`).")
    detectors: list[str] = Field(
        default_factory=lambda: ["national_ids"],
        description="Plug-in detectors to use in prompts, answers and training data: names of `appliance.detectors` "
        "entry points (national_ids: US social security and UK national insurance numbers).")
    training_data: Literal["block", "redact", "allow"] = Field(
        "block", description="What dataset ingestion (`appliance data add`) and RL export do with any kind found "
        "in a training row: refuse the whole set, replace each finding by its kind, or keep it (always reported).")
    default: CompliancePolicy = Field(default_factory=CompliancePolicy,
                                      description="The gateway's policy for every role without one of its own.")
    roles: dict[str, RolePolicy] = Field(default_factory=dict,
                                         description="The gateway's policies of roles, by role name.")
    hold_chars: int = Field(
        256, ge=80, le=65536, description="Of a streamed answer, how much text may be held back while it could "
        "still be part of a finding to redact.")

    @field_validator("patterns")
    @classmethod
    def _patterns_compile(cls, value: dict[str, str]) -> dict[str, str]:
        import regex

        for kind, pattern in value.items():
            if not re.fullmatch(r"[a-z][a-z0-9_]{0,39}", kind):
                raise ValueError(f"{kind!r}: a kind is lower-case letters, digits and '_' (up to 40)")
            try:
                regex.compile(pattern)
            except regex.error as exc:
                raise ValueError(f"{kind}: not a regular expression ({exc})") from None
        return value
