"""Every command the README and docs/*.md show for a script of launch/ or bench/ parses with that script's own
argument parser, as written (no work is done: the parse is stopped right after it succeeds), and the training
command's dotted overrides name real config keys with valid values; the README's test command is the one .ci/run
runs after installing.

A renamed or newly required flag, a removed script or a renamed config key fails here instead of on a user.
Commands are read from fenced code blocks (a `\\` continues a line; `#` starts a comment; `&&`, `;` and `|` split
commands) and from inline code spans that start a `python launch/...` or `python bench/...` command.

Run: python -m pytest tests/test_readme_commands.py -q
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import re
import shlex
import sys
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "k8s" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCRIPT = re.compile(r"^(?:\./)?((?:launch|bench)/[\w./-]+\.py)$")
FENCE = re.compile(r"^(\s*)```")
INLINE = re.compile(r"`([^`\n]*\bpython3? +(?:launch|bench)/[^`\n]*)`")
CALL = re.compile(r"\bpython3? +(?:\./)?(?:launch|bench)/")  # a line worth reading as shell
ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _split_commands(line: str) -> list[list[str]]:
    """One shell line -> its simple commands as argv lists (comments dropped, `&&`/`;`/`|` split)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands, argv = [], []
    for token in lexer:
        if token and set(token) <= set(";&|"):
            commands.append(argv)
            argv = []
        else:
            argv.append(token)
    return [c for c in [*commands, argv] if c]


def _script_call(argv: list[str]) -> tuple[str, list[str]] | None:
    """(script, its arguments) when argv runs a launch/ or bench/ script with python, else None."""
    while argv and ASSIGN.match(argv[0]):  # VAR=value python ...
        argv = argv[1:]
    if len(argv) < 2 or not re.fullmatch(r"(?:.*/)?python3?", argv[0]):
        return None
    m = SCRIPT.match(argv[1])
    return (m.group(1), argv[2:]) if m else None


def _fenced_lines(text: str) -> list[tuple[int, str]]:
    """(line number, logical line) of every line inside a fenced block, continuations joined."""
    out, inside, pending, start = [], False, "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        if FENCE.match(raw):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        line = raw.strip()
        if not pending:
            start = n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    return out


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(where, script, arguments) of every documented launch/ and bench/ command."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        where = doc.relative_to(REPO)
        lines = _fenced_lines(text)
        lines += [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in INLINE.finditer(text)]
        for n, line in lines:
            if not CALL.search(line):  # the layout map, YAML, output: not shell
                continue
            for argv in _split_commands(line):
                call = _script_call(argv)
                if call is not None:
                    found.append((f"{where}:{n}", *call))
    return found


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        self.namespace = namespace


def load_script(script: str):
    """The script as a module (its `if __name__ == "__main__"` part not run)."""
    path = REPO / script
    name = f"_doc_{path.stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = module = importlib.util.module_from_spec(spec)  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def parse_only(script: str, args: list[str]) -> argparse.Namespace:
    """The namespace `script`'s own parser makes of `args`; SystemExit(2) where argparse refuses them. The script's
    main() runs only up to its parse_args, which raises instead of returning."""
    path = REPO / script
    module = load_script(script)
    def stop_after(real):
        def parse(self, a=None, namespace=None):
            raise _Parsed(real(self, a, namespace))
        return parse

    main = module.main
    takes_argv = bool(inspect.signature(main).parameters)
    with mock.patch.object(argparse.ArgumentParser, "parse_args", stop_after(argparse.ArgumentParser.parse_args)), \
            mock.patch.object(argparse.ArgumentParser, "parse_intermixed_args",
                              stop_after(argparse.ArgumentParser.parse_intermixed_args)), \
            mock.patch.object(sys, "argv", [str(path), *args]):
        try:
            main(args) if takes_argv else main()
        except _Parsed as parsed:
            return parsed.namespace
    raise AssertionError(f"{script}: main() returned without parsing its arguments")


COMMANDS = documented_commands()


def test_the_docs_show_commands_of_every_kind():
    scripts = {script for _, script, _ in COMMANDS}
    assert {"launch/train_v4_draft.py", "launch/evaluate_draft.py", "launch/prepare_data.py",
            "launch/export_draft.py", "launch/calibrate_draft.py", "bench/llamacpp.py"} <= scripts, scripts
    assert len(COMMANDS) > 50, len(COMMANDS)


@pytest.mark.parametrize(("where", "script", "args"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_documented_command_parses(where, script, args, capsys):
    assert (REPO / script).is_file(), f"{where}: {script} does not exist"
    try:
        ns = parse_only(script, args)
    except SystemExit as e:
        pytest.fail(f"{where}: `python {script} {shlex.join(args)}` is refused by its parser (exit {e.code}): "
                    f"{capsys.readouterr().err.strip()}")
    if script == "launch/train_v4_draft.py":  # its dotted overrides must name real keys with valid values
        from pipeline.config import ConfigError

        try:
            load_script(script).build_config(ns)
        except (ConfigError, ValueError) as e:
            pytest.fail(f"{where}: `python {script} {shlex.join(args)}`: {e}")


def test_a_wrong_flag_is_caught():
    with pytest.raises(SystemExit):
        parse_only("launch/evaluate_draft.py", ["--draft", "runs/tiny/export", "--no-such-flag"])
    assert _script_call(["OMP_NUM_THREADS=1", "python", "bench/step.py", "--x"]) == ("bench/step.py", ["--x"])
    assert _split_commands("python a.py --x 1 && python b.py  # c") == [["python", "a.py", "--x", "1"],
                                                                         ["python", "b.py"]]


def test_the_readme_test_command_is_what_ci_runs():
    readme = (REPO / "README.md").read_text()
    block = readme.split("Test command", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    first = block.strip().splitlines()[0].split("#", 1)[0].strip()
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.strip().startswith("#")]
    assert ci[-1] == first, (ci[-1], first)
