"""`chat.check_messages`, the messages the server and the library accept: OpenAI's content parts
and "developer" role, and text that is not valid Unicode refused with the field named."""
import pytest

from medusa_jax.chat import check_messages, check_text


def test_content_parts_and_the_developer_role():
    got = check_messages([{"role": "developer", "content": "Be terse."},
                          {"role": "user", "content": [{"type": "text", "text": "What is"},
                                                       {"type": "text", "text": "2 + 2?"}]}])
    assert got == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is\n2 + 2?"}]
    # parts a client replays from OpenAI's own answers (a refusal) or its Responses API, and names
    got = check_messages([{"role": "user", "content": [{"type": "input_text", "text": "Hi"}], "name": "alice"},
                          {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."},
                                                            {"type": "output_text", "text": "Sorry."}], "name": "bot"}])
    assert got == [{"role": "user", "content": "Hi", "name": "alice"},
                   {"role": "assistant", "content": "I cannot.\nSorry.", "name": "bot"}]


@pytest.mark.parametrize("messages,match", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     r"messages\[0\]\.content\[0\]: only text parts .* got 'image_url'"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}],
     r"messages\[0\]\.content\[0\]\.text: a text part needs a string 'text', got int"),
    ([{"role": "user", "content": [{"type": "text"}]}],
     r"messages\[0\]\.content\[0\]\.text: a text part needs a string 'text', got nothing"),
    ([{"role": "assistant", "content": [{"type": "refusal", "text": "no"}]}],
     r"messages\[0\]\.content\[0\]\.refusal: a refusal part needs a string 'refusal', got nothing"),
    ([{"role": "user", "content": "x", "name": "a\udc00"}], r"messages\[0\]\.name: not valid Unicode"),
    ([{"role": "user", "content": [{"type": ["text"], "text": "x"}]}],
     r"messages\[0\]\.content\[0\]: only text parts .* got \['text'\]"),
    ([{"role": "user", "content": []}], r"messages\[0\]\.content: an empty list of content parts"),
    ([{"role": "user"}], r"messages\[0\]\.content: missing"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\.content: expected a string"),
    ([{"role": "system", "content": "ok"}, {"role": "user", "content": "abc \ud800x"}],
     r"messages\[1\]\.content: not valid Unicode text \(a lone surrogate U\+D800, at character 4\)"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role: 'robot' is not one of"),
])
def test_bad_messages_name_the_field(messages, match):
    with pytest.raises(ValueError, match=match):
        check_messages(messages)


def test_check_text():
    assert check_text("héllo 👋", "prompt") == "héllo 👋"
    with pytest.raises(ValueError, match=r"^prompt: not valid Unicode text"):
        check_text("a\udfffb", "prompt")


@pytest.mark.real_model
def test_apply_chat_template_names_a_prompt_that_is_not_text(smollm2):
    from medusa_jax.chat import apply_chat_template

    for bad, name in ((None, "NoneType"), (b"hi", "bytes"), (["hi"], "list")):
        with pytest.raises(ValueError, match=f"the prompt must be a str .*got {name}"):
            apply_chat_template(smollm2.tokenizer, bad)
    with pytest.raises(ValueError, match="the prompt is empty"):
        apply_chat_template(smollm2.tokenizer, "  ")


def test_raw_prompts_for_a_tokenizer_without_a_chat_template(smollm2, monkeypatch):
    """decode.py --raw gives the prompt as it is (the tokenizer's encode); without --raw, a
    tokenizer with no chat template (a base model's) gets an error that names --raw."""
    from argparse import Namespace

    from medusa_jax.cli.decode import encode_prompt, parse_args

    tok = smollm2.tokenizer
    text = "The capital of France is"
    assert encode_prompt(tok, text, Namespace(raw=True, system=None)) == tok.encode(text)
    chat = encode_prompt(tok, text, Namespace(raw=False, system=None))
    assert len(chat) > len(tok.encode(text))  # the template's markers around it
    monkeypatch.setattr(tok, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template .*pass --raw"):
        encode_prompt(tok, text, Namespace(raw=False, system=None))
    with pytest.raises(SystemExit):
        parse_args(["--raw", "--system", "Be brief.", "--prompt", text])


def test_text_that_is_not_utf8_is_refused_by_every_entry_point(tmp_path, capsys):
    """Bytes that are not UTF-8 reach Python as surrogates (argv, a piped stdin): the message names
    the byte and where it came from, before any model loads; a prompts file the same, by line."""
    from medusa_jax.chat import load_first_turns
    from medusa_jax.cli.decode import parse_args

    with pytest.raises(ValueError, match=r"^where: not valid Unicode text \(the byte 0xff, which is not UTF-8, "
                                         r"at character 3\)"):
        check_text("Hi \udcff there", "where")
    for argv, where in ((["--prompt", "Hi \udcff there"], "--prompt"), (["--system", "Be \udcfe"], "--system")):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2 and f"{where}: not valid Unicode text (the byte 0x" in capsys.readouterr().err
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "fine"}\n{"prompt": "Hi \\ud800"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl, line 2: not valid Unicode text \(a lone surrogate U\+D800"):
        load_first_turns(str(f))
