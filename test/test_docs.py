"""The README and docs/ pages: every command their shell blocks name exists, with flags its
parser accepts, and every relative link resolves.

A page's worked example is only worth something while it runs. Rather than run them (models,
simulators, minutes), this checks what goes stale when code moves on: a `vla-runtime <sub>`
is parsed by the real command-line parser (argparse: the subcommand, every flag, the choices,
the types and the required arguments), a `python -m vla_runtime...` module or a script under
the repository must exist and define every `--flag` used with it, a `make <target>` must be a
Makefile target, and a relative link (with its #anchor) must point at a file (and heading)
that exists. Nothing runs but the parsers (a module named with `python -m` is imported for its\n``build_parser``; a script's flags are read from its source), so it takes a few seconds.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import io
import re
import shlex
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

from vla_runtime.cli import build_parser
from vla_runtime.nodes.profile import CameraSpec, RobotProfile

ROOT = Path(__file__).resolve().parents[1]
SHELL = {"bash", "sh", "shell", "console"}
SEPARATORS = {";", "&&", "||", "|", "&", ";;"}
README_LIMIT_BYTES = 12 * 1024   # the "at most about 12 KB": a README that fits on a screen or two


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@dataclass(frozen=True)
class Command:
    where: str          # file:line of the block's line the command starts on
    argv: tuple[str, ...]


def shell_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, body) of every fenced block tagged bash/sh/shell/console."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,}|~{3,})\s*([\w-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(2), m.group(3).lower(), i + 2
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1
        if lang in SHELL:
            blocks.append((start, "\n".join(body)))
    return blocks


def commands(body: str, where: str, first_line: int) -> list[Command]:
    """The simple commands of a shell block: continuation lines joined, comments dropped, split at
    ; && || | &, leading VAR=value assignments dropped; $(...) stands for one word."""
    out: list[Command] = []
    logical: list[tuple[int, str]] = []
    pending, start = "", first_line
    for n, line in enumerate(body.split("\n"), start=first_line):
        line = re.sub(r"(^|\s)#.*$", "", line)     # a comment starts at a word boundary
        if not pending:
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append((start, pending + line))
        pending = ""
    for n, line in logical:
        line = re.sub(r"\$\([^()]*\)", "SUBST", line)
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lex.whitespace_split, lex.commenters = True, ""
        argv: list[str] = []
        for tok in [*lex, ";"]:
            if tok in SEPARATORS:
                while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
                    argv.pop(0)
                if argv:
                    out.append(Command(f"{where}:{n}", tuple(argv)))
                argv = []
            else:
                argv.append(tok)
    return out


def all_commands() -> list[Command]:
    found = []
    for path in doc_files():
        rel = path.relative_to(ROOT).as_posix()
        for first, body in shell_blocks(path.read_text()):
            found += commands(body, rel, first)
    return found


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M)}


def argparse_options(source: Path) -> set[str]:
    """The option strings a script or module declares with ``add_argument`` (read, not imported:
    a training or simulator module imports heavy packages at import time)."""
    opts = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            opts |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                     and a.value.startswith("-")}
    return opts


def declared_options(script: Path) -> set[str]:
    """``argparse_options`` of a script and of the modules beside it that it imports (a benchmark's
    shared options live in one of those: ``bench/baseline.py``)."""
    opts = argparse_options(script)
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            sibling = script.parent / f"{node.module}.py"
            if sibling.is_file():
                opts |= argparse_options(sibling)
    return opts


def flags(argv: tuple[str, ...]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--") and a != "--"]


def parse_error(parser: argparse.ArgumentParser, args: tuple[str, ...], prog: str) -> str | None:
    """What ``parser`` says about ``args`` (None: it accepts them; ``--help`` counts as accepted)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(list(args))
    except SystemExit as e:
        if e.code:
            return f"{prog} refuses {' '.join(args)!r}: {err.getvalue().strip().splitlines()[-1]}"
    return None


