"""Tokenizer round trips, the unknown-character policy and the streaming detokenizer."""

import json

import pytest

from dantinox.runs.tokenizer import StreamDecoder, TextTokenizer, train_tokenizer

ITALIAN = ("Nel mezzo del cammin di nostra vita\nmi ritrovai per una selva oscura,\n"
           "ché la diritta via era smarrita.\n\tPerò più giù, lì è così: virtù!  \r\n")
EXOTIC = "Virtù 😀 e 中文, città — ünïcødé ✓\n🇮🇹 fine."


def test_char_round_trip_and_vocabulary():
    tok = train_tokenizer(ITALIAN, "char")
    assert tok.kind == "char" and tok.unk_id == 0
    assert tok.vocab_size == len(set(ITALIAN)) + 1
    ids = tok.encode(ITALIAN)
    assert len(ids) == len(ITALIAN)  # one token per character, spaces, tabs and newlines included
    assert tok.decode(ids) == ITALIAN
    # Sorted, deterministic ids: the same text always gives the same vocabulary.
    assert train_tokenizer(ITALIAN, "char").encode(ITALIAN) == ids
    chars = sorted(set(ITALIAN))
    assert [tok.encode(c)[0] for c in chars] == list(range(1, len(chars) + 1))
    assert tok.encode("") == []
    assert tok.decode([]) == ""


def test_char_unknown_policy():
    tok = train_tokenizer("abc ", "char")
    with pytest.raises(ValueError) as err:
        tok.encode("ab€c z")
    message = str(err.value)
    assert "'€'" in message and "at 2" in message and "'z'" in message and "at 5" in message
    assert tok.encode("ab€c z", unknown="replace") == [2, 3, tok.unk_id, 4, 1, tok.unk_id]  # " " < "a"
    assert tok.decode(tok.encode("a€", unknown="replace")) == "a<unk>"
    with pytest.raises(ValueError, match="unknown="):
        tok.encode("abc", unknown="ignore")
    # The literal text "<unk>" is five ordinary characters, never the unknown token.
    tok2 = train_tokenizer("<unk>", "char")
    assert tok2.unk_id not in tok2.encode("<unk>")


def test_bpe_round_trip_any_text():
    tok = train_tokenizer(ITALIAN * 3, "bpe", vocab_size=300)
    assert tok.kind == "bpe" and tok.unk_id is None
    assert 256 <= tok.vocab_size <= 300
    for text in (ITALIAN, EXOTIC, "", " ", "\n\n  \t", "x" * 50):
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("") == []


def test_save_load_round_trip(tmp_path):
    for kind in ("char", "bpe"):
        tok = train_tokenizer(ITALIAN, kind, vocab_size=280 if kind == "bpe" else None)
        path = tmp_path / f"{kind}.json"
        tok.save(path)
        assert json.loads(path.read_text(encoding="utf-8"))["model"]["type"] in ("WordLevel", "BPE")
        back = TextTokenizer.load(path)
        assert (back.kind, back.vocab_size, back.unk_id) == (tok.kind, tok.vocab_size, tok.unk_id)
        assert back.encode(ITALIAN) == tok.encode(ITALIAN)
    (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="bad.json"):
        TextTokenizer.load(tmp_path / "bad.json")


def test_bad_arguments():
    with pytest.raises(ValueError, match="kind"):
        train_tokenizer("abc", "word")
    with pytest.raises(ValueError, match="256"):
        train_tokenizer("abc", "bpe", vocab_size=100)
    with pytest.raises(ValueError, match="distinct characters"):
        train_tokenizer("abc", "char", vocab_size=10)
    with pytest.raises(ValueError, match="empty"):
        train_tokenizer("", "char")
    with pytest.raises(ValueError, match="outside"):
        train_tokenizer("abc", "char").decode([0, 99])


def _stream(tok, ids):
    dec = StreamDecoder(tok)
    chunks = [dec.push(i) for i in ids]
    return chunks, dec.flush()


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_stream_decoder_italian(kind):
    tok = train_tokenizer(ITALIAN * 2, kind, vocab_size=400 if kind == "bpe" else None)
    ids = tok.encode(ITALIAN)
    chunks, tail = _stream(tok, ids)
    assert "".join(chunks) + tail == tok.decode(ids) == ITALIAN
    assert tail == ""
    assert not any("\ufffd" in c for c in chunks)


def test_stream_decoder_never_splits_characters():
    # 256 byte symbols + 4 merges: accented letters, emoji and CJK are split into byte tokens.
    tok = train_tokenizer("aaaa bbbb", "bpe", vocab_size=260)
    text = ITALIAN + EXOTIC
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the vocabulary must split some characters"
    chunks, tail = _stream(tok, ids)
    assert "".join(chunks) + tail == tok.decode(ids) == text
    assert tail == ""
    assert not any("\ufffd" in c for c in chunks)
    # Text before an incomplete character is emitted at once; the partial character is held back.
    emoji = tok.encode("a😀")
    dec = StreamDecoder(tok)
    assert dec.push(emoji[0]) == "a"
    assert [dec.push(i) for i in emoji[1:-1]] == [""] * (len(emoji) - 2)
    assert dec.push(emoji[-1]) == "😀"


def test_stream_decoder_flushes_incomplete_sequence():
    tok = train_tokenizer("aaaa", "bpe", vocab_size=256)
    first_byte = tok.encode("😀")[0]
    dec = StreamDecoder(tok)
    assert dec.push(first_byte) == ""
    assert dec.flush() == "\ufffd"  # what decode() gives for the incomplete sequence
    assert dec.flush() == ""
