"""Generator: text in, text out, from a run directory (or the bundled Divina Commedia model).

    gen = Generator("runs/my_run")          # loads config, weights and tokenizer; one warm-up generation
    gen.generate("Nel mezzo del cammin", max_new_tokens=200)
    gen.chat([{"role": "user", "content": "What is the capital of France?"}])   # models with a chat template
    for piece in gen.stream("Nel mezzo", max_new_tokens=200):
        print(piece, end="", flush=True)

Prompts are encoded with the run's tokenizer; characters outside a char vocabulary raise ValueError by default
(``unknown="replace"`` maps them to ``<unk>`` instead). Streaming decodes with an incremental detokenizer, so
a piece never ends inside a multi-byte character.

Every autoregressive path (generate, stream, chat) stops at the run's stop ids (``stop_ids``: its end-of-turn
and end-of-text tokens, ``dantinox.runs.stop_ids``; case K11) and leaves that token out of the text;
``ignore_eos=True`` generates past them to max_new_tokens (as vLLM's ``ignore_eos``). A diffusion model fills
its whole canvas and ignores them.

``speculative="ngram"`` (generate, complete, stream, chat; with ``spec_tokens`` k, ``spec_ngram_max`` /
``spec_ngram_min``) decodes through ``dantinox.generation.speculative``: prompt-lookup proposals verified k at a
time in one forward (``speculative="draft"``: a draft model's proposals, ``Generator(..., draft_run=RUN)``);
greedy text is the same as without it, sampled text has the same distribution. A request
whose measured acceptance makes verification a loss stops speculating (``switch_off_threshold``: measured once
per k on this model). With json_schema / regex / grammar the proposals are cut where the grammar forbids a
token and verified from the masked distributions (``dantinox.generation.constrained_speculative``). Each such
call leaves its acceptance in ``spec_stats`` (and ``Completion.spec``); docs/explanation/speculation.md says when it
pays.
"""

from __future__ import annotations

import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, NamedTuple

import numpy as np

from ..parallel.sharding import shard_model
from ..programs.store import store_dir
from ..kv.channel_keys import check_spec_group, with_kv_keys
from ..quant.kv_dtype import with_kv_dtype
from ..quant.weights import check_quantize, quantize_weights
from ..runs.bundled import DEFAULT_BUNDLED, bundled_run_dir, resolve_run_dir  # noqa: F401 (re-exported)
from ..runs.chat import load_chat_format, require_chat_format
from ..runs.chat_template import ChatTemplateError
from ..runs.draft_run import load_draft_run
from ..kv.sessions import load_static_session, save_static_session
from ..kv.static import CapacityError
from ..runs.run_dir import load_run
from ..runs.stop_ids import read_stop_ids
from ..runs.tokenizer import StreamDecoder
from ..xla import CompileCounter
from .constrained_decode import constrained_result
from .constrained_speculative import constrained_speculative_result
from .decode import (decode_windows, generate_result, one_row_windows, stream_tokens, warm_decode,
                     warm_prefill)
from .grammar import Constraint, constraint_from, grammar_vocabulary
from .paradigm import generate
from .prompts import bucket_length
from .sessions import Session, session_generate
from .speculative_generate import (SpecSettings, SpecStats, break_even, check_draft, draft_cost,
                                   spec_settings,
                                   speculative_generate, speculative_stream, verify_cost, warm_up_speculative)

BUNDLED_RUN = DEFAULT_BUNDLED
# Programs made ready at once by warm_up: two overlap on 2 cores (SmolLM2's chat prefill and decode loop load in
# 0.5 s together instead of 0.8 s one after the other); the decode loop reads the prefill's output shapes off
# its stored file, so it does not wait for the prefill to load.
WARM_UP_THREADS = 2


def prompt_buckets(max_context: int) -> list[int]:
    """The prompt lengths (tokens) prefill compiles for: one per bucket of ``bucket_length``, each the
    longest prompt of its bucket that leaves room for one new token (e.g. 16, 32, 64, 127 for S = 128)."""
    buckets, n = [], 1
    while n < max_context:
        bucket = bucket_length(n, max_context)
        buckets.append(min(bucket, max_context - 1))
        n = bucket + 1
    return buckets


