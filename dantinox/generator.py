"""Generator: text in, text out, from a run directory (or the bundled Divina Commedia model).

    gen = Generator("runs/my_run")          # loads config, weights and tokenizer; one warm-up generation
    gen.generate("Nel mezzo del cammin", max_new_tokens=200)
    for piece in gen.stream("Nel mezzo", max_new_tokens=200):
        print(piece, end="", flush=True)

Prompts are encoded with the run's tokenizer; characters outside a char vocabulary raise ValueError by default
(``unknown="replace"`` maps them to ``<unk>`` instead). Streaming decodes with an incremental detokenizer, so
a piece never ends inside a multi-byte character.
"""

from __future__ import annotations

import os
import time
from importlib import resources
from typing import Iterator

import numpy as np

from .compile_count import CompileCounter
from .generate import generate_result, stream_tokens
from .kv_dtype import with_kv_dtype
from .train.run_dir import load_run
from .train.tokenizer import StreamDecoder
from .weight_quant import check_quantize, quantize_weights

BUNDLED_RUN = "dante"


def bundled_run_dir(name: str = BUNDLED_RUN) -> str:
    """Path of a run directory shipped inside the package (default: the Divina Commedia GQA model)."""
    return os.fspath(resources.files("dantinox") / "bundled" / name)


class Generator:
    """A loaded model with its tokenizer, ready to generate text.

    Args:
      run_dir: a run directory from ``dantinox train``; None loads the bundled model.
      warmup: run one 1-token generation at load time so the first real call is not slowed by compilation
        (compiles prefill for the smallest prompt bucket and the decode loop for batch 1).
      kv_dtype: KV cache dtype ("float32", "bfloat16", "int8" or an alias); None keeps the run's cache_dtype.
      quantize: None (float32 weights), "bf16" or "int8" (weight-only, per output channel); see
        ``dantinox.weight_quant``.
    Attributes: model, cfg, tokenizer, summary (model_summary.json), load_seconds, warmup (CompileCounter).
    Raises: RunDirError for a missing or inconsistent run directory; KVDtypeError for a kv_dtype outside the
    allowed set or one the model cannot hold (int8 for a diffusion model); ValueError for another quantize value.
    """

    def __init__(self, run_dir: str | os.PathLike | None = None, warmup: bool = True, kv_dtype: str | None = None,
                 quantize: str | None = None):
        start = time.perf_counter()
        check_quantize(quantize)
        self.run_dir = os.fspath(run_dir) if run_dir is not None else bundled_run_dir()
        self.model, self.cfg, self.tokenizer, self.summary = load_run(self.run_dir)
        self.model = with_kv_dtype(self.model, kv_dtype, "kv_dtype")
        self.cfg = self.model.cfg
        self.quantize = quantize
        quantize_weights(self.model, quantize)
        self.warmup = CompileCounter()
        if warmup and self.cfg.paradigm == "ar":  # diffusion compiles per (bucket, gen_len, block_size)
            with self.warmup:
                generate_result(self.model, [0], 1)
        self.load_seconds = time.perf_counter() - start

    def encode(self, text: str, unknown: str = "error") -> list[int]:
        """Token ids of a prompt. Raises ValueError for an empty prompt or unknown characters (see module doc)."""
        if not isinstance(text, str) or text == "":
            raise ValueError("prompt is empty: give at least one character")
        return self.tokenizer.encode(text, unknown=unknown)

    def generate(self, text: str | list[str], max_new_tokens: int = 200, *, use_cache: bool = True,
                 temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 unknown: str = "error", **diffusion_options) -> str | list[str]:
        """Continue ``text`` (or each text of a list, batched) by up to max_new_tokens tokens; returns the new
        text only. Sampling arguments as in :func:`dantinox.generate` (temperature 0 = greedy); a diffusion
        model generates exactly max_new_tokens (gen_len) tokens and takes diffusion_options (block_size,
        steps_per_block, threshold, refresh; see dantinox.diffusion.diffusion_generate).
        Raises ValueError / CapacityError as :func:`dantinox.generate` and :meth:`encode`."""
        if not isinstance(text, (str, list, tuple)) or (not isinstance(text, str) and not text):
            raise ValueError(f"text={text!r} is not allowed: a non-empty string or a non-empty list of strings")
        texts = [text] if isinstance(text, str) else list(text)
        ids = [self.encode(t, unknown) for t in texts]
        if self.cfg.paradigm == "diffusion" or diffusion_options:
            from .generate import generate

            tokens = generate(self.model, ids, max_new_tokens, use_cache=use_cache, temperature=temperature,
                              top_k=top_k, top_p=top_p, seed=seed, **diffusion_options)
            out = [self.tokenizer.decode(row.tolist()) for row in tokens]
            return out[0] if isinstance(text, str) else out
        result = generate_result(self.model, ids, max_new_tokens, use_cache=use_cache, temperature=temperature,
                                 top_k=top_k, top_p=top_p, seed=seed)
        out = [self.tokenizer.decode(row[:n].tolist()) for row, n in zip(result.tokens, result.lengths)]
        return out[0] if isinstance(text, str) else out

    def stream(self, text: str, max_new_tokens: int = 200, *, temperature: float = 0.8, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, chunk_size: int = 8, unknown: str = "error") -> Iterator[str]:
        """Yield the new text piece by piece as it is generated (chunk_size decode steps per device call).
        Pieces never split a character; their concatenation equals :meth:`generate`'s text for the same seed.
        Autoregressive models only (raises ValueError for a diffusion model)."""
        if self.cfg.paradigm != "ar":
            raise ValueError("streaming needs an autoregressive model; this one has paradigm="
                             f"{self.cfg.paradigm!r}: use generate()")
        decoder = StreamDecoder(self.tokenizer)
        chunks = stream_tokens(self.model, self.encode(text, unknown), max_new_tokens, chunk_size=chunk_size,
                               temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        for chunk in chunks:
            piece = "".join(decoder.push(int(t)) for t in np.asarray(chunk)[0])
            if piece:
                yield piece
        tail = decoder.flush()
        if tail:
            yield tail
