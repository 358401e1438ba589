"""Constraints on what a model may generate: a JSON schema, a regex, a grammar or a list of choices, compiled
with llguidance (guidance-ai/llguidance, an Earley parser over a lexer of derivative-based regexes) into a
per-row token matcher that says which tokens may come next and advances with the tokens a row accepted.

Host side only (plain Python and numpy); the device applies the matcher's mask (``token_mask``).
  1. ``grammar_vocabulary(tokenizer, stop_ids)`` turns a run's tokenizer into llguidance's token table once
     (each token's bytes; cached per tokenizer and stop ids). The stop ids are the grammar's end-of-sequence
     tokens: allowed once the text is complete. A run without stop ids gets one virtual end token, id V,
     which no row can sample: such a row ends when its matcher can go no further (``TokenMatcher.stopped``).
  2. ``json_schema_constraint``, ``json_object_constraint``, ``regex_constraint``, ``grammar_constraint``
     (Lark, or llama.cpp's GBNF) and ``choice_constraint`` compile and validate the user's text into a
     ``Constraint``: immutable, shared by every choice of a request. An invalid schema, regex or grammar,
     or a schema keyword llguidance does not implement, raises ``GrammarError`` naming the field.
  3. ``Constraint.matcher(tokens)`` starts a ``TokenMatcher`` and feeds it the tokens already generated
     (so a preempted request's matcher is rebuilt from its tokens). Per step: ``fill_mask(row)`` writes the
     allowed tokens as packed bits into one row of a [B, W] int32 array (W = ``mask_words(V)`` = V // 32 + 1;
     bit j of word w is token 32 w + j; ``all_allowed_mask`` gives the rows of unconstrained requests),
     ``advance`` records the sampled token, ``rollback`` undoes the last ones (rejected speculative proposals).
JSON is generated without free whitespace: items are separated by ", " and keys by ": " (as Python's
``json.dumps`` writes them), so a model cannot wander into endless blanks.
Shape letters: B batch, V vocabulary, W mask words.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass

import llguidance
import llguidance.numpy as llnp
import numpy as np
from tokenizers import Tokenizer

VIRTUAL_END = "<|dantinox-end|>"  # the end token of a run without stop ids (id V; never sampled)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


class GrammarError(ValueError):
    """A constraint that cannot be compiled: ``field`` names the input (a request field such as
    "response_format.json_schema.schema", or a Python argument such as "json_schema")."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class GrammarVocabulary:
    """llguidance's view of a tokenizer: every token's bytes and the end-of-sequence ids.

    Attributes: lltokenizer (``llguidance.LLTokenizer``), vocab_size (V, the model's ids), mask_words (W),
    stop_ids (the end tokens; ``(V,)``, a virtual id, when the run has none).
    """

    def __init__(self, tokenizer, stop_ids=()):
        V = tokenizer.vocab_size
        self.vocab_size = V
        self.stop_ids = tuple(int(s) for s in stop_ids) or (V,)
        n_vocab = V + 1 if self.stop_ids == (V,) else V
        eos = list(self.stop_ids)
        if tokenizer.kind == "bpe":
            hf = tokenizer.hf
            if n_vocab > V:  # the virtual end token, as one more special token of a copy of the tokenizer
                hf = Tokenizer.from_str(hf.to_str())
                hf.add_special_tokens([VIRTUAL_END])
            self.lltokenizer = llguidance.LLTokenizer(hf.to_str(), n_vocab=n_vocab, eos_token=eos)
        else:
            self.lltokenizer = llguidance.LLTokenizer(_CharTokens(tokenizer, n_vocab), n_vocab=n_vocab, eos_token=eos)
        self.mask_words = llnp.get_bitmask_shape(1, self.lltokenizer.vocab_size)[1]


class _CharTokens:
    """The token table of a char tokenizer as ``llguidance.TokenizerWrapper`` reads it: each token's UTF-8
    bytes; ``<unk>`` and the virtual end token are special (never produced by a grammar)."""

    def __init__(self, tokenizer, n_vocab: int):
        self._tokenizer = tokenizer
        self.tokens = [tokenizer.hf.id_to_token(i).encode("utf-8") for i in range(tokenizer.vocab_size)]
        self.tokens += [b"<eos>"] * (n_vocab - tokenizer.vocab_size)
        self.special_token_ids = [tokenizer.unk_id] + list(range(tokenizer.vocab_size, n_vocab))
        self.eos_token_id = n_vocab - 1
        self.bos_token_id = None

    def __call__(self, text) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text,
                                      unknown="replace")


_VOCABULARIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def grammar_vocabulary(tokenizer, stop_ids=()) -> GrammarVocabulary:
    """The GrammarVocabulary of a dantinox TextTokenizer with these stop ids, built once (about a second for a
    49,152-token vocabulary) and cached while the tokenizer lives."""
    key = tuple(int(s) for s in stop_ids)
    with _LOCK:
        per_tokenizer = _VOCABULARIES.setdefault(tokenizer, {})
        if key not in per_tokenizer:
            per_tokenizer[key] = GrammarVocabulary(tokenizer, key)
        return per_tokenizer[key]


@dataclass(frozen=True)
class Constraint:
    """A compiled constraint: kind (one of KINDS), source (the user's text, for messages), grammar
    (llguidance's grammar text) and the vocabulary it was validated against. Immutable; build matchers
    with :meth:`matcher`."""

    kind: str
    source: str
    grammar: str
    vocabulary: GrammarVocabulary

    def matcher(self, tokens=()) -> "TokenMatcher":
        """A fresh TokenMatcher that has consumed ``tokens`` (the tokens a request already generated).
        Raises GrammarError("tokens", ...) if the grammar refuses one of them."""
        matcher = TokenMatcher(self)
        for i, token in enumerate(tokens):
            if not matcher.advance(int(token)):
                raise GrammarError("tokens", f"token {i} ({token}) is not allowed by the {self.kind} constraint: "
                                   f"{matcher.error}")
        return matcher


class TokenMatcher:
    """One row's matcher state: which tokens may come next, advanced token by token.

    ``fill_mask(row)`` writes the allowed set into ``row`` ([W] int32, packed bits); ``advance(token)``
    returns False (and sets ``error``) when the grammar refuses the token; ``stopped``: no token but an end
    token may follow (the text is complete and cannot be extended); ``accepting``: the text so far is
    complete. ``consumed``: tokens advanced so far.
    """

    def __init__(self, constraint: Constraint):
        self.constraint = constraint
        self._matcher = llguidance.LLMatcher(constraint.vocabulary.lltokenizer, constraint.grammar, log_level=0)
        self.consumed = 0

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into ``row``: [W'] int32, C-contiguous, W' >= W words (bit j of word w:
        token 32 w + j); words past W are set to zero."""
        words = self.constraint.vocabulary.mask_words
        if row.dtype != np.int32 or row.ndim != 1 or row.size < words or not row.flags["C_CONTIGUOUS"]:
            raise ValueError(f"mask row must be a contiguous int32 vector of at least {words} words")
        row[words:] = 0
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, words * row.itemsize)

    def mask(self) -> np.ndarray:
        """The allowed next tokens as a new [W] int32 row of packed bits (W = ``mask_words(V)``)."""
        row = np.zeros(mask_words(self.constraint.vocabulary.vocab_size), np.int32)
        self.fill_mask(row)
        return row

    def ends_here(self, stop_ids) -> bool:
        """True when the text is complete and cannot be extended, and none of ``stop_ids`` (the ids the row
        stops at) is an end token the grammar would allow next: the row must end now, without an end token.
        While one of them is allowed the row ends by sampling it instead."""
        ends = set(self.constraint.vocabulary.stop_ids) & set(int(s) for s in stop_ids)
        return self.stopped and not ends

    def advance(self, token: int) -> bool:
        """Record a sampled token; False when it is not allowed (the matcher then stays in error)."""
        self.consumed += 1
        return self._matcher.consume_token(int(token))

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` advanced tokens (speculative decoding's rejected proposals). RuntimeError when
        the matcher cannot (it keeps a bounded history)."""
        if n and not self._matcher.rollback(int(n)):
            raise RuntimeError(f"the {self.constraint.kind} matcher cannot roll back {n} tokens: {self.error}")
        self.consumed -= int(n)

    @property
    def stopped(self) -> bool:
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self._matcher.is_accepting()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


def mask_words(vocab_size: int) -> int:
    """W of the masks the compiled steps take for a model of V = vocab_size tokens: V // 32 + 1 words, room
    for every token and the virtual end token V of a run without stop ids."""
    return vocab_size // 32 + 1


def mask_allows(row: np.ndarray, token: int) -> bool:
    """Whether the packed-bit mask ``row`` ([W] int32, as ``fill_mask`` writes it) allows ``token``."""
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def all_allowed_mask(rows: int, vocab_size: int) -> np.ndarray:
    """[rows, W] int32 of set bits (W = ``mask_words(vocab_size)``): the mask of unconstrained rows."""
    return np.full((rows, mask_words(vocab_size)), -1, np.int32)


def _compile(kind: str, source: str, grammar: str, vocabulary: GrammarVocabulary, field: str) -> Constraint:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, vocabulary.lltokenizer)
    if is_error and "unimplemented" in messages[0].lower():  # a keyword llguidance refuses rather than ignores
        raise GrammarError(field, f"{field}: not supported by this server's grammar engine (llguidance): "
                           f"{_first_line(messages[0])}")
    if is_error:
        raise GrammarError(field, f"{field}: invalid {kind.replace('_', ' ')}: {_first_line(messages[0])}")
    return Constraint(kind, source, grammar, vocabulary)


