"""Request fields the server does not read are ignored and named in one warning line (a misspelt
"max_token" would otherwise vanish without a trace), while every field some part of the server reads stays
quiet. The server's warning line is tested in tests/serving/test_serving_server.py."""

from dantinox.serving.chat_endpoint import UNSUPPORTED_CHAT_FIELDS, ChatCompletionRequest
from dantinox.serving.protocol import READ_EXTRA_FIELDS, UNSUPPORTED_FIELDS, CompletionRequest
from dantinox.serving.structured_request import GUIDED_FIELDS


def test_fields_the_server_reads_are_not_reported():
    assert set(GUIDED_FIELDS) <= READ_EXTRA_FIELDS
    read = {name: None for name in READ_EXTRA_FIELDS}
    body = CompletionRequest(prompt="x", max_tokens=3, logprobs=1, best_of=1, **read)
    assert body.ignored_fields(UNSUPPORTED_FIELDS) == []
    chat = ChatCompletionRequest(messages=[], max_completion_tokens=2, top_logprobs=0, **read)
    assert chat.ignored_fields(UNSUPPORTED_CHAT_FIELDS) == []


def test_unknown_fields_are_named_sorted():
    body = CompletionRequest(prompt="x", max_token=5, temprature=0.2, user="u")
    assert body.ignored_fields(UNSUPPORTED_FIELDS) == ["max_token", "temprature"]
    chat = ChatCompletionRequest(messages=[], chat_template_kwargs={"enable_thinking": False})
    assert chat.ignored_fields(UNSUPPORTED_CHAT_FIELDS) == ["chat_template_kwargs"]
