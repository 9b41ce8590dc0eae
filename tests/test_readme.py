"""The README's code blocks run as written.

Python blocks run verbatim in a fresh interpreter with the default model. Shell blocks: the
`decode.py` lines run verbatim (each answers in seconds); the long jobs (distillation, training,
tuning, benchmarks, lossless checks: minutes to hours) are parsed by their own command-line
parser, so a renamed flag or a missing file breaks this test, and every file they name must exist.
"""
import argparse
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def blocks(lang: str):
    with open(README, encoding="utf-8") as f:
        text = f.read()
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def shell_commands():
    """Each shell line of the README as (stdin text or None, argv), comments dropped."""
    out = []
    for block in blocks("bash"):
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


def _program(argv):
    """(kind, main function or None, args) for a README command line (after its env assignments)."""
    argv = split_env(argv)[1]
    if argv[0] == "make":
        return "make", None, argv[1:]
    if argv[0].startswith(".venv/bin/medusa-"):  # a console script of pyproject.toml
        import importlib
        module, func = console_scripts()[argv[0].rsplit("/", 1)[1]].split(":")
        return "parse", getattr(importlib.import_module(module), func), argv[1:]
    assert argv[0] == ".venv/bin/python", f"README commands use the project's venv: {argv}"
    if argv[1] == "decode.py":
        return "run", None, argv[2:]
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


@pytest.mark.parametrize("stdin, argv", [c for c in shell_commands() if _program(c[1])[0] == "parse"],
                         ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_long_commands_parse_and_name_existing_files(stdin, argv, monkeypatch):
    kind, main, args = _program(argv)
    original = argparse.ArgumentParser.parse_args

    def parse_only(self, a=None, namespace=None):
        raise _Parsed(original(self, a, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    monkeypatch.chdir(ROOT)
    with pytest.raises(_Parsed) as parsed:
        main(args)
    ns = vars(parsed.value.args[0])
    from medusa_jax.evals.memory import PRESETS
    for key in ("prompts", "config", "data"):
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
                         timeout=900, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip(), "no answer printed"
    if "--json" not in argv:
        assert "tokens/step" in out.stderr


@pytest.mark.real_model
@pytest.mark.parametrize("code", blocks("python"))
def test_python_blocks_run_verbatim(code, smollm2_path):
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip()
    assert "<|im_end|>" not in out.stdout  # special tokens are not printed
