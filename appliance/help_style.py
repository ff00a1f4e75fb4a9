"""How every command's help reads (docs/operate/cli.md): no type labels beside the options and
arguments, arguments named in capitals (plain NAME in the usage line), each paragraph one flowing
sentence. The root applies
`plain_help` to each command it loads; light to import, since `appliance --help` imports it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer
from typer.core import TyperArgument, TyperOption

if TYPE_CHECKING:
    from typer import _click  # the Click that Typer vendors


class _UntypedOption(TyperOption):
    def display_type_rich(self, ctx: _click.Context) -> str | None:
        return None


class _UntypedArgument(TyperArgument):
    def display_type_rich(self, ctx: _click.Context) -> str | None:
        return None

    def get_usage_pieces(self, ctx: _click.Context) -> list[str]:
        # Plain NAME, as Click writes it (Typer writes a required argument as {NAME}, which reads
        # as a choice or a placeholder to fill in braces and all); [NAME] when it may be left out.
        name = self.metavar or (self.name or "").upper()
        name = name if self.required else f"[{name}]"
        return [name + ("..." if self.nargs != 1 else "")]


def plain_help(command: _click.Command) -> _click.Command:
    """Help as a reader wants it, for `command` and everything under it: no type labels (<bool>,
    <str>, <int range>) beside the options and arguments, arguments named in capitals (USER),
    and each paragraph of a command's help one flowing sentence however its source wraps."""
    if command.help:
        command.help = "\n\n".join(" ".join(paragraph.split()) for paragraph in command.help.split("\n\n"))
    help_option = command.get_help_option(typer.Context(command))  # made on first use: make it now
    for param in [*command.params, *([help_option] if help_option else [])]:
        if isinstance(param, TyperOption):
            param.__class__ = _UntypedOption  # the same option, minus the label
        elif isinstance(param, TyperArgument):
            param.__class__ = _UntypedArgument
            param.metavar = param.metavar or (param.name or "").upper()
    for sub in getattr(command, "commands", {}).values():
        plain_help(sub)
    return command
