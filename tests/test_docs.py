"""The README and docs/ say only commands and flags that exist, docs/reference.md is the CLI as it is, and the
example configs and Slurm templates a user copies are valid."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from streamx.config import load_config
from streamx.reference import MORE, commands, flags, pages

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def invocations(text: str) -> list[str]:
    """Every `streamx COMMAND ...` the text gives: in code blocks (continued lines joined) and in inline code."""
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            found += [m.group(0) for m in re.finditer(r"(?<![\w./-])streamx \S.*", line.split("#")[0])]
    for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
        found += [m.group(0) for m in re.finditer(r"(?<![\w./-])streamx \S.*", span)]
    return found


def test_every_command_and_flag_the_docs_name_exists():
    known, problems = commands(), []
    for page in PAGES:
        for said in invocations(page.read_text()):
            words = said.split()
            name = re.match(r"[\w-]*", words[1]).group(0)  # (a diagram's `[streamx regenerate]`)
            if name not in known:
                if not name.startswith(("-", "<", "COMMAND", "...")):
                    problems.append(f"{page.name}: `{said}`: no command {name}")
                continue
            given = {w.split("=")[0] for w in words[2:] if w.startswith("--")}
            problems += [f"{page.name}: `{said}`: streamx {name} has no {flag}"
                         for flag in sorted(given - flags(known[name]) - {"--help"})]
    assert not problems, "\n".join(problems)


def test_a_flag_that_does_not_exist_is_found():
    """(The check above reads what it should: a made-up flag in a code block and in inline code.)"""
    text = "```bash\nstreamx run --model m \\\n    --made-up 1\n```\nand `streamx plan --gpu h100`\n"
    assert invocations(text) == ["streamx run --model m      --made-up 1", "streamx plan --gpu h100"]
    assert "--made-up" not in flags(commands()["run"]) and "--gpu" in flags(commands()["plan"])


def test_the_command_pages_are_the_cli():
    """A page per command, each equal to what the CLI generates, every link on it to a page that exists."""
    generated = pages()
    assert set(MORE) == set(commands()), "a command without its docs (reference.MORE)"
    written = {str(path.relative_to(ROOT / "docs")) for path in (ROOT / "docs" / "commands").glob("*.md")}
    assert written | {"reference.md"} == set(generated), "a page for a command that is gone: delete it"
    for relative, text in generated.items():
        page = ROOT / "docs" / relative
        assert page.read_text() == text, f"regenerate docs/{relative}: python -m streamx.reference"
        for link, anchor in re.findall(r"\]\(([^)#]+)#?([^)]*)\)", text):
            target = page.parent.joinpath(link).resolve()
            assert target.exists(), f"{relative}: {link}"
            headings = re.findall(r"^#+ (.+)$", target.read_text(), flags=re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
            assert not anchor or anchor in slugs, f"{relative}: {link}#{anchor}"


@pytest.mark.parametrize("example", sorted((ROOT / "configs" / "examples").glob("*.yaml")), ids=lambda p: p.stem)
def test_the_example_configs_are_settings_streamx_takes(example):
    config = load_config(str(example))
    assert config.model != "smollm2-135m-instruct" and config.data == "chats.jsonl"


@pytest.mark.parametrize("template", sorted((ROOT / "configs" / "slurm").glob("*.sbatch")), ids=lambda p: p.stem)
def test_the_slurm_templates_are_bash_that_runs_streamx(template):
    assert subprocess.run(["bash", "-n", str(template)]).returncode == 0
    text = template.read_text()
    assert "-m streamx run --config" in text and text.startswith("#!/bin/bash")
    for line in text.splitlines():
        if "-m streamx run" in line:
            flags_given = [w for w in shlex.split(line.split("-m streamx run", 1)[1]) if w.startswith("--")]
            assert set(flags_given) <= flags(commands()["run"]), line
