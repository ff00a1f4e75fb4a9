"""What every settings section shares: its base model, which refuses unknown keys and any value
that would break supervisord's configuration, and the checks several sections make (ports, host
names, loopback addresses)."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

Port = Annotated[int, Field(ge=1024, le=65535)]
DNS_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?", re.ASCII)


def is_address(host: str) -> bool:
    """Whether `host` is an IP address (not a name)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """Whether a listener bound to `host` is reachable from this host only: a loopback address (a
    name, even `localhost`, is whatever the resolver says, so it is not)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_CONFIG_COMMENT = re.compile(r"\s[;#]")  # supervisord's config reads these as the start of a comment


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)


class Section(BaseModel):
    """A settings section: unknown keys refused, and no value that could break supervisord's
    configuration (a line break, or a comment's start where the section reaches it)."""

    model_config = ConfigDict(extra="forbid", validate_default=True)
    # Values of these sections reach supervisord's configuration file (commands, environments).
    IN_SUPERVISOR_CONFIG: ClassVar[bool] = True

    @field_validator("*", mode="after")
    @classmethod
    def _no_line_injection(cls, value: Any) -> Any:
        for text in _strings(value):
            if found := _CONTROL.search(text):
                raise ValueError(f"contains a control character (U+{ord(found.group()):04X}); a line break "
                                 "would start a new line in supervisord's configuration")
            if cls.IN_SUPERVISOR_CONFIG and (found := _CONFIG_COMMENT.search(text)):
                raise ValueError(f"contains {found.group()!r}: supervisord's configuration would read the rest "
                                 "as a comment")
        return value
