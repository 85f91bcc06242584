"""docs/reference.md: every command and flag of the CLI, generated from the commands themselves (each setting is
declared once, in streamx.config or the command's signature, and `--help` prints the same words);
tests/test_docs.py keeps the page equal to `markdown()` and every command and flag the docs name real."""

from __future__ import annotations

import click
import typer


def commands() -> dict[str, click.Command]:
    """The CLI's commands by name."""
    from .cli import app

    return dict(typer.main.get_command(app).commands)


def flags(command: click.Command) -> set[str]:
    """Every flag spelling `command` takes (`--packing`, `--no-progress`, ...)."""
    return {opt for p in command.params for opt in (*p.opts, *getattr(p, "secondary_opts", ())) if opt.startswith("-")}


def markdown() -> str:
    """The page: per command, its help and a table of its flags."""
    lines = ["# Command reference", "",
             "Generated from the commands themselves (`python -c \"from streamx.reference import markdown; "
             "print(markdown(), end='')\" > docs/reference.md`); `streamx COMMAND --help` says the same.", ""]
    for name, command in commands().items():
        lines += [f"## streamx {name}", "", " ".join((command.help or "").split()), "",
                  "| flag | what it sets |", "| --- | --- |"]
        for param in command.params:
            if isinstance(param, click.Argument):
                lines.append(f"| `{param.human_readable_name}` (argument) | {_cell(getattr(param, 'help', ''))} |")
            elif not param.hidden:
                spelled = " / ".join(f"`{opt}`" for opt in (*param.opts, *param.secondary_opts))
                lines.append(f"| {spelled} | {_cell(param.help)} |")
        lines.append("")
    return "\n".join(lines)


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")
