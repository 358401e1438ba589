"""One request cannot stall the server (issue 19, item 4): the request body limit (413 in OpenAI's format, with
and without a Content-Length), a prompt over the context by its characters refused before it is tokenized, the
characters-per-token bound checked against the tokenizers library's own token spans, and tokenizing / chat
rendering off the event loop, shown by ordering: a request whose tokenizing is held until a second request has
been answered completes only after it (if tokenizing ran on the loop, the second request could never be
answered)."""

import json
import random
import re
import threading

import httpx
import pytest
from chat_util import TEXT, chat_tokenizer, save_tiny_chat_run
from serving_util import SMALL_BUCKETS
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from dantinox.cli import entrypoint as cli
from dantinox.runs.chars_per_token import fewest_tokens, max_chars_per_token
from dantinox.runs.chat import load_chat_format
from dantinox.runs.run_dir import load_run
from dantinox.runs.tokenizer import train_tokenizer, with_mask_token
from dantinox.serving.engine import EngineConfig, PagedEngine
from dantinox.serving.request_limits import DEFAULT_MAX_REQUEST_BYTES, token_list_length
from dantinox.serving.server import ServerThread, create_app

LIMIT = 16 * 2**20  # this file's server takes bodies up to 16 MiB, so a 10 MB prompt is read and judged
TEN_MB = 10 * 10**6
CONTEXT = 96


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, tokenizer, calls): the tiny chat run served with a 16 MiB body limit; ``calls`` records the
    length of every text the server's tokenizer encodes (encode and encode_pieces)."""
    run_dir = save_tiny_chat_run(tmp_path_factory.mktemp("limits") / "tiny-chat", max_context=CONTEXT)
    model, _, tokenizer, _ = load_run(run_dir)
    calls = []
    encode, encode_pieces = tokenizer.encode, tokenizer.encode_pieces
    tokenizer.encode = lambda text, *a, **k: calls.append(len(text)) or encode(text, *a, **k)
    tokenizer.encode_pieces = lambda pieces, *a, **k: (calls.append(sum(len(t) for t, _ in pieces))
                                                       or encode_pieces(pieces, *a, **k))
    engine = PagedEngine(model, EngineConfig(block_size=4, num_blocks=64, max_running=4, max_batched_tokens=16,
                                             decode_buckets=(1, 4), **SMALL_BUCKETS))
    app = create_app(engine, tokenizer, "tiny-chat", load_chat_format(run_dir, tokenizer), max_request_bytes=LIMIT)
    server = ServerThread(app).start()
    yield server, tokenizer, calls
    server.stop()


def _post(server, path: str, timeout: float = 120, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, timeout=timeout, **kwargs)


def _small(server) -> httpx.Response:
    return _post(server, "/v1/completions", json={"prompt": "Nel mezzo", "max_tokens": 2, "temperature": 0})


# The characters-per-token bound ----------------------------------------------------------------------------

def _texts(alphabet: str, count: int = 40, seed: int = 0):
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 300))) for _ in range(count)]


@pytest.mark.parametrize("kind", ["char", "char+mask", "bpe", "bpe+chatml"])
def test_no_token_spans_more_than_the_bound(kind):
    tokenizer = {"char": lambda: train_tokenizer(TEXT, "char"), "char+mask": lambda: with_mask_token(
        train_tokenizer(TEXT, "char")), "bpe": lambda: train_tokenizer(TEXT, "bpe", 260), "bpe+chatml": chat_tokenizer
                 }[kind]()
    bound = max_chars_per_token(tokenizer)
    assert bound == {"char": 1, "char+mask": len("<mask>")}.get(kind, bound) and bound >= 1
    alphabet = "".join(sorted(set(TEXT))) + ("" if kind.startswith("char") else "∑é€😀  ")
    texts = _texts(alphabet) + [TEXT * 4, " " * 500, "<mask>" * 9, "<|im_start|>" * 5]
    for text in texts:
        encoding = tokenizer.hf.encode(text, add_special_tokens=False)
        assert all(end - start <= bound for start, end in encoding.offsets), (kind, text)  # the library's spans
        assert len(encoding.ids) >= fewest_tokens(len(text), bound)


