"""Chat requests at the gateway: the template applied, the end-of-turn token a stop, fields named."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.chat import ChatTemplate
from gateway.validation import Limits, validate
from splitserve.client import chat_messages, make_chat_request, make_request
from splitserve_api.v1 import gateway_pb2

MODEL = Path(__file__).resolve().parents[2] / "models" / "target"
LIMITS = Limits(vocab_size=4096, max_model_len=512, max_stop_strings=8, max_stop_string_bytes=256)
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}")


@pytest.fixture(scope="module")
def plain():  # noqa: ANN201
    return AutoTokenizer.from_pretrained(str(MODEL))


@pytest.fixture(scope="module")
def chat():  # noqa: ANN201
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    tokenizer.chat_template = TEMPLATE
    return ChatTemplate.of(tokenizer)


def test_template_is_applied_and_end_of_turn_stops(chat: ChatTemplate) -> None:
    tok = chat.tokenizer
    assert chat.end_of_turn_ids == (tok.convert_tokens_to_ids("</s>"),)
    req = validate(make_chat_request([("system", "Be brief."), ("user", "hi")], 8), tok, LIMITS, chat)
    text = "<s>system: Be brief.</s><s>user: hi</s><s>assistant: "
    assert req.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert req.params.stop_token_ids == chat.end_of_turn_ids


def test_ignore_eos_and_own_stop_ids_are_kept(chat: ChatTemplate) -> None:
    request = make_chat_request([("user", "hi")], 8, ignore_eos=True)
    assert validate(request, chat.tokenizer, LIMITS, chat).params.stop_token_ids == ()
    request = make_chat_request([("user", "hi")], 8)
    request.stopping.stop_token_ids.extend([7, 2])
    assert validate(request, chat.tokenizer, LIMITS, chat).params.stop_token_ids == (7, 2)


def test_a_model_without_a_chat_template_rejects_chat(plain) -> None:  # noqa: ANN001
    assert ChatTemplate.of(plain) is None and ChatTemplate.of(None) is None
    with pytest.raises(ValueError, match=r"prompt\.chat: this model has no chat template"):
        validate(make_chat_request([("user", "hi")], 8), plain, LIMITS, None)


BAD = [
    ("no messages", gateway_pb2.ChatMessages(), r"prompt\.chat\.messages must hold at least one"),
    ("role unset", gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role=gateway_pb2.CHAT_ROLE_USER, content="a"),
                                                      gateway_pb2.ChatMessage(content="b")]),
     r"prompt\.chat\.messages\[1\]\.role must be set"),
    ("too long", chat_messages([("user", "word " * 600)]), r"max_model_len=512"),
]


@pytest.mark.parametrize("messages, error", [(m, e) for _, m, e in BAD], ids=[n for n, _, _ in BAD])
def test_bad_chat_requests_name_the_field(chat: ChatTemplate, messages: gateway_pb2.ChatMessages, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        validate(make_request(messages, 8), chat.tokenizer, LIMITS, chat)


def test_client_rejects_an_unknown_role() -> None:
    with pytest.raises(ValueError, match="chat role must be one of"):
        chat_messages([("robot", "beep")])


def test_generate_takes_a_prompt_or_a_chat_message(capsys: pytest.CaptureFixture[str]) -> None:
    from splitserve.cli import main

    assert main(["generate"]) == 2
    assert main(["generate", "def f():", "--chat", "hi"]) == 2
    assert "give a PROMPT or --chat MESSAGE" in capsys.readouterr().err
    assert main(["generate", "--in-process", "--model", str(MODEL), "--chat", "hi"]) == 2
    assert "has no chat template" in capsys.readouterr().err