def warm_up(model, prompt_lengths: list[int] | None = None, max_new_tokens: int | None = None) -> None:
    """Make prefill and the decode loop (batch 1) of an AR model ready without running them (loaded from the
    program store, or compiled): the prefill of each prompt bucket and the decode loop in each attention
    window a request can use (``decode.one_row_windows``: one window up to max_context 512, then 512, 1024, ... slots).
    prompt_lengths: the prompt lengths (tokens) to prepare for; None = every bucket up to max_context and
    every window. With prompt_lengths, the window of the longest prompt + max_new_tokens (None: + 1). The step
    bound, seed and sampling settings are traced, so later calls with any of them compile nothing. The decode
    loop is warmed behind a prompt of the smallest of these buckets, so it adds no prefill program of its own
    (a one-token prompt would compile the 16-token bucket, 2-3 s on SmolLM2, that a chat turn never uses)."""
    S = model.cfg.max_context
    lengths = prompt_buckets(S) if prompt_lengths is None else sorted(
        {min(bucket_length(n, S), S - 1) for n in prompt_lengths})
    if prompt_lengths is None:
        windows = one_row_windows(model.cfg)
    else:
        windows = [decode_windows(model.cfg, 1, max(prompt_lengths) + (max_new_tokens or 1))]
    items = [functools.partial(warm_prefill, model, length) for length in lengths]
    items += [functools.partial(warm_decode, model, window, min(lengths[0], S - 2)) for window in windows]
    # Without the program store the decode loop's warm-up traces the prefill for its output shapes: after the
    # prefill's own trace, jit's trace cache answers; at the same time, it would trace twice.
    threads = WARM_UP_THREADS if store_dir() is not None else 1
    with ThreadPoolExecutor(threads) as pool:   # loading a program mostly waits on XLA, not Python
        for done in [pool.submit(item) for item in items]:
            done.result()


