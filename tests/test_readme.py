"""The README's code blocks run as written, and the docs pages' commands parse.

Python blocks run verbatim in a fresh interpreter with the default model. Shell blocks: the
`decode.py` lines run verbatim (each answers in seconds); the long jobs (distillation, training,
tuning, benchmarks, lossless checks: minutes to hours) are parsed by their own command-line
parser, so a renamed flag or a missing file breaks this test, and every file they name must exist.
The shell lines of the docs pages (docs/*.md, which hold the README's longer explanations) are all
parsed that way, `decode.py` and `scripts/*.py` lines included.
"""
import argparse
import os
import re
import shlex
import subprocess
import sys

import pytest
from conftest import without_quick_compiles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
# the pages the README links for its longer explanations, each with shell commands
DOC_PAGES = [os.path.join("docs", f"{name}.md") for name in ("benchmarks", "decoding", "devices", "serving",
                                                            "training")]


def blocks(lang: str, path: str = README):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def shell_commands(path: str = README):
    """Each shell line of a markdown file (the README by default) as (stdin text or None, argv),
    comments dropped."""
    out = []
    for block in blocks("bash", path):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if not line:
                continue
            stdin = None
            if "|" in line:
                left, line = (part.strip() for part in line.split("|", 1))
                words = shlex.split(left)
                assert words[0] == "echo", left
                stdin = " ".join(words[1:]) + "\n"
            out.append((stdin, shlex.split(line)))
    return out


def split_env(argv):
    """({NAME: value} of the leading ``NAME=value`` words, the command after them)."""
    env = {}
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        name, value = argv[0].split("=", 1)
        env[name] = value
        argv = argv[1:]
    return env, argv


def _program(argv, parse_decode: bool = False):
    """(kind, main function or None, args) for a README command line (after its env assignments).

    ``parse_decode``: a ``decode.py`` line is parsed ("parse", its main) instead of run; a
    ``scripts/NAME.py`` line is always parsed (its ``main(argv)``)."""
    argv = split_env(argv)[1]
    if argv[0] == "make":
        return "make", None, argv[1:]
    if argv[0].startswith(".venv/bin/medusa-"):  # a console script of pyproject.toml
        import importlib
        module, func = console_scripts()[argv[0].rsplit("/", 1)[1]].split(":")
        return "parse", getattr(importlib.import_module(module), func), argv[1:]
    assert argv[0] == ".venv/bin/python", f"README commands use the project's venv: {argv}"
    if argv[1] == "decode.py":
        if parse_decode:
            from medusa_jax.cli import decode
            return "parse", decode.main, argv[2:]
        return "run", None, argv[2:]
    if argv[1].startswith("scripts/") and argv[1].endswith(".py"):
        import importlib.util
        spec = importlib.util.spec_from_file_location(os.path.basename(argv[1])[:-3], os.path.join(ROOT, argv[1]))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return "parse", module.main, argv[2:]
    if argv[1] == "train.py":
        from medusa_jax.cli import train
        return "parse", train.main, argv[2:]
    if argv[1] == "-m":
        import importlib
        if argv[2] == "pip":
            return "pip", None, argv[3:]
        return "parse", importlib.import_module(argv[2]).main, argv[3:]
    raise AssertionError(f"unknown README command {argv}")


def console_scripts() -> dict:
    """pyproject.toml's [project.scripts]: {command: "module:function"}."""
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


@pytest.mark.slow
def test_console_scripts_are_installed_and_answer_help():
    """Every console script of pyproject.toml exists in the venv (the install made it) and prints
    its --help."""
    bin_dir = os.path.dirname(sys.executable)
    for name in console_scripts():
        path = os.path.join(bin_dir, name)
        assert os.path.exists(path), f"{name} is not installed in {bin_dir}: pip install -e ."
        out = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and "usage:" in out.stdout, (name, out.stderr[-2000:])


def test_readme_has_blocks():
    assert len(blocks("python")) >= 1
    kinds = [_program(argv)[0] for _, argv in shell_commands()]
    assert kinds.count("run") >= 4 and kinds.count("parse") >= 6 and "make" in kinds


class _Parsed(Exception):
    pass


def _doc_commands():
    """(page, argv) of every docs page's shell line that runs a command of this project."""
    return [(page, argv) for page in DOC_PAGES for _, argv in shell_commands(page)
            if _program(argv, parse_decode=True)[0] == "parse"]


def test_doc_pages_have_commands():
    pages = {page for page, _ in _doc_commands()}
    assert pages == set(DOC_PAGES), f"pages without a command this test parses: {set(DOC_PAGES) - pages}"


@pytest.mark.parametrize("stdin, argv", [c for c in shell_commands() if _program(c[1])[0] == "parse"],
                         ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_long_commands_parse_and_name_existing_files(stdin, argv, monkeypatch):
    _parse_only(argv, monkeypatch)


@pytest.mark.parametrize("page, argv", _doc_commands(),
                         ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_doc_commands_parse_and_name_existing_files(page, argv, monkeypatch):
    _parse_only(argv, monkeypatch, parse_decode=True)


def _parse_only(argv, monkeypatch, parse_decode: bool = False):
    """Run ``argv``'s main only as far as its argparse result; every file it names must exist."""
    kind, main, args = _program(argv, parse_decode)
    original = argparse.ArgumentParser.parse_args

    def parse_only(self, a=None, namespace=None):
        raise _Parsed(original(self, a, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    monkeypatch.chdir(ROOT)
    with pytest.raises(_Parsed) as parsed:
        main(args)
    ns = vars(parsed.value.args[0])
    from medusa_jax.evals.memory import PRESETS
    for key in ("prompts", "prompts_file", "config", "data"):
        if key == "config" and main.__module__ == "medusa_jax.cli.plan" and ns[key] in PRESETS:
            continue  # a preset model, not a file
        if ns.get(key):
            assert os.path.exists(ns[key]), f"{' '.join(argv)}: {ns[key]} does not exist"


@pytest.mark.real_model
@pytest.mark.parametrize("stdin, argv", [c for c in shell_commands() if _program(c[1])[0] == "run"],
                         ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_decode_commands_run_as_written(stdin, argv, smollm2_path, tmp_path):
    if "--heads" in argv:  # made by the README's tune line, which this test only parses
        pytest.skip("needs the output of `medusa-tune`")
    env, argv = split_env(argv)
    out = subprocess.run([sys.executable] + argv[1:], cwd=ROOT, input=stdin, capture_output=True, text=True,
                         timeout=900, env={**without_quick_compiles(dict(os.environ)), **env})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip(), "no answer printed"
    if "--json" not in argv:
        assert "tokens/step" in out.stderr


@pytest.mark.real_model
@pytest.mark.parametrize("code", blocks("python"))
def test_python_blocks_run_verbatim(code, smollm2_path):
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env=without_quick_compiles(dict(os.environ)))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip()
    assert "<|im_end|>" not in out.stdout  # special tokens are not printed