def check(cmd: Command) -> str | None:
    """None when the command is fine (or not one of ours), else what is wrong."""
    argv = cmd.argv
    name = Path(argv[0]).name
    if name == "vla-runtime":
        return parse_error(build_parser(), argv[1:], "vla-runtime")
    if re.fullmatch(r"python(3(\.\d+)?)?", name) and len(argv) > 1:
        if argv[1] == "-m":
            module = argv[2]
            if not module.startswith("vla_runtime"):
                return None
            base = ROOT / Path(*module.split("."))
            source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__main__.py"
            if not source.is_file():
                return f"no module {module} (looked for {source.relative_to(ROOT)})"
            parser = getattr(importlib.import_module(module), "build_parser", None)
            if parser is not None:   # the module's own parser: flags, choices and types as it runs
                return parse_error(parser(), argv[3:], module)
            rest = argv[3:]
        elif argv[1].endswith(".py"):
            source, rest = ROOT / argv[1], argv[2:]
            if not source.is_file():
                return f"no script {argv[1]}"
        else:
            return None
        unknown = sorted(set(flags(rest)) - declared_options(source))
        return f"{source.relative_to(ROOT)} declares no {unknown}" if unknown else None
    if name in ("bash", "sh") and len(argv) > 1 and argv[1].endswith(".sh"):
        script = ROOT / argv[1]
        if not script.is_file():
            return f"no script {argv[1]}"
        unknown = sorted(f for f in set(flags(argv[2:])) if f not in script.read_text())
        return f"{argv[1]} handles no {unknown}" if unknown else None
    if name == "make":
        targets = [a for a in argv[1:] if not a.startswith("-") and "=" not in a]
        missing = sorted(set(targets) - makefile_targets())
        return f"the Makefile has no target {missing}" if missing else None
    return None


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def broken_links(path: Path) -> list[str]:
    """Relative links of ``path`` (outside code) whose file, or #heading, does not exist."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    bad = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    return bad


COMMANDS = all_commands()


@pytest.mark.parametrize("cmd", COMMANDS, ids=[f"{c.where}:{Path(c.argv[0]).name}" for c in COMMANDS])
def test_every_command_of_the_docs_exists_with_its_flags(cmd: Command):
    assert check(cmd) is None, f"{cmd.where}: {' '.join(cmd.argv)}\n  {check(cmd)}"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path: Path):
    assert broken_links(path) == []


def test_the_docs_name_commands_of_every_kind():
    """The extraction finds what the pages hold (a regex that matched nothing would pass above)."""
    names = {Path(c.argv[0]).name for c in COMMANDS}
    assert {"vla-runtime", "make"} <= names and any(c.argv[:2] == ("python", "-m") or
                                                    (c.argv[1:2] == ("-m",)) for c in COMMANDS)
    subs = {c.argv[1] for c in COMMANDS if Path(c.argv[0]).name == "vla-runtime"}
    parser_subs = set(next(a for a in build_parser()._actions if a.dest == "command").choices)
    assert subs == parser_subs, f"subcommands without a worked example: {sorted(parser_subs - subs)}"


def test_every_subcommand_has_a_page_the_readme_links():
    readme = (ROOT / "README.md").read_text()
    for sub in next(a for a in build_parser()._actions if a.dest == "command").choices:
        page = ROOT / "docs" / "commands" / f"{sub}.md"
        assert page.is_file(), f"no page for vla-runtime {sub}"
        assert f"(docs/commands/{sub}.md)" in readme, f"the README's table does not link {page.name}"


def test_the_readme_holds_the_two_setup_commands_and_ci_runs_its_test_command():
    setup = [c.argv for c in commands(shell_blocks((ROOT / "README.md").read_text())[0][1], "README.md", 1)]
    assert setup == [("make", "demo"), ("make", "test")]
    ci = [c.argv for c in commands((ROOT / ".ci" / "run").read_text(), ".ci/run", 1)]
    assert ("make", "test") in ci


def profile_keys(cls: type, prefix: str = "") -> list[str]:
    """Every key a robot profile may hold, dotted (``streaming.stitch.mode``), from its dataclasses."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        sub = hints[f.name]
        if f.name == "cameras" and cls is RobotProfile:   # a mapping name -> CameraSpec
            keys += [f"cameras.{c.name}" for c in dataclasses.fields(CameraSpec) if c.name != "name"]
        elif dataclasses.is_dataclass(sub):
            keys += profile_keys(sub, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def test_the_configuration_page_names_every_profile_key():
    """A key added to the profile dataclasses without a line on the page fails here. A row may
    name several keys of one section (`output.single_topics`, `single_names`), so the last part
    alone counts too."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    keys = profile_keys(RobotProfile)
    assert "streaming.stitch.mode" in keys and "cache.max_end_matches" in keys and "cameras.compressed" in keys
    missing = [k for k in keys if f"`{k}`" not in page and f"`{k.rsplit('.', 1)[-1]}`" not in page]
    assert missing == []


def python_imports(text: str) -> list[tuple[str, str]]:
    """(module, name) of every ``from vla_runtime... import name`` in the page's python blocks."""
    found = []
    for block in re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vla_runtime"):
                found += [(node.module, a.name) for a in node.names]
    return found


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_examples_import_what_exists(path: Path):
    for module, name in python_imports(path.read_text()):
        assert hasattr(importlib.import_module(module), name), f"{path.name}: {module} has no {name}"


def test_the_readme_fits_on_a_screen_or_two():
    assert (ROOT / "README.md").stat().st_size <= README_LIMIT_BYTES


def test_the_checks_catch_a_broken_page(tmp_path: Path):
    """Each check fails on a page broken in its own way (the checker is tested, not only the docs)."""
    page = "```bash\n.venv/bin/vla-runtime bench --preset pi05-small \\\n    --no-such-flag 3   # comment\n" \
           "vla-runtime evaluate --out x && make no-such-target\n" \
           "python -m vla_runtime.no_such_module --x 1\n" \
           "PYTHONPATH=. python bench/pipeline_cache.py --no-such-option\n" \
           "python bench/halves_baseline.py --checkpoint c --rounds 2 --no-such-option\n```\n"
    found = commands(shell_blocks(page)[0][1], "page.md", 2)
    assert [c.where for c in found] == ["page.md:2", "page.md:4", "page.md:4", "page.md:5", "page.md:6", "page.md:7"]
    problems = [check(c) for c in found]
    assert "unrecognized arguments: --no-such-flag" in problems[0]
    assert "invalid choice: 'evaluate'" in problems[1]
    assert "no target ['no-such-target']" in problems[2]
    assert "no module vla_runtime.no_such_module" in problems[3]
    assert "declares no ['--no-such-option']" in problems[4]
    # --checkpoint is declared in bench/baseline.py, which the script imports; --rounds in the script
    assert problems[5].endswith("declares no ['--no-such-option']")
    md = tmp_path / "docs" / "p.md"
    md.parent.mkdir()
    md.write_text("# Title\n\n[ok](p.md#title) [gone](missing.md) [bad anchor](#nowhere) `[code](x.md)`\n")
    assert broken_links(md) == ["missing.md: no such file", "#nowhere: no heading #nowhere in p.md"]
