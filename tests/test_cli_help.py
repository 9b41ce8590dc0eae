"""Every command-line tool's --help: the usage line names the command as it is run, every flag has
a help text, and no flag prints its default twice."""
import re

import pytest


def _mains():
    from medusa_jax.cli import bench, chat, check, decode, distill, export, merge, plan, quality, serve, train, tune
    return {"python decode.py": decode.main, "python train.py": train.main, "medusa-check": check.main,
            "medusa-bench": bench.main, "medusa-tune": tune.main, "medusa-plan": plan.main,
            "medusa-distill": distill.main, "medusa-chat": chat.main, "medusa-serve": serve.main,
            "medusa-quality": quality.main, "medusa-merge": merge.main, "medusa-export": export.main}


def _option_entries(text: str) -> dict:
    """{flag names: help text} from argparse's help output (options section)."""
    entries, current = {}, None
    for line in text.split("options:", 1)[1].splitlines():
        m = re.match(r"^  (-\S.*?)(?: {2,}(\S.*))?$", line)
        if m:
            current = m.group(1)
            entries[current] = m.group(2) or ""
        elif current and line.startswith("   "):
            entries[current] += " " + line.strip()
    return entries


@pytest.mark.parametrize("prog", list(_mains()))
def test_help_names_the_command_and_explains_every_flag(prog, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as e:
        _mains()[prog](["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: {prog} [-h]")
    entries = _option_entries(text)
    assert len(entries) >= 5 and "-h, --help" in entries
    for flag, help_text in entries.items():
        assert help_text.lower().count("default:") <= 1, (flag, help_text)
        assert "(default: None)" not in help_text and "(default: False)" not in help_text, (flag, help_text)
        assert re.sub(r"\(default: [^)]*\)", "", help_text).strip(), f"{prog} {flag} has no help text"


def test_seed_help_says_how_each_command_seeds(capsys, monkeypatch):
    """chat has no prompt file: its --seed help speaks of the session's answers; decode's of the prompts."""
    monkeypatch.setenv("COLUMNS", "100")
    texts = {}
    for prog in ("medusa-chat", "python decode.py"):
        with pytest.raises(SystemExit):
            _mains()[prog](["--help"])
        texts[prog] = _option_entries(capsys.readouterr().out)["--seed SEED"]
    assert "prompt file" not in texts["medusa-chat"] and "answer i of the session" in texts["medusa-chat"]
    assert "prompt i of a prompt file uses (seed + i) mod 2**31" in texts["python decode.py"]


def test_chat_prints_a_banner_and_help_lists_the_commands(monkeypatch, capsys):
    """medusa-chat starts with one line (on stderr) that names the model and /help; /help lists
    every command; nothing of it reaches stdout, which holds the answers alone."""
    import io
    import sys
    from types import SimpleNamespace

    from conftest import tiny_decoding_model

    from medusa_jax.cli import chat, common

    cfg, params = tiny_decoding_model()
    model = SimpleNamespace(cfg=cfg, params=params, tokenizer=None, path="/models/tiny.Q4_1.gguf")
    monkeypatch.setattr(common, "setup_decoding", lambda *a, **k: common.Setup(model, None, None, None, None))
    monkeypatch.setattr(sys, "stdin", io.StringIO("/help\n/help me\n/exit\n"))
    assert chat.main(["--no-medusa"]) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and lines[0] == ("[medusa-chat: tiny.Q4_1.gguf, plain decoding; type a message, /help lists "
                                      "the commands, Ctrl-D quits]"), err
    listed = [line.split()[0] for line in lines[2:7]]
    assert lines[1] == "commands:" and listed == ["/help", "/reset", "/system", "/exit,", "//TEXT"], err
    assert "/help takes no text; commands: /help, /reset" in err
