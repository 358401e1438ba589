"""Seeded text workloads for benchmarking two servers that tokenize for themselves (benchmarks/serve_vs_llamacpp.py).

Both servers are sent text, never token ids, so each tokenizes with its own tokenizer. The prompt lengths are
made to land on their targets for one reference tokenizer (a Hugging Face ``tokenizer.json``, e.g. the run
directory's): a passage of the corpus starting at a random line is cut where the reference tokenizer's
``target``-th token ends (``PromptCutter``). Every prompt starts with its own 8 random hex digits and a newline,
so that no two prompts of a run share more than a token or two of prefix and neither server's prompt cache
(llama-server's per-slot prefix reuse, dantinox's 16-token block hashes) can serve one prompt from another.

Workloads:
  single  one prompt of about ``length`` tokens, sent ``repeats`` times one after another (each repeat a
          distinct prompt), ``max_tokens`` new tokens each: the time to first token of a prompt alone.
  trace   ``n`` requests arriving as a Poisson process of ``rate`` requests/s (exponential gaps, the first at
          t = 0): each prompt length drawn from a band chosen by weight (``Band``), uniform inside it, and
          ``max_tokens`` drawn uniformly from ``new_tokens``.
Each workload draws from its own generator, seeded by (seed, workload name): changing one workload's flags
leaves the others' prompts unchanged, and the same seed gives the same requests to both servers.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

import numpy as np

PREFIX_HEX_DIGITS = 8


@dataclass(frozen=True)
class Band:
    """A band of prompt lengths: ``weight`` (> 0, relative) and the inclusive token range [lo, hi]."""

    weight: float
    lo: int
    hi: int


@dataclass(frozen=True)
class TextRequest:
    """One request: ``name`` unique in the run, ``arrival_s`` seconds after its workload starts (0 for single
    prompts), the prompt ``text``, its length ``prompt_tokens`` by the reference tokenizer, and ``max_tokens``."""

    name: str
    arrival_s: float
    text: str
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    """``kind`` "single" (requests sent one after another) or "trace" (open loop, at their arrival times)."""

    name: str
    kind: str
    requests: tuple


DEFAULT_BANDS = "0.7:64-256,0.2:512-1024,0.1:2048-4096"
_BAND = re.compile(r"^\s*([0-9.]+)\s*:\s*(\d+)\s*-\s*(\d+)\s*$")


def parse_bands(spec: str, flag: str = "--bands") -> tuple:
    """``"W:LO-HI,W:LO-HI,..."`` -> a tuple of Band. Raises ValueError naming ``flag``, the value and the form
    allowed when a part does not parse, a weight is not positive, or LO < 1 or HI < LO."""
    bands = []
    for part in spec.split(","):
        match = _BAND.match(part)
        if not match:
            raise ValueError(f"{flag} {spec!r}: part {part!r} is not WEIGHT:LO-HI (e.g. {DEFAULT_BANDS})")
        weight, lo, hi = float(match[1]), int(match[2]), int(match[3])
        if weight <= 0 or lo < 1 or hi < lo:
            raise ValueError(f"{flag} {spec!r}: part {part!r} needs WEIGHT > 0 and 1 <= LO <= HI")
        bands.append(Band(weight, lo, hi))
    return tuple(bands)


def workload_rng(seed: int, name: str) -> np.random.Generator:
    """The generator of one workload: seeded by (seed, crc32 of its name)."""
    return np.random.default_rng([seed, zlib.crc32(name.encode("utf-8"))])


class PromptCutter:
    """Cuts corpus passages to a number of tokens of a reference tokenizer.

    tokenizer: a ``tokenizers.Tokenizer`` (encoded without special tokens, as dantinox serve encodes a
    completion prompt); corpus: the text passages are taken from (non-empty; read cyclically, so a passage
    may run past its end into its start again).
    """

    def __init__(self, tokenizer, corpus: str):
        if not corpus.strip():
            raise ValueError("the corpus is empty: give a text file with --corpus")
        self.tokenizer, self.corpus = tokenizer, corpus
        self.line_starts = np.array([0] + [m.end() for m in re.finditer("\n", corpus) if m.end() < len(corpus)])

    def count(self, text: str) -> int:
        """Tokens of ``text`` by the reference tokenizer."""
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def passage(self, start: int, chars: int) -> str:
        """``chars`` characters of the corpus from ``start``, wrapping around its end."""
        repeats = 1 + (start + chars) // len(self.corpus)
        return (self.corpus * (repeats + 1))[start:start + chars]

    def prompt(self, rng: np.random.Generator, target: int) -> tuple[str, int]:
        """A prompt of ``target`` tokens (> PREFIX_HEX_DIGITS): random hex digits, a newline, then a passage from
        a random line start, cut after the reference tokenizer's ``target``-th token. Returns (text, tokens);
        tokens may fall a token or two short of ``target`` where a cut re-tokenizes differently."""
        prefix = f"{int(rng.integers(16 ** PREFIX_HEX_DIGITS)):0{PREFIX_HEX_DIGITS}x}\n"
        start, chars = int(rng.choice(self.line_starts)), 8 * target + 64
        while True:
            text = prefix + self.passage(start, chars)
            encoding = self.tokenizer.encode(text, add_special_tokens=False)
            if len(encoding.ids) >= target:
                break
            chars *= 2
        for _ in range(8):
            text = text[:encoding.offsets[target - 1][1]]
            encoding = self.tokenizer.encode(text, add_special_tokens=False)
            if len(encoding.ids) <= target:
                break
        return text, len(encoding.ids)


def single_workload(cutter: PromptCutter, length: int, repeats: int, max_tokens: int, seed: int) -> Workload:
    """``repeats`` distinct prompts of ``length`` tokens, ``max_tokens`` each, named "single-<length>"."""
    name = f"single-{length}"
    rng = workload_rng(seed, name)
    requests = []
    for i in range(repeats):
        text, tokens = cutter.prompt(rng, length)
        requests.append(TextRequest(f"{name}/{i}", 0.0, text, tokens, max_tokens))
    return Workload(name, "single", tuple(requests))


def trace_workload(cutter: PromptCutter, n: int, rate: float, bands: tuple, new_tokens: tuple,
                   seed: int) -> Workload:
    """``n`` requests with Poisson arrivals at ``rate`` per second (see the module docstring), named
    "trace-<rate>". Raises ValueError when n < 1, rate <= 0 or new_tokens is empty."""
    if n < 1 or rate <= 0 or not new_tokens:
        raise ValueError(f"a trace needs n >= 1, rate > 0 and new token counts; got n={n}, rate={rate}, "
                         f"new_tokens={new_tokens}")
    name = f"trace-{rate:g}"
    rng = workload_rng(seed, name)
    gaps = rng.exponential(1.0 / rate, n)
    arrivals = np.cumsum(gaps) - gaps[0]
    weights = np.array([b.weight for b in bands], float)
    picks = rng.choice(len(bands), size=n, p=weights / weights.sum())
    lengths = [int(rng.integers(bands[k].lo, bands[k].hi + 1)) for k in picks]
    news = rng.choice(np.asarray(new_tokens, int), size=n)
    requests = []
    for i, (arrival, length, new) in enumerate(zip(arrivals, lengths, news)):
        text, tokens = cutter.prompt(rng, length)
        requests.append(TextRequest(f"{name}/{i}", float(arrival), text, tokens, int(new)))
    return Workload(name, "trace", tuple(requests))