def test_the_bound_is_reached_by_the_longest_token():
    tokenizer = train_tokenizer(TEXT, "bpe", 260)
    bound = max_chars_per_token(tokenizer)
    longest = max(range(tokenizer.vocab_size), key=lambda i: len(tokenizer.hf.id_to_token(i)))
    text = tokenizer.decode([longest])
    assert len(text) == bound and len(tokenizer.encode(text)) == 1


def _wordlevel(pre_tokenizer) -> Tokenizer:
    hf = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizer
    return hf


def _byte_bpe(**changes) -> Tokenizer:
    hf = train_tokenizer(TEXT, "bpe", 260).hf
    for name, value in changes.items():
        setattr(hf, name, value)
    return hf


def test_no_bound_where_none_can_be_proved():
    assert max_chars_per_token(_wordlevel(pre_tokenizers.Whitespace())) is None  # "aaaa...": one <unk>
    assert max_chars_per_token(_byte_bpe(normalizer=normalizers.NFC())) is None   # NFC can merge characters
    assert max_chars_per_token(_byte_bpe(pre_tokenizer=pre_tokenizers.Whitespace())) is None  # drops spaces
    stripping = _byte_bpe()
    stripping.add_special_tokens([AddedToken("<x>", lstrip=True, special=True)])  # swallows the spaces before it
    assert max_chars_per_token(stripping) is None
    fused = Tokenizer(models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>", fuse_unk=True))
    assert max_chars_per_token(fused) is None  # one <unk> for a run of unknown characters of any length
    unfused = Tokenizer(models.BPE({"<unk>": 0, "a": 1, "aa": 2}, [("a", "a")], unk_token="<unk>"))
    assert max_chars_per_token(unfused) == len("<unk>")
    assert fewest_tokens(10, 3) == 4 and fewest_tokens(9, 3) == 3 and fewest_tokens(0, 3) == 0


# The body limit ---------------------------------------------------------------------------------------------

def test_default_body_limit_is_one_mebibyte():
    assert DEFAULT_MAX_REQUEST_BYTES == 2**20


def test_body_over_the_limit_is_413_naming_size_and_limit(served):
    server, _, calls = served
    before = len(calls)
    body = b'{"prompt": "' + b"a" * (LIMIT + 1) + b'"}'
    answer = _post(server, "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 413
    error = answer.json()["error"]
    assert (error["param"], error["code"], error["type"]) == ("body", "request_too_large", "invalid_request_error")
    assert f"{len(body):,} bytes" in error["message"] and f"{LIMIT:,} bytes" in error["message"]

    def chunks():  # no Content-Length: the body is counted as it arrives
        for _ in range(LIMIT // 2**20 + 2):
            yield b"a" * 2**20

    answer = _post(server, "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert answer.status_code == 413 and "without a Content-Length" in answer.json()["error"]["message"]
    assert len(calls) == before  # nothing was tokenized
    metrics = httpx.get(server.url + "/metrics").text
    assert 'dantinox_requests_rejected_total{reason="body_too_large"} 2.0' in metrics
    assert _small(server).status_code == 200  # the connection pool and the server are fine afterwards


def test_max_request_bytes_flag_is_checked(capsys):
    assert cli.main(["serve", "--max-request-bytes", "0"]) == 2
    err = capsys.readouterr().err
    assert "--max-request-bytes 0 is not allowed: at least 1 byte" in err and len(err.strip().splitlines()) == 1


# A prompt over the context by its characters ----------------------------------------------------------------

def test_prompt_over_the_context_by_characters_is_refused_before_tokenizing(served):
    server, tokenizer, calls = served
    bound = max_chars_per_token(tokenizer)
    before = len(calls)
    answer = _post(server, "/v1/completions", json={"prompt": "a" * (CONTEXT * bound + 1)})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt"
    assert f"at least {CONTEXT + 1} tokens" in answer.json()["error"]["message"]
    answer = _post(server, "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * CONTEXT
                                                                       * bound}]})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"
    assert "the prompt rendered from messages has" in answer.json()["error"]["message"]
    assert len(calls) == before
    # at the bound itself the prompt is tokenized (it could be CONTEXT tokens); the engine then judges it
    answer = _post(server, "/v1/completions", json={"prompt": "a" * (CONTEXT * bound)})
    assert len(calls) == before + 1 and answer.status_code == 400
    assert "characters" not in answer.json()["error"]["message"]


def test_ten_megabyte_prompt_beside_a_small_request(served):
    server, _, calls = served
    before, results = len(calls), {}

    def big():
        results["big"] = _post(server, "/v1/completions", json={"prompt": "Nel mezzo " * (TEN_MB // 10)})

    thread = threading.Thread(target=big)
    thread.start()
    results["small"] = _small(server)
    thread.join(120)
    assert results["small"].status_code == 200
    assert results["big"].status_code == 400 and results["big"].json()["error"]["param"] == "prompt"
    assert TEN_MB not in calls[before:]  # refused from its length, never tokenized


@pytest.mark.parametrize("text, want", [
    (b'{"prompt": [1, 2, 3], "max_tokens": 4}', 3), (b'{"max_tokens": 4,"prompt":[ 7 ]}', 1),
    (b'{"prompt": [-5, 0]}', 2), (b'{"prompt": "[1, 2]"}', None), (b'{"prompt": ["a", "b"]}', None),
    (b'{"stop": ["\\"prompt\\": [1, 2"], "prompt": "x"}', None), (b'{"prompt": [1, 2', None)])
def test_token_list_length_counts_the_ids_of_the_prompt_from_its_bytes(text, want):
    assert token_list_length(text) == want
    if want is not None:
        assert want == len(json.loads(text)["prompt"])


def _invalid_prompts(server) -> float:
    """dantinox_requests_rejected_total{reason="invalid_prompt"} now (0 before the first)."""
    found = re.search(r'dantinox_requests_rejected_total\{reason="invalid_prompt"\} ([0-9.]+)',
                      httpx.get(server.url + "/metrics").text)
    return float(found.group(1)) if found else 0.0


def test_ten_megabyte_token_id_prompt_is_refused_before_it_is_parsed(served, monkeypatch):
    # parsing and validating 3.3 million ids held the event loop for about a second (new-user walk-through)
    server, _, _ = served
    parsed = []
    real = json.loads
    monkeypatch.setattr(json, "loads", lambda text, *a, **k: parsed.append(len(text)) or real(text, *a, **k))
    counted = _invalid_prompts(server)
    body = json.dumps({"prompt": [5] * 3_300_000, "max_tokens": 4}).encode()
    answer = _post(server, "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt"
    assert "prompt has 3,300,000 tokens" in answer.json()["error"]["message"]
    assert not [n for n in parsed if n >= len(body)]   # the body was never parsed as JSON
    assert _invalid_prompts(server) == counted + 1   # counted with the endpoints' own refusals
    small = json.dumps({"prompt": [5] * 40, "max_tokens": 2, "temperature": 0}).encode()
    assert _post(server, "/v1/completions", content=small, headers={"content-type": "application/json"}
                 ).status_code == 200


# Off the event loop ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_tokenizing_runs_off_the_event_loop(served, monkeypatch, path):
    """The held request's tokenizing waits until the small request has been answered: the small one comes back
    while the held one is still inside the tokenizer, and the held one completes after."""
    server, tokenizer, _ = served
    marker = "Ché la diritta via"
    entered, answered = threading.Event(), threading.Event()
    name = "encode" if path == "/v1/completions" else "encode_pieces"
    real = getattr(tokenizer, name)

    def held(arg, *a, **k):
        text = arg if isinstance(arg, str) else "".join(t for t, _ in arg)
        if marker in text:
            entered.set()
            answered.wait(60)
        return real(arg, *a, **k)

    monkeypatch.setattr(tokenizer, name, held)
    body = ({"prompt": marker} if name == "encode" else {"messages": [{"role": "user", "content": marker}]})
    order, results = [], {}

    def send_held():
        results["held"] = _post(server, path, json={**body, "max_tokens": 2, "temperature": 0})
        order.append("held")

    thread = threading.Thread(target=send_held)
    thread.start()
    assert entered.wait(60), "the held request never reached the tokenizer"
    small = _post(server, "/v1/completions", timeout=50,
                  json={"prompt": "Nel mezzo", "max_tokens": 2, "temperature": 0})
    order.append("small")
    answered.set()
    thread.join(120)
    assert small.status_code == 200 and results["held"].status_code == 200
    assert order == ["small", "held"]
