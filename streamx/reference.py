"""The command pages: docs/commands/NAME.md for every command (its help, where the docs say more, a table of its flags)
and their index, docs/reference.md, generated from the commands themselves (each setting is declared once, in
streamx.config or the command's signature, and `--help` prints the same words). `python -m streamx.reference`, in
the repository's root, writes them; tests/test_docs.py keeps them equal to `pages()`, and every command and flag
the docs name real."""

from __future__ import annotations

from pathlib import Path

import click
import typer

# where the docs say more of each command (paths from docs/commands/)
MORE = {
    "run": [("the path to a drafter", "../guide.md#the-path-to-a-drafter-regenerate-run-convert"),
            ("real work", "../guide.md#real-work"), ("scaling", "../scaling.md"), ("support", "../support.md"),
            ("layers", "../layers.md"), ("the store", "../store.md")],
    "regenerate": [("regenerate", "../regenerate.md"), ("fan-out", "../fanout.md")],
    "plan": [("before a run", "../guide.md#before-a-run-size-files-time-free-space")],
    "inspect": [("checking a store", "../guide.md#checking-a-store-before-training"), ("the store", "../store.md")],
    "verify": [("what each check means", "../verify.md")],
    "convert": [("one store, every trainer", "../trainers.md"), ("speculators", "../speculators.md")],
    "bench": [("measuring", "../guide.md#measuring"), ("measurements", "../../bench/RESULTS.md")],
    "bench-writer": [("measuring", "../guide.md#measuring"),
                     ("writing at disk speed", "../store.md#writing-at-disk-speed")],
}
HOW = "python -m streamx.reference"


def commands() -> dict[str, click.Command]:
    """The CLI's commands by name."""
    from .cli import app

    return dict(typer.main.get_command(app).commands)


def flags(command: click.Command) -> set[str]:
    """Every flag spelling `command` takes (`--packing`, `--no-progress`, ...)."""
    return {opt for p in command.params for opt in (*p.opts, *getattr(p, "secondary_opts", ())) if opt.startswith("-")}


def pages() -> dict[str, str]:
    """Each page's path under docs/ and its text: the index and a page per command."""
    found = commands()
    index = ["# Commands", "", f"A page per command, generated from the commands themselves (`{HOW}`); "
             "`streamx COMMAND --help` says the same.", "", "| command | what it does |", "| --- | --- |"]
    index += [f"| [streamx {name}](commands/{name}.md) | {_cell(_first_sentence(command.help))} |"
              for name, command in found.items()]
    return {"reference.md": "\n".join(index) + "\n",
            **{f"commands/{name}.md": command_page(name, command) for name, command in found.items()}}


def command_page(name: str, command: click.Command) -> str:
    """One command's page: its help, where the docs say more, and a table of its flags."""
    more = " · ".join(f"[{title}]({link})" for title, link in MORE[name])
    lines = [f"# streamx {name}", "", " ".join((command.help or "").split()), "", f"More: {more}. "
             f"[All commands](../reference.md).", "", "| flag | what it sets |", "| --- | --- |"]
    for param in command.params:
        if isinstance(param, click.Argument):
            lines.append(f"| `{param.human_readable_name}` (argument) | {_cell(getattr(param, 'help', ''))} |")
        elif not param.hidden:
            spelled = " / ".join(f"`{opt}`" for opt in (*param.opts, *param.secondary_opts))
            lines.append(f"| {spelled} | {_cell(param.help)} |")
    return "\n".join(lines) + "\n"


def write(docs: Path) -> list[Path]:
    """Write every page under `docs`; the paths written."""
    written = []
    for relative, text in pages().items():
        path = docs / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def _first_sentence(text: str | None) -> str:
    words = " ".join((text or "").split())
    return words.split(". ")[0].rstrip(".") + "."


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


if __name__ == "__main__":
    for path in write(Path("docs")):
        print(path)