def _first_line(message: str) -> str:
    return " ".join(line.strip() for line in message.strip().splitlines()[:3])


def json_schema_constraint(schema, vocabulary: GrammarVocabulary, field: str = "json_schema") -> Constraint:
    """JSON text valid for ``schema`` (a dict, or its JSON text). Raises GrammarError naming ``field`` for text
    that is not a JSON object, a schema that is not valid, or keywords llguidance does not implement (it
    refuses them rather than ignoring them)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise GrammarError(field, f"{field}: not valid JSON: {err}") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarError(field, f"{field}={schema!r} is not allowed: a JSON schema object")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as err:
        raise GrammarError(field, f"{field}: {err}") from None
    return _compile("json_schema", json.dumps(schema), grammar, vocabulary, field)


def json_object_constraint(vocabulary: GrammarVocabulary, field: str = "response_format") -> Constraint:
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    return _compile("json_object", '{"type": "object"}', grammar, vocabulary, field)


def regex_constraint(pattern, vocabulary: GrammarVocabulary, field: str = "regex") -> Constraint:
    """Text that matches ``pattern`` whole (Rust ``regex`` syntax, as llguidance reads it: no look-around,
    no backreferences). Raises GrammarError naming ``field``."""
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError(field, f"{field}={pattern!r} is not allowed: a non-empty regular expression")
    return _compile("regex", pattern, llguidance.LLMatcher.grammar_from_regex(pattern), vocabulary, field)


def grammar_constraint(text, vocabulary: GrammarVocabulary, field: str = "grammar") -> Constraint:
    """Text derived from a context-free grammar: Lark syntax (``start: ...``, llguidance's dialect), or
    llama.cpp's GBNF (``root ::= ...``), which is converted to Lark. Raises GrammarError naming ``field``."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError(field, f"{field}={text!r} is not allowed: a Lark or GBNF grammar")
    try:
        grammar = llguidance.grammar_from("grammar", text)
    except ValueError as err:
        raise GrammarError(field, f"{field}: invalid grammar: {_first_line(str(err))}") from None
    return _compile("grammar", text, grammar, vocabulary, field)


def choice_constraint(choices, vocabulary: GrammarVocabulary, field: str = "choice") -> Constraint:
    """Exactly one of ``choices`` (a non-empty list of non-empty strings)."""
    if (not isinstance(choices, (list, tuple)) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise GrammarError(field, f"{field}={choices!r} is not allowed: a non-empty list of non-empty strings")
    lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return _compile("choice", json.dumps(list(choices)), llguidance.LLMatcher.grammar_from_lark(lark), vocabulary,
                    field)


def constraint_from(vocabulary: GrammarVocabulary, json_schema=None, regex=None, grammar=None,
                    choice=None) -> Constraint | None:
    """The one constraint among the given arguments (None when none is given). Raises GrammarError when more
    than one is given, or as the constraint's builder."""
    given = {k: v for k, v in dict(json_schema=json_schema, regex=regex, grammar=grammar, choice=choice).items()
             if v is not None}
    if len(given) > 1:
        raise GrammarError(list(given)[1], f"{' and '.join(given)} given: give at most one constraint")
    if not given:
        return None
    (name, value), = given.items()
    build = {"json_schema": json_schema_constraint, "regex": regex_constraint, "grammar": grammar_constraint,
             "choice": choice_constraint}[name]
    return build(value, vocabulary, name)
