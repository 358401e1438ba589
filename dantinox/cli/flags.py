"""Library errors spelled in the caller's language: ``name=value`` in a message becomes ``--flag value``.

The library raises ValueError naming its Python arguments (``max_new_tokens=1000 is not allowed: ...``), which
is right for a Python caller. A command-line user typed flags, so ``dantinox.cli.entrypoint.main`` passes every error
message of a subcommand through ``in_flags`` with that subcommand's parser: each ``name=`` whose name is the
destination of one of its options (and not part of a longer name or a dotted ``ModelConfig.name``) is
rewritten to the option as typed, e.g. ``--max_new_tokens 1000`` or ``--reserve-fraction 1.5``. Text the user
typed as a flag's value is quoted back as typed (``--mesh data=2,model=4`` keeps its ``data=`` although
``train`` has a ``--data`` flag; so does ``--set seed=3``), and a mesh error's axis names (``data=2 x model=4``)
are axes, not flags. The HTTP server does the same job by naming the JSON field in every 400
(``dantinox.serving.request.RequestError``).
"""

from __future__ import annotations

import argparse
import re

from ..parallel.distributed import DEFAULT_TIMEOUT_S, initialize


def option_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """{destination: the option as typed} for the options of ``parser`` that take a value,
    e.g. {"max_new_tokens": "--max_new_tokens", "reserve_fraction": "--reserve-fraction"}."""
    out = {}
    for action in parser._actions:  # argparse keeps no public list of a parser's options
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs and action.nargs != 0:
            out[action.dest] = longs[0]
    return out


def in_flags(message: str, flags: dict[str, str], typed=()) -> str:
    """``message`` with each ``name=value`` for a name in ``flags`` rewritten as ``--flag value`` (a quoted
    value without spaces loses its quotes: ``unknown='replace'`` -> ``--unknown replace``), and a message
    that begins with such a name (``prompt is empty``) beginning with the flag instead.

    typed: the values the user gave on the command line (strings); where one of them appears in the message
    it is left exactly as typed."""
    if not flags:
        return message
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w.\-])({names})=('[^'\s]*'|\"[^\"\s]*\"|)")
    kept = [(m.start(), m.end()) for value in typed if isinstance(value, str) and "=" in value
            for m in re.finditer(re.escape(value), message)]

    def rewrite(match: re.Match) -> str:
        if any(start <= match.start() < end for start, end in kept):
            return match.group(0)
        value = match.group(2)
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        return f"{flags[match.group(1)]} {value}" if value else f"{flags[match.group(1)]} "

    message = pattern.sub(rewrite, message)
    first = message.split(" ", 1)[0]
    return flags[first] + message[len(first):] if first in flags else message


