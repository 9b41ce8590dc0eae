"""medusa-chat with piped standard input on the real model: two turns (the second refers to the
first), `/reset`, and a third turn that asks the second question again. The printed answers are
exactly those of `generate` on the rendered conversations, so the chat keeps turn 1 in turn 2's
prompt and forgets it after `/reset`."""
import os
import subprocess
import sys

import pytest

from medusa_jax.chat import render_chat
from medusa_jax.engine.generate import generate
from medusa_jax.resolve import resolve_heads

pytestmark = pytest.mark.real_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TURN1 = "Tell me about the Eiffel Tower in one sentence."
TURN2 = "How tall is it?"
N = 32


def _answer(model, heads, tree, messages):
    ids = render_chat(model.tokenizer, messages)
    out = generate(model.cfg, model.params, ids, heads=heads, tree=tree, max_new_tokens=N, progress=False)
    return model.tokenizer.decode(out.tokens, skip_special_tokens=True)


def test_piped_chat_keeps_the_conversation_and_reset_forgets(smollm2):
    heads, tree, _ = resolve_heads(smollm2, None)
    a1 = _answer(smollm2, heads, tree, [{"role": "user", "content": TURN1}])
    a2 = _answer(smollm2, heads, tree, [{"role": "user", "content": TURN1}, {"role": "assistant", "content": a1},
                                        {"role": "user", "content": TURN2}])
    a3 = _answer(smollm2, heads, tree, [{"role": "user", "content": TURN2}])
    assert "Eiffel" in a2 and "Eiffel" not in a3, (a2, a3)  # "it" is the tower only with turn 1 before it

    # commands with text they do not take, a near-command and a line that is not UTF-8: refused, not sent
    piped = f"{TURN1}\n{TURN2}\n/reset\n/bogus\n/reset now\n/systemfoo bar\n".encode() + b"Hi \xff there\n" + \
        ("word " * 9000 + f"\n{TURN2}\n/exit\n").encode()
    run = subprocess.run([sys.executable, "-m", "medusa_jax.cli.chat", "--max-new-tokens", str(N)], input=piped,
                         capture_output=True, cwd=ROOT, timeout=600, env={**os.environ, "LC_ALL": "C.UTF-8"})
    run.stdout, run.stderr = run.stdout.decode(), run.stderr.decode()
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"{a1}\n{a2}\n{a3}\n"
    assert "[the conversation is forgotten]" in run.stderr
    assert "unknown command '/bogus'" in run.stderr  # not sent to the model: the next answer is a3
    assert "/reset takes no text" in run.stderr and "unknown command '/systemfoo'" in run.stderr
    assert "the message: not valid Unicode text (the byte 0xff, which is not UTF-8, at character 3); not sent" \
        in run.stderr
    # a first message past the context alone: shorten it (/reset would not help), not sent
    (long,) = [line for line in run.stderr.splitlines() if "tokens but the model's context" in line]
    assert long.startswith("error: the prompt has ") and long.endswith("shorten it"), long
    stats = [line for line in run.stderr.splitlines() if "tokens/step" in line]
    assert len(stats) == 3
    reused = [int(line.split(" of ")[0].rsplit(", ", 1)[1]) for line in stats]
    assert reused[0] == 0 and reused[1] > 0  # turn 2 starts from turn 1's KV cache


def test_ctrl_c_stops_an_answer_once_or_twice_and_keeps_what_came():
    """The chat's answer loop: Ctrl-C during the stream cancels the request, a second one while it
    stops is absorbed, and the answer so far is kept (the conversation goes on with it)."""
    from medusa_jax.cli.chat import _answer

    class Handle:
        cancels, waits = 0, 0

        def __iter__(self):
            yield [5, 6]
            raise KeyboardInterrupt

        def cancel(self):
            self.cancels += 1

        def result(self, timeout=None):
            self.waits += 1
            if self.waits == 1:
                raise KeyboardInterrupt  # the second Ctrl-C, while the engine stops the request
            return "finished"

    class Printer:
        pushed, ended = [], False

        def push(self, chunk):
            self.pushed.append(chunk)

        def end(self):
            self.ended = True

    h, printer = Handle(), Printer()
    assert _answer(h, printer) == ("finished", True)
    assert h.cancels == 2 and printer.pushed == [[5, 6]] and printer.ended