class Generator:
    """A loaded model with its tokenizer, ready to generate text.

    Args:
      run_dir: a run directory from ``dantinox train``, or the name of a bundled model ("dante",
        "dante-diffusion"; see ``dantinox.runs.bundled``); None loads the bundled "dante" model.
      warmup: compile at load time what a single-prompt ``generate`` or ``stream`` runs, so no such call
        compiles anything afterwards, whatever its prompt length and max_new_tokens up to max_context:
        prefill for every prompt bucket (16, 32, ... max_context tokens) and the decode loop, at batch 1
        (see ``warm_up``). A batch of several prompts compiles its batch size on first use. Autoregressive
        models only (diffusion compiles per (bucket, gen_len, block_size)).
      mesh: a ``dantinox.make_mesh`` mesh to shard the parameters over (every generation then runs on it;
        docs/how-to/multi-device.md); None: one device.
      kv_dtype: KV cache dtype ("float32", "bfloat16", "int8" or an alias); None keeps the run's cache_dtype.
      kv_keys, kv_key_group: the int8 cache's key layout, "channel" (per-channel keys over groups of
        kv_key_group slots, KIVI: ``dantinox.kv.channel_layout``; the default of an int8 MHA / GQA / MQA
        cache) or "token"; None keeps the run's. An explicit "channel" needs an int8 MHA / GQA / MQA cache,
        and speculation over channel keys needs spec_tokens + 1 <= the key group (ValueError naming the flag).
      quantize: None (float32 weights), "bf16", "int8" (weight-only, per output channel), "int4" or "q8_0"
        (Q4_1 / Q8_0 blocks of 32 weights, run by the block kernel); see
        ``dantinox.quant.weights``.
      draft_run: a run directory (or bundled name) whose model proposes for ``speculative="draft"``: same
        tokenizer (vocabulary size, special and stop ids: ``runs.draft_run``), same vocab_size, a max_context at
        least this model's (``check_draft``); kv_dtype applies to its cache too.
      keep_session: keep the static cache of the last one-prompt call (generate, complete, chat; plain
        decoding) so the next call whose prompt extends it computes only the new tokens, and ``save_session``
        can write it (``dantinox.generation.sessions``); ``load_session`` turns it on. One device only.
    Attributes: model, cfg, tokenizer, summary (model_summary.json), load_seconds, warmup (CompileCounter),
      chat_format (``dantinox.runs.chat.ChatFormat``, or None when the run has no chat template), stop_ids
      (the token ids generation stops at, ``dantinox.runs.stop_ids.read_stop_ids``; () for a trained run),
      spec_stats (the SpecStats of the latest speculative call, None before one), session_tokens (the tokens
      the kept session holds, () without one), session_reused (prompt tokens the last call took from it).
    Raises: RunDirError for a missing or inconsistent run directory; MeshError when n_heads or mlp_hidden
    does not divide by the mesh's model axis; KVDtypeError for a kv_dtype outside the allowed set or one the
    model cannot hold (int8 for a diffusion model); ValueError for another quantize value.
    """

    def __init__(self, run_dir: str | os.PathLike | None = None, warmup: bool = True, mesh=None,
                 kv_dtype: str | None = None, quantize: str | None = None, draft_run: str | os.PathLike | None = None,
                 kv_keys: str | None = None, kv_key_group: int | None = None, keep_session: bool = False):
        start = time.perf_counter()
        check_quantize(quantize)
        self.run_dir = resolve_run_dir(run_dir)
        self.model, self.cfg, self.tokenizer, self.summary = load_run(self.run_dir)
        self.model = with_kv_keys(with_kv_dtype(self.model, kv_dtype, "kv_dtype"), kv_keys, kv_key_group)
        self.cfg = self.model.cfg
        self.quantize = quantize
        quantize_weights(self.model, quantize)
        shard_model(self.model, mesh)
        self.chat_format = load_chat_format(self.run_dir, self.tokenizer)
        self.stop_ids = read_stop_ids(self.run_dir, self.tokenizer)
        self.warmup = CompileCounter()
        self.spec_stats: SpecStats | None = None
        self._min_accept: dict[tuple, float] = {}
        self.keep_session, self._session, self.session_reused = bool(keep_session), None, 0
        if self.keep_session and mesh is not None:
            raise ValueError("keep_session=True is not allowed with a mesh: sessions run on one device")
        self.draft = None
        if draft_run is not None:
            self.draft = with_kv_keys(with_kv_dtype(load_draft_run(draft_run, self.tokenizer, self.stop_ids), kv_dtype,
                                                    "kv_dtype"), kv_keys, kv_key_group)
            check_draft(self.model, self.draft)
        if warmup:
            self.warm_up()
        self.load_seconds = time.perf_counter() - start

    def warm_up(self, prompt_lengths: list[int] | None = None, max_new_tokens: int | None = None,
                speculative: SpecSettings | None = None) -> CompileCounter:
        """Compile what generate / stream will run (see :func:`warm_up`; prompt_lengths None = every prompt
        bucket and attention window; max_new_tokens picks the window for the given prompt lengths), and the
        speculative loop of ``speculative`` when given (``spec_settings``). Returns and keeps
        (``self.warmup``) the CompileCounter. Nothing to do for a diffusion model (it compiles per (bucket,
        gen_len, block_size))."""
        if self.cfg.paradigm == "ar":
            with self.warmup:
                warm_up(self.model, prompt_lengths, max_new_tokens)
                if speculative is not None:
                    self.switch_off_threshold(speculative.spec_tokens, speculative.proposer)
                    S = self.cfg.max_context
                    warm_up_speculative(self.model, speculative, prompt_buckets(S) if prompt_lengths is None
                                        else sorted({min(bucket_length(n, S), S - 1) for n in prompt_lengths}),
                                        self._draft_for(speculative))
        return self.warmup

    def switch_off_threshold(self, k: int, proposer: str = "ngram") -> float:
        """min_accept for k proposed tokens on this model: ``break_even(verify_cost(model, k), k)``; for the
        draft proposer the verify cost gains the draft's k forwards (``draft_cost``). Measured on first use
        (small compiles and a few dozen forwards) and kept."""
        if (k, proposer) not in self._min_accept:
            cost = verify_cost(self.model, k)
            if proposer == "draft":
                cost += k * draft_cost(self.model, self._draft_for(SpecSettings("draft")))
            self._min_accept[(k, proposer)] = break_even(cost, k)
        return self._min_accept[(k, proposer)]

    def _draft_for(self, settings: SpecSettings):
        """The draft model when ``settings`` asks for one (ValueError when this Generator has none), else None."""
        if settings.proposer != "draft":
            return None
        if self.draft is None:
            raise ValueError("speculative='draft' needs a draft model: Generator(..., draft_run=RUN) "
                             "(dantinox generate --speculative draft:RUN)")
        return self.draft

    def speculation(self, speculative, spec_tokens=4, spec_ngram_max=4, spec_ngram_min=1,
                    use_cache=True) -> SpecSettings | None:
        """The checked SpecSettings of a call's speculative arguments (None: plain decoding). ValueError naming
        the argument: an unknown proposer or a bound (``spec_settings``), a diffusion model, or use_cache=False
        (speculation needs the cached autoregressive loop). With a json_schema / regex / grammar constraint the
        proposals are checked against the grammar (``constrained_speculative``). The settings carry this
        model's switch-off threshold (``switch_off_threshold``)."""
        settings = spec_settings(speculative, spec_tokens, spec_ngram_max, spec_ngram_min)
        if settings is None:
            return None
        check_spec_group(self.cfg, settings.spec_tokens)
        if self.cfg.paradigm != "ar":
            raise ValueError(f"speculative={speculative!r} needs an autoregressive model; this one has "
                             f"paradigm={self.cfg.paradigm!r}")
        if not use_cache:
            raise ValueError(f"speculative={speculative!r} is not allowed with use_cache=False: speculation runs "
                             "through the cached decode loop")
        self._draft_for(settings)
        return settings._replace(min_accept=self.switch_off_threshold(settings.spec_tokens, settings.proposer))

    def encode(self, text: str, unknown: str = "error") -> list[int]:
        """Token ids of a prompt. Raises ValueError for an empty prompt or unknown characters (see module doc)."""
        if not isinstance(text, str) or text == "":
            raise ValueError("prompt is empty: give at least one character")
        return self.tokenizer.encode(text, unknown=unknown)

    def generate(self, text: str | list[str], max_new_tokens: int = 200, *, use_cache: bool = True,
                 temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 unknown: str = "error", ignore_eos: bool = False, json_schema=None, regex: str | None = None,
                 grammar: str | None = None, speculative: str | None = None, spec_tokens: int = 4,
                 spec_ngram_max: int = 4, spec_ngram_min: int = 1, **diffusion_options) -> str | list[str]:
        """Continue ``text`` (or each text of a list, batched) by up to max_new_tokens tokens; returns the new
        text only, which ends before the first stop id (``stop_ids``; ignore_eos=True: no stop ids). Sampling
        arguments as in :func:`dantinox.generate` (temperature 0 = greedy); a diffusion model generates exactly
        max_new_tokens (gen_len) tokens and takes diffusion_options (block_size, steps_per_block, threshold,
        refresh; see dantinox.generation.diffusion.diffusion_generate).
        json_schema (a dict or its JSON text), regex, grammar (Lark or GBNF): at most one; the text is then
        constrained to it (structured outputs, docs/how-to/structured-outputs.md; autoregressive models with the
        cache only), through the host-stepped loop of ``dantinox.generation.constrained_decode``.
        speculative: None, "ngram" or "draft" (with draft_run; module docstring; ``speculation`` checks the
        arguments); with a constraint (n-gram only) the proposals are checked against the grammar
        (``constrained_speculative``).
        Raises ValueError / CapacityError as :func:`dantinox.generate` and :meth:`encode`; GrammarError (a
        ValueError naming the argument) for an invalid or unsupported schema, regex or grammar."""
        if not isinstance(text, (str, list, tuple)) or (not isinstance(text, str) and not text):
            raise ValueError(f"text={text!r} is not allowed: a non-empty string or a non-empty list of strings")
        constraint = self.constraint(json_schema=json_schema, regex=regex, grammar=grammar)
        spec = self.speculation(speculative, spec_tokens, spec_ngram_max, spec_ngram_min, use_cache)
        texts = [text] if isinstance(text, str) else list(text)
        ids = [self.encode(t, unknown) for t in texts]
        if self.cfg.paradigm == "diffusion" or diffusion_options:
            if constraint is not None:
                raise ValueError("json_schema, regex and grammar need an autoregressive model; this one has "
                                 f"paradigm={self.cfg.paradigm!r}")
            tokens = generate(self.model, ids, max_new_tokens, use_cache=use_cache, temperature=temperature,
                              top_k=top_k, top_p=top_p, seed=seed, **diffusion_options)
            out = [self.tokenizer.decode(row.tolist()) for row in tokens]
            return out[0] if isinstance(text, str) else out
        out = [c.text for c in self._complete(ids, max_new_tokens, use_cache, temperature, top_k, top_p, seed,
                                              ignore_eos, constraint, spec)]
        return out[0] if isinstance(text, str) else out

    def complete(self, text: str, max_new_tokens: int = 200, *, use_cache: bool = True, temperature: float = 0.8,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, unknown: str = "error",
                 ignore_eos: bool = False, json_schema=None, regex: str | None = None,
                 grammar: str | None = None, speculative: str | None = None, spec_tokens: int = 4,
                 spec_ngram_max: int = 4, spec_ngram_min: int = 1) -> "Completion":
        """:meth:`generate` of one text by an autoregressive model, with how it ended: a :class:`Completion`
        (text, tokens generated with the stop token counted, finish_reason "stop" or "length"; a constrained
        text whose grammar is complete ends with "stop", one cut by max_new_tokens with "length"; spec: the
        SpecStats of a speculative call)."""
        if self.cfg.paradigm != "ar":
            raise ValueError(f"complete() needs an autoregressive model; this one has paradigm="
                             f"{self.cfg.paradigm!r}: use generate()")
        constraint = self.constraint(json_schema=json_schema, regex=regex, grammar=grammar)
        spec = self.speculation(speculative, spec_tokens, spec_ngram_max, spec_ngram_min, use_cache)
        return self._complete([self.encode(text, unknown)], max_new_tokens, use_cache, temperature, top_k, top_p,
                              seed, ignore_eos, constraint, spec)[0]

    def constraint(self, json_schema=None, regex: str | None = None, grammar: str | None = None,
                   choice: list | None = None) -> Constraint | None:
        """The compiled constraint of at most one of the arguments for this run's tokenizer and stop ids (None
        when none is given); see ``dantinox.generation.grammar``. Raises GrammarError naming the argument."""
        if json_schema is None and regex is None and grammar is None and choice is None:
            return None
        vocabulary = grammar_vocabulary(self.tokenizer, self.stop_ids)
        return constraint_from(vocabulary, json_schema=json_schema, regex=regex, grammar=grammar, choice=choice)

    def _eos(self, ignore_eos: bool):
        return None if ignore_eos or not self.stop_ids else list(self.stop_ids)

    def _complete(self, ids, max_new_tokens, use_cache, temperature, top_k, top_p, seed, ignore_eos,
                  constraint: Constraint | None = None, spec: SpecSettings | None = None):
        stats = None
        if spec is not None and constraint is not None:
            if spec.proposer == "draft":
                raise ValueError("speculative='draft' is not allowed with json_schema, regex or grammar: "
                                 "constrained speculation takes n-gram proposals (speculative='ngram')")
            result, stats = constrained_speculative_result(self.model, ids, [constraint] * len(ids), max_new_tokens,
                                                           settings=spec, temperature=temperature, top_k=top_k,
                                                           top_p=top_p, seed=seed, eos_id=self._eos(ignore_eos))
            self.spec_stats = stats
        elif spec is not None:
            result, stats = speculative_generate(self.model, ids, max_new_tokens, spec_tokens=spec.spec_tokens,
                                                 ngram_max=spec.ngram_max, ngram_min=spec.ngram_min,
                                                 min_accept=spec.min_accept, temperature=temperature, top_k=top_k,
                                                 top_p=top_p, seed=seed, eos_id=self._eos(ignore_eos),
                                                 draft=self._draft_for(spec))
            self.spec_stats = stats
        elif constraint is None and self.keep_session and len(ids) == 1 and use_cache:
            result, self._session, self.session_reused = session_generate(
                self.model, self._session, ids[0], max_new_tokens, temperature, top_k, top_p, seed,
                self._eos(ignore_eos))
        elif constraint is None:
            result = generate_result(self.model, ids, max_new_tokens, use_cache=use_cache, temperature=temperature,
                                     top_k=top_k, top_p=top_p, seed=seed, eos_id=self._eos(ignore_eos))
        elif not use_cache:
            raise ValueError("use_cache=False is not allowed with json_schema, regex or grammar: constrained "
                             "decoding runs through the cache")
        else:
            result = constrained_result(self.model, ids, [constraint] * len(ids), max_new_tokens,
                                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                        eos_id=self._eos(ignore_eos))
        out = []
        for row, n, reason in zip(result.tokens, result.lengths, result.finish_reasons):
            shown = int(n) - (reason == "stop" and int(row[int(n) - 1]) in set(self._eos(ignore_eos) or ()))
            out.append(Completion(self.tokenizer.decode(row[:shown].tolist()), int(n), reason, stats))
        return out

    def stream(self, text: str, max_new_tokens: int = 200, *, temperature: float = 0.8, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, chunk_size: int = 8, unknown: str = "error",
               ignore_eos: bool = False, speculative: str | None = None, spec_tokens: int = 4,
               spec_ngram_max: int = 4, spec_ngram_min: int = 1) -> Iterator[str]:
        """Yield the new text piece by piece as it is generated (chunk_size decode steps per device call),
        ending before the first stop id (ignore_eos=True: no stop ids). Pieces never split a character; their
        concatenation equals :meth:`generate`'s text for the same seed (with speculative="ngram": for greedy
        decoding; sampled streams draw from the same distribution). Autoregressive models only (raises
        ValueError for a diffusion model)."""
        for piece, _, _ in self.stream_completion(text, max_new_tokens, temperature=temperature, top_k=top_k,
                                                  top_p=top_p, seed=seed, chunk_size=chunk_size, unknown=unknown,
                                                  ignore_eos=ignore_eos, speculative=speculative,
                                                  spec_tokens=spec_tokens, spec_ngram_max=spec_ngram_max,
                                                  spec_ngram_min=spec_ngram_min):
            if piece:
                yield piece

    def stream_completion(self, text: str, max_new_tokens: int = 200, *, temperature: float = 0.8,
                          top_k: int = 0, top_p: float = 1.0, seed: int = 0, chunk_size: int = 8,
                          unknown: str = "error", ignore_eos: bool = False, speculative: str | None = None,
                          spec_tokens: int = 4, spec_ngram_max: int = 4,
                          spec_ngram_min: int = 1) -> Iterator[tuple[str, int, str | None]]:
        """:meth:`stream` with the count so far: yields (piece, tokens generated so far, None) and last
        ("", tokens generated, finish_reason "stop" or "length"); pieces may be empty. A speculative stream
        updates ``spec_stats`` with every chunk."""
        if self.cfg.paradigm != "ar":
            raise ValueError("streaming needs an autoregressive model; this one has paradigm="
                             f"{self.cfg.paradigm!r}: use generate()")
        spec = self.speculation(speculative, spec_tokens, spec_ngram_max, spec_ngram_min)
        yield from self._stream_ids(self.encode(text, unknown), max_new_tokens, chunk_size, temperature, top_k,
                                    top_p, seed, ignore_eos, spec)

    def stream_chat(self, messages, max_new_tokens: int = 256, *, system: str | None = None,
                    temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                    chunk_size: int = 8, unknown: str = "error", ignore_eos: bool = False,
                    speculative: str | None = None, spec_tokens: int = 4, spec_ngram_max: int = 4,
                    spec_ngram_min: int = 1) -> Iterator[tuple[str, int, str | None]]:
        """:meth:`chat`'s answer as a stream, yielded as :meth:`stream_completion` yields: (piece, tokens
        generated so far, None), then ("", tokens generated, finish_reason "stop" or "length"). The pieces
        joined equal :meth:`chat`'s answer for the same arguments (with speculative="ngram": for greedy
        decoding). max_new_tokens is cut to what is left of max_context, as in :meth:`chat`. Raises as
        :meth:`chat` (constraints are not streamed: use :meth:`chat` for json_schema, regex, grammar)."""
        ids, max_new_tokens = self._chat_request(messages, system, unknown, max_new_tokens)
        spec = self.speculation(speculative, spec_tokens, spec_ngram_max, spec_ngram_min, True)
        yield from self._stream_ids(ids, max_new_tokens, chunk_size, temperature, top_k, top_p, seed, ignore_eos,
                                    spec)

    def _stream_ids(self, ids, max_new_tokens, chunk_size, temperature, top_k, top_p, seed, ignore_eos, spec):
        """The (piece, count, finish reason) stream of one prompt's ids (see :meth:`stream_completion`)."""
        decoder, stops, count = StreamDecoder(self.tokenizer), set(self._eos(ignore_eos) or ()), 0
        for chunk in self._chunks(ids, max_new_tokens, chunk_size, temperature, top_k, top_p, seed, ignore_eos,
                                  spec):
            piece = ""
            for token in np.asarray(chunk)[0].tolist():
                count += 1
                if token in stops:
                    yield piece + decoder.flush(), count, None
                    yield "", count, "stop"
                    return
                piece += decoder.push(token)
            yield piece, count, None
        yield decoder.flush(), count, None
        yield "", count, "length"

    def _chunks(self, ids, max_new_tokens, chunk_size, temperature, top_k, top_p, seed, ignore_eos, spec):
        """The token chunks ([1, n] int32) of one stream: ``stream_tokens``, or ``speculative_stream`` (which
        keeps its latest SpecStats in ``spec_stats``) when spec is given."""
        sampling = dict(chunk_size=chunk_size, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        eos_id=self._eos(ignore_eos))
        if spec is None:
            yield from stream_tokens(self.model, ids, max_new_tokens, **sampling)
            return
        for chunk, stats in speculative_stream(self.model, ids, max_new_tokens, settings=spec,
                                               draft=self._draft_for(spec), **sampling):
            self.spec_stats = stats
            yield chunk

    def chat(self, messages, max_new_tokens: int = 256, *, system: str | None = None, temperature: float = 0.8,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, unknown: str = "error",
             ignore_eos: bool = False, json_schema=None, regex: str | None = None,
             grammar: str | None = None, speculative: str | None = None, spec_tokens: int = 4,
             spec_ngram_max: int = 4, spec_ngram_min: int = 1) -> str:
        """The assistant's answer to a conversation, rendered with the model's chat template.

        messages: a list of {"role": "system" | "user" | "assistant" | "tool", "content": str}, or one string
          (a single user message). system: an optional system message put first. Text in a content that looks
          like a special token ("<|im_end|>") stays text (``dantinox.runs.chat``, case K12).
        Generation stops at any of the model's stop ids (``stop_ids``; ignore_eos=True: none) or after
        max_new_tokens (cut to what is left of max_context); the answer excludes the stop token.
        Raises NoChatTemplateError (the run has no template), ChatTemplateError naming ``messages[i].role`` /
        ``.content``, CapacityError when the rendered conversation leaves no room in max_context for an answer,
        ValueError as :meth:`generate` (also for a diffusion model). json_schema, regex, grammar: as
        :meth:`generate` (the answer is constrained). speculative, spec_tokens, spec_ngram_max, spec_ngram_min:
        as :meth:`generate`.
        """
        ids, max_new_tokens = self._chat_request(messages, system, unknown, max_new_tokens)
        constraint = self.constraint(json_schema=json_schema, regex=regex, grammar=grammar)
        spec = self.speculation(speculative, spec_tokens, spec_ngram_max, spec_ngram_min, True)
        return self._complete([ids], max_new_tokens, True, temperature, top_k, top_p, seed, ignore_eos,
                              constraint, spec)[0].text

    # Sessions ---------------------------------------------------------------------------------------------------
    @property
    def session_tokens(self) -> tuple:
        """The token ids the kept session's cache holds (() without one)."""
        return tuple(self._session.tokens) if self._session is not None else ()

    def model_digest(self) -> str:
        """What names this Generator's weights in a session file: the run's weights sha256 (model_summary.json,
        else the file hashed) and the quantize mode."""
        from ..runs.weights_checksum import KEY, file_sha256

        digest = self.summary.get(KEY) if isinstance(self.summary, dict) else None
        if not isinstance(digest, str):
            digest = file_sha256(os.path.join(self.run_dir, "model.safetensors"))
        return f"{digest}|quantize={self.quantize}"

    def save_session(self, path: str | os.PathLike) -> int:
        """Write the kept session (its tokens and the static cache cut to them, ``dantinox.kv.sessions``) to
        ``path``, atomically. Returns the bytes written. Raises ValueError when there is no session (the
        Generator was made without keep_session=True, or no one-prompt call ran yet), OSError from the file
        system."""
        if self._session is None:
            raise ValueError("no session to save: create the Generator with keep_session=True (or load a session) "
                             "and run a one-prompt generate, complete or chat first")
        return save_static_session(os.fspath(path), self.cfg, self.model_digest(), self._session.tokens,
                                   self._session.cache)

    def load_session(self, path: str | os.PathLike) -> int:
        """Make the session in ``path`` the kept one (sessions on from now): the next one-prompt call whose
        prompt starts with its tokens computes only the rest. Returns its token count. Raises SessionError (a
        ValueError) naming the file: damaged, a server's session, saved by another model or with another cache
        layout (the first difference named); OSError from the file system."""
        tokens, cache = load_static_session(os.fspath(path), self.cfg, self.model_digest())
        self._session, self.keep_session = Session(tokens, cache), True
        return len(tokens)

    def _chat_request(self, messages, system, unknown, max_new_tokens):
        """(prompt ids, max_new_tokens cut to what is left of max_context) of a chat turn; raises as :meth:`chat`
        (no template, a diffusion model, a conversation that fills the context). An invalid max_new_tokens is
        passed on unchanged for the generation's own check to name."""
        require_chat_format(self.chat_format, self.run_dir)
        if self.cfg.paradigm != "ar":
            raise ValueError(f"chat needs an autoregressive model; this one has paradigm={self.cfg.paradigm!r}")
        ids = self.chat_prompt_ids(messages, system, unknown)
        if isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool) and max_new_tokens >= 1:
            max_new_tokens = max(1, min(max_new_tokens, self.cfg.max_context - len(ids)))
        return ids, max_new_tokens

    def chat_prompt_ids(self, messages, system: str | None = None, unknown: str = "error") -> list[int]:
        """The prompt ids :meth:`chat` generates from. Raises as :meth:`chat` (CapacityError: the conversation
        has max_context tokens or more after the chat template)."""
        chat = require_chat_format(self.chat_format, self.run_dir)
        ids = chat.prompt_ids(chat_messages(messages, system), self.tokenizer, unknown)
        if len(ids) >= self.cfg.max_context:
            raise CapacityError(f"the conversation has {len(ids)} tokens after the chat template, more than "
                                f"max_context={self.cfg.max_context} leaves room for (at most "
                                f"{self.cfg.max_context - 1} prompt tokens and 1 new token); shorten the messages")
        return ids


class Completion(NamedTuple):
    """One generated text: text (without the stop token), tokens (generated, the stop token counted),
    finish_reason ("stop": a stop id ended it; "length": max_new_tokens did), spec (the request batch's
    SpecStats when it was decoded speculatively, else None)."""

    text: str
    tokens: int
    finish_reason: str
    spec: SpecStats | None = None


def chat_messages(messages, system: str | None = None) -> list:
    """``messages`` as a list (one string becomes one user message), with ``system`` first when given."""
    if isinstance(messages, str):
        listed = [{"role": "user", "content": messages}]
    elif isinstance(messages, (list, tuple)):
        listed = list(messages)
    else:
        raise ChatTemplateError(f"messages={messages!r} is not allowed: a string or a list of messages")
    return ([{"role": "system", "content": system}] if system is not None else []) + listed