def subcommand_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser | None:
    """The parser of subcommand ``command`` of ``parser`` (None if there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(command)
    return None


def add_quantize_argument(parser) -> None:
    """Add ``--quantize`` to an argparse parser (checked by check_quantize, so a bad value exits 2 with one
    line naming the flag)."""
    parser.add_argument("--quantize", default=None, metavar="bf16|int8|int4|q8_0",
                        help="low-precision weights: bf16, int8 per output channel, int4 (Q4_1 blocks of 32) or "
                             "q8_0 (Q8_0 blocks of 32); default float32")


def add_mesh_argument(parser) -> None:
    """Add ``--mesh data=D,model=M`` to an argparse parser (read it with :func:`mesh_from_flag`)."""
    parser.add_argument("--mesh", default=None, metavar="data=D,model=M",
                        help="run on a D x M device mesh: batch over data, heads and MLP width over model "
                             "(D * M at most the device count: the first D * M devices are used; on a CPU host "
                             "XLA_FLAGS=--xla_force_host_platform_device_count=8 gives 8; docs/how-to/multi-device.md)")


def add_distributed_arguments(parser) -> None:
    """--coordinator HOST:PORT --num-processes N --process-id I --coordinator-timeout S."""
    g = parser.add_argument_group("several processes (docs/how-to/multi-device.md)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="address of process 0")
    g.add_argument("--num-processes", dest="num_processes", type=int, default=None)
    g.add_argument("--process-id", dest="process_id", type=int, default=None)
    g.add_argument("--coordinator-timeout", dest="coordinator_timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds to wait for the coordinator (default 60)")


def initialize_from_args(args) -> bool:
    """:func:`initialize` from parsed :func:`add_distributed_arguments` flags (absent flags: no group)."""
    return initialize(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                      getattr(args, "process_id", None), getattr(args, "coordinator_timeout", DEFAULT_TIMEOUT_S))


def _add_kv_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-dtype", default=None, help="KV cache dtype: float32, bfloat16 or int8 (symmetric absmax "
                   "per token and head, float32 scales; default: the run's cache_dtype)")


def _add_kv_keys(p: argparse.ArgumentParser) -> None:
    """--kv-keys token|channel and --kv-key-group G (read with ``dantinox.kv.channel_keys.with_kv_keys``)."""
    p.add_argument("--kv-keys", default=None, metavar="token|channel",
                   help="int8 cache keys: channel (one scale per channel over groups of --kv-key-group tokens, "
                        "KIVI; MHA / GQA / MQA, MLA stays per token) or token (one scale per token and KV head, "
                        "with float32 sinks); default: the run's, channel unless set")
    p.add_argument("--kv-key-group", type=int, default=None, metavar="G",
                   help="tokens per key-scale group with per-channel keys (default: the run's, 64; at most "
                        "max_context)")


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    """Add --speculative, --spec-tokens, --spec-ngram-max and --spec-ngram-min (read them with
    :func:`speculative_from_args`). The destinations are the library's argument names (spec_tokens, ngram_max,
    ngram_min), so its bound errors come out naming the flags (``in_flags``)."""
    g = p.add_argument_group("speculative decoding (autoregressive models)")
    g.add_argument("--speculative", default=None, metavar="ngram|draft:RUN",
                   help="ngram: propose the tokens that followed the latest earlier match of the last n tokens "
                        "(prompt lookup); draft:RUN: the proposals of RUN's model (a run with the same "
                        "tokenizer); verified in one forward, greedy output is unchanged")
    g.add_argument("--spec-tokens", dest="spec_tokens", type=int, default=None,
                   help="tokens proposed per verify call, 1..16 (default 4)")
    g.add_argument("--spec-ngram-max", dest="ngram_max", type=int, default=None,
                   help="longest n-gram looked up (default 4)")
    g.add_argument("--spec-ngram-min", dest="ngram_min", type=int, default=None,
                   help="shortest n-gram looked up (default 1)")


SPEC_FLAGS = {"spec_tokens": "--spec-tokens", "ngram_max": "--spec-ngram-max", "ngram_min": "--spec-ngram-min"}


def speculative_from_args(args):
    """The checked SpecSettings of the speculative flags, or None without --speculative. ValueError naming the
    flag: --spec-* without --speculative, or a value out of bounds (``spec_settings``)."""
    from ..generation.speculative_generate import DEFAULT_SETTINGS, spec_settings

    given = {name: getattr(args, name, None) for name in SPEC_FLAGS}
    proposer = speculative_proposer(getattr(args, "speculative", None))
    if proposer is None:
        flags = [SPEC_FLAGS[name] for name, v in given.items() if v is not None]
        if flags:
            raise ValueError(f"{flags[0]} needs --speculative ngram or draft:RUN")
        return None
    return spec_settings(proposer, *(getattr(DEFAULT_SETTINGS, name) if v is None else v
                                     for name, v in given.items()))


def speculative_proposer(value) -> str | None:
    """The proposer of a --speculative value ("ngram", "draft" for draft:RUN; None without the flag).
    ValueError naming the flag for anything else, or draft: without a run."""
    if value is None or value == "ngram":
        return value
    if isinstance(value, str) and value.startswith("draft:") and value[len("draft:"):]:
        return "draft"
    raise ValueError(f"--speculative {value} is not allowed: ngram or draft:RUN (a run directory or bundled name)")


def draft_run_of(args) -> str | None:
    """The RUN of --speculative draft:RUN, else None."""
    value = getattr(args, "speculative", None)
    return value[len("draft:"):] if speculative_proposer(value) == "draft" else None


def spec_kwargs(spec) -> dict:
    """The Generator keyword arguments of SpecSettings ``spec`` ({} for None)."""
    if spec is None:
        return {}
    return dict(speculative=spec.proposer, spec_tokens=spec.spec_tokens, spec_ngram_max=spec.ngram_max,
                spec_ngram_min=spec.ngram_min)


def describe_spec_stats(settings, stats) -> str:
    """The report line of a speculative generation, e.g. "speculative ngram (k=4, n-gram 4..1): 120 of 200
    proposed tokens accepted (60.0%), 3.40 tokens per verify call, 50 verify calls and 10 plain steps", with the
    switch-off threshold when settings carry one and the token the switch-off rule handed the request to the
    compiled decode loop at, if it did."""
    off = f" (switch-off below {settings.min_accept:.2f} accepted per verify call)" if settings.min_accept else ""
    how = (f"n-gram {settings.ngram_max}..{settings.ngram_min}" if settings.proposer == "ngram"
           else "draft model")
    return (f"speculative {settings.proposer} (k={settings.spec_tokens}, {how}): {sum(stats.accepted)} of "
            f"{sum(stats.proposed)} proposed tokens accepted "
            f"({100 * stats.acceptance_rate:.1f}%), {stats.mean_accepted_length:.2f} tokens per verify call, "
            f"{stats.verify_calls} verify calls and {stats.iterations - stats.verify_calls} plain steps{off}"
            + (f"; decode loop from token {stats.handed_off}" if stats.handed_off is not None else ""))
