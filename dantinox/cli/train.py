"""``dantinox train``: the command line of the trainer. Options map onto ``dantinox.train.TrainConfig`` fields,
a --config YAML (ModelConfig fields, optionally under ``model:``, and train fields under ``train:``) and
--set overrides; the run itself is ``dantinox.train.train``."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any

from ..config import ConfigError, ModelConfig, config_field_names, switch_attention
from ..runs.input_files import read_yaml
from ..runs.tokenizer import KINDS
from ..train.trainer import RESUME_HINT, TrainConfig, TrainError, check_out_dir, train

CLI_RESUME_HINT = "; pass --no_resume to start over, or write to another --out directory"


_CLI_TRAIN_OPTIONS = {  # option -> (type, help)
    "tokenizer": (str, "tokenizer kind: char or bpe"),
    "bpe_vocab_size": (int, "BPE vocabulary size (>= 256)"),
    "steps": (int, "optimizer steps"),
    "batch_size": (int, "windows per step (B)"),
    "seq_len": (int, "tokens per window (<= max_context; default max_context)"),
    "lr": (float, "peak learning rate"),
    "min_lr": (float, "final learning rate of the cosine decay"),
    "warmup_steps": (int, "linear warmup steps (default min(100, steps // 10))"),
    "weight_decay": (float, "AdamW weight decay on matrices"),
    "grad_clip": (float, "global gradient-norm clip (0: off)"),
    "eval_every": (int, "steps between validation runs"),
    "eval_batches": (int, "validation batches per run"),
    "checkpoint_every": (int, "steps between checkpoints (0: only at the end)"),
    "mesh": (str, "train on a data=D,model=M device mesh (docs/how-to/multi-device.md)"),
    "seed": (int, "seed for model init and batch sampling"),
    "val_fraction": (float, "held-out fraction of the text's characters"),
    "init_from": (str, "run directory whose weights (matching paths and shapes; <mask> row added) and "
                       "tokenizer start the run, e.g. an AR run adapted to diffusion"),
}


def add_train_arguments(parser) -> None:
    """Add the `dantinox train` options to an argparse parser (defaults come from TrainConfig / YAML)."""
    parser.add_argument("--data", required=True, metavar="FILE", help="UTF-8 training text")
    parser.add_argument("--out", required=True, metavar="DIR", help="run directory to write")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", metavar="NAME", help="model preset (default: dante)")
    source.add_argument("--config", metavar="YAML", help="YAML with ModelConfig fields and a train: section")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override one ModelConfig field (repeatable)")
    for name, (kind, help_text) in _CLI_TRAIN_OPTIONS.items():
        extra = {"choices": list(KINDS)} if name == "tokenizer" else {}
        parser.add_argument(f"--{name}", type=kind, default=None, help=help_text, **extra)
    parser.add_argument("--no_resume", action="store_true", help="start over even if a checkpoint exists")
    parser.add_argument("--no_progress", action="store_true",
                        help="no progress bar (on a terminal) and no progress lines (elsewhere)")
    parser.add_argument("--progress_every", type=float, default=None, metavar="SECONDS",
                        help="when stderr is not a terminal: seconds between two progress lines (step, loss, lr, "
                             "tok/s, ETA; default 30, 0: every step)")
    parser.add_argument("--fsdp", action="store_true", help="with --mesh: also split parameters and optimizer "
                        "state over the data axis")


def run_train_from_args(args) -> int:
    """Run training from parsed `dantinox train` arguments; returns the exit status 0.

    The summary is in ``<out>/model_summary.json`` (see dantinox.runs.run_dir.read_summary).

    Precedence: TrainConfig defaults < the YAML train: section < command-line options; the model config is
    the preset (or YAML) with --set overrides applied. Raises ConfigError / TrainError naming the field.
    """
    check_out_dir(args.out, "--out")  # before the config and the data are read
    cfg, options = resolve_cli_config(args.preset, args.config, args.set)
    for name in _CLI_TRAIN_OPTIONS:
        if getattr(args, name, None) is not None:
            options[name] = getattr(args, name)
    if args.no_resume:
        options["resume"] = False
    if args.fsdp:
        options["fsdp"] = True
    every = {} if args.progress_every is None else {"progress_every_s": args.progress_every}
    try:
        train(cfg, args.data, args.out, progress=not args.no_progress, **every, **options)
    except TrainError as err:  # the Python remedy, in the flags a command-line user types
        raise TrainError(str(err).replace(RESUME_HINT, CLI_RESUME_HINT)) from None
    return 0


def resolve_cli_config(preset: str | None, config_path: str | None,
                       overrides: list[str] = ()) -> tuple[ModelConfig, dict]:
    """(ModelConfig, trainer options) from a preset name or a YAML file, plus "field=value" overrides.

    The YAML file may hold ModelConfig fields, an optional ``preset:`` to start from, and a ``train:``
    mapping of TrainConfig fields. Without either source the "dante" preset is used.
    Raises ConfigError naming the file, the field or the override that is not allowed.
    """
    fields, options = {}, {}
    if config_path is not None:
        fields, options = load_yaml_config(config_path)
        preset = fields.pop("preset", None)
    base = ModelConfig.from_preset(preset or "dante").to_dict()
    base.update(switch_attention(base, fields))
    changes = parse_overrides(overrides)
    base.update(switch_attention(base, changes))
    try:
        return ModelConfig.from_dict(base), options
    except ConfigError as err:   # a refused override is named as typed: "--set dim=-3: ModelConfig.dim=-3 ..."
        field = re.match(r"ModelConfig\.(\w+)=", str(err))
        typed = [o for o in overrides or () if field and o.split("=", 1)[0].strip() == field.group(1)]
        if typed:
            raise ConfigError(f"--set {typed[-1]}: {err}") from None
        raise


def load_yaml_config(path: str) -> tuple[dict, dict]:
    """(model fields, trainer options) from a YAML file. Raises ConfigError naming --config, the file and the key
    (a missing file: InputFileNotFound; ``dantinox.runs.input_files``)."""
    data = read_yaml(path, "--config", ConfigError) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of ModelConfig fields")
    options = data.pop("train", None) or {}
    allowed = [f.name for f in dataclasses.fields(TrainConfig)]
    if not isinstance(options, dict) or set(options) - set(allowed):
        bad = sorted(set(options) - set(allowed)) if isinstance(options, dict) else options
        raise ConfigError(f"config file {path!r}: train section has {bad!r}; allowed options: {allowed}")
    unknown = sorted(set(data) - set(config_field_names()) - {"preset"})
    if unknown:
        raise ConfigError(f"config file {path!r}: unknown ModelConfig field(s) {unknown}; allowed: "
                          f"{config_field_names()} (plus preset and train)")
    return data, options


def parse_overrides(pairs) -> dict:
    """{field: value} from "field=value" strings, converted by the ModelConfig field's declared type.

    "none"/"null" give None for optional fields; booleans accept true/false/yes/no/1/0/on/off.
    Raises ConfigError naming the field, the value and the expected type.
    """
    hints = typing.get_type_hints(ModelConfig)
    out = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        name = name.strip()
        if not sep:
            raise ConfigError(f"--set {pair!r} is not allowed: write FIELD=VALUE")
        if name not in hints:
            raise ConfigError(f"--set {name}: unknown ModelConfig field; allowed: {config_field_names()}")
        out[name] = _convert(name, raw.strip(), hints[name])
    return out


def _convert(name: str, raw: str, hint) -> Any:
    kinds = typing.get_args(hint) or (hint,)
    if type(None) in kinds and raw.lower() in ("none", "null"):
        return None
    for kind in kinds:
        if kind is bool:
            table = {"true": True, "yes": True, "1": True, "on": True,
                     "false": False, "no": False, "0": False, "off": False}
            if raw.lower() in table:
                return table[raw.lower()]
        elif kind in (int, float, str):
            try:
                return kind(raw)
            except ValueError:
                pass
    names = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
    raise ConfigError(f"--set {name}={raw!r}: ModelConfig.{name} expects {names}")
