"""The `quiver` command group itself (click alone): the command families add their commands to it, and the
entry point reads a command line with its parser before anything else loads."""

from __future__ import annotations

import click

from quiver.version import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="quiver")
def cli() -> None:
    """Quiver: one base model, many fine-tunes, in one weight-shared context binary."""


def command_words(args: list[str]) -> tuple[str, ...]:
    """The command a command line runs, as words (`("t2t", "run")`): the group's options read by its own
    parser (an option's value is no command), then the family's subcommand, the next word that is no
    option (the families take no options of their own before it). Empty when it names none."""
    context = click.Context(cli, info_name="quiver", resilient_parsing=True)
    try:
        _, rest, _ = cli.make_parser(context).parse_args(args=list(args))
    except click.ClickException:
        return ()
    if not rest:
        return ()
    subcommand = next((word for word in rest[1:] if not word.startswith("-")), None)
    return (rest[0],) if subcommand is None else (rest[0], subcommand)
