"""Training loop: text file -> tokenizer -> next-token cross-entropy with AdamW -> run directory.

Walkthrough of :func:`train`:
  1. Read the text, hold out its last ``val_fraction`` of characters, train the tokenizer on the training
     part (or take it from the checkpoint when resuming) and set ``cfg.vocab_size`` from it.
     With ``init_from`` the tokenizer is that run's instead (token ids must match its weights).
  2. Build the model (with ``init_from``, overwrite its parameters with that run's: see
     ``dantinox.train.init_from``), split it into a static graph and a pytree of float32 parameters, and
     build the optimizer: global-norm clipping, then AdamW (Loshchilov & Hutter 2019) with linear warmup and cosine
     decay to ``min_lr``; weight decay applies to matrices only (not norm scales).
  3. Restore ``out_dir/checkpoint/`` if it exists and ``resume`` is set: parameters, optimizer state, step,
     numpy RNG state. The run then follows exactly the trajectory of an uninterrupted run.
  4. Each step draws a random [B, seq_len + 1] batch and runs one jitted update. Every ``eval_every`` steps
     and at the end, the mean validation loss is computed and a row is appended to training_log.csv.
  5. Checkpoints are written every ``checkpoint_every`` steps and at the end; the run directory is written
     at the end (see ``dantinox.runs.run_dir``).
  6. Ctrl-C during the steps (``dantinox.runs.interrupts``): the step in progress finishes, a checkpoint of it
     is written through the same atomic writer, and ``Interrupted`` is raised saying at which step it was
     saved; the same call again resumes from there, on the same trajectory.

Losses are natural-log cross-entropy per token (nats/token); ``val_nats_per_char`` rescales the validation
loss by tokens per character of the held-out text (equal to the loss for a char tokenizer).

Masked diffusion (``cfg.paradigm == "diffusion"``; LLaDA, Nie et al. 2025, "Large Language Diffusion Models",
section 2.1, eq. 3): ``<mask>`` is appended to the tokenizer as its last id and becomes
``cfg.mask_token_id``. Each training window x0 (its first seq_len tokens) draws a ratio t ~ U(eps, 1)
(eps = MASK_EPS) and masks every token independently with probability t; the loss is
``sum(CE(x0_i | x_t) * masked_i / t) / (B * T)``, the 1/t-weighted cross-entropy on masked positions
normalised per token (train_loss reports it). The uniforms are drawn on the host from the run's seeded
numpy generator, so resuming follows the same trajectory. The validation loss of a diffusion run is the
*masked-token nats*: the mean cross-entropy (nats) per masked token over the held-out windows, each
window masked the same way with a fixed seed (VAL_MASK_SEED) so that every evaluation sees the same masks;
it is not comparable with an AR model's next-token nats, and val_nats_per_char is that figure times the
tokens per character.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ..config import ModelConfig
from ..model.transformer import build_model
from ..parallel.mesh import mesh_from_flag, mesh_scope, naming_flag, parse_mesh
from ..parallel.sharding import shard_model
from ..runs import run_dir as rd
from ..runs.interrupts import Interrupted, deferred_interrupts
from ..runs.tokenizer import KINDS, MASK, TextTokenizer, train_tokenizer, with_mask_token
from . import checkpoint as ckpt
from .progress import DEFAULT_EVERY_S, StepProgress, flushed_print
from .data import TokenData, file_sha256, read_text, sample_batch, split_text, val_batches
from .init_from import init_from_run, load_source_tokenizer
from .sharded import check_batch, constrain_state, place_batch, place_like, place_state


class TrainError(ValueError):
    """A training option is not allowed, or a checkpoint cannot be resumed with the requested options."""


@dataclass(frozen=True)
class TrainConfig:
    """Trainer options (units in brackets). Validated on construction; raises TrainError naming the field.

    tokenizer: "char" or "bpe".  bpe_vocab_size: BPE vocabulary upper bound (>= 256).
    steps: optimizer steps in all.  batch_size: B windows per step.
    seq_len: T tokens per window (<= cfg.max_context; None: cfg.max_context).
    lr / min_lr: peak and final learning rate.  warmup_steps: linear warmup (None: min(100, steps // 10)).
    weight_decay: AdamW decay on matrices.  grad_clip: global-norm clip (0: off).
    eval_every: steps between validation runs.  eval_batches: validation batches per run (each B windows).
    checkpoint_every: steps between checkpoints (0: only at the end).  seed: model init and batch sampling.
    val_fraction: held-out fraction of the characters.  resume: continue from out_dir/checkpoint if present.
    init_from: a run directory whose weights and tokenizer start a fresh run (see dantinox.train.init_from);
    ignored when resuming from a checkpoint.
    mesh: "data=D,model=M" to train on D x M devices (batch_size must divide by D); fsdp: also split the
    parameters and optimizer state over data (see dantinox.train.sharded). Neither changes the trajectory, so
    a checkpoint resumes on any mesh.
    schedule_steps: steps of the warmup + cosine schedule (None: steps); after them the learning rate stays
    at min_lr. Resuming with a larger steps (extending a run) keeps the checkpoint's schedule_steps.
    """

    tokenizer: str = "char"
    bpe_vocab_size: int = 1024
    steps: int = 1000
    batch_size: int = 32
    seq_len: int | None = None
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int | None = None
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 20
    checkpoint_every: int = 500
    seed: int = 0
    val_fraction: float = 0.1
    resume: bool = True
    init_from: str | None = None
    mesh: str | None = None
    fsdp: bool = False
    schedule_steps: int | None = None

    def __post_init__(self) -> None:
        if self.tokenizer not in KINDS:
            _bad("tokenizer", self.tokenizer, f"one of {KINDS}")
        for name in ("bpe_vocab_size", "steps", "batch_size", "eval_every", "eval_batches"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("checkpoint_every", "seed"):
            _check_int(name, getattr(self, name), minimum=0)
        for name in ("seq_len", "warmup_steps", "schedule_steps"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1 if name == "seq_len" else 0)
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                _bad(name, value, "a number >= 0")
        if self.min_lr > self.lr:
            _bad("min_lr", self.min_lr, f"at most lr={self.lr}")
        for name in ("resume", "fsdp"):
            if not isinstance(getattr(self, name), bool):
                _bad(name, getattr(self, name), "True or False")
        if self.mesh is not None:
            parse_mesh(self.mesh, "mesh")
        if self.init_from is not None:
            if not isinstance(self.init_from, (str, os.PathLike)) or not os.fspath(self.init_from):
                _bad("init_from", self.init_from, "None or a run directory path")
            object.__setattr__(self, "init_from", os.fspath(self.init_from))

    def resolved(self, cfg: ModelConfig) -> "TrainConfig":
        """Fill seq_len, warmup_steps and schedule_steps defaults; raise TrainError if they do not fit cfg /
        steps."""
        seq_len = cfg.max_context if self.seq_len is None else self.seq_len
        if seq_len > cfg.max_context:
            _bad("seq_len", seq_len, f"at most the model's max_context={cfg.max_context}")
        schedule = self.steps if self.schedule_steps is None else self.schedule_steps
        warmup = min(100, schedule // 10) if self.warmup_steps is None else self.warmup_steps
        if warmup >= schedule:
            _bad("warmup_steps", warmup, f"fewer than steps={schedule}")
        return dataclasses.replace(self, seq_len=seq_len, warmup_steps=warmup, schedule_steps=schedule)


# Options that shape the training trajectory: a checkpoint only resumes under the same values.
# (steps is not one: a run may be extended; its schedule_steps stays, see continue_options.)
TRAJECTORY_FIELDS = ("tokenizer", "bpe_vocab_size", "schedule_steps", "batch_size", "seq_len", "lr", "min_lr",
                     "warmup_steps", "weight_decay", "grad_clip", "seed", "val_fraction")


def _bad(name: str, value: Any, allowed: str) -> None:
    raise TrainError(f"training option {name}={value!r} is not allowed: {allowed}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _bad(name, value, f"an integer >= {minimum}")


# Optimizer and compiled steps ---------------------------------------------------------------------------

def decay_mask(params):
    """True for parameters that get weight decay: matrices (ndim >= 2), not vectors such as norm scales."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def learning_rate_schedule(opts: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to opts.lr over warmup_steps, cosine decay to min_lr at opts.schedule_steps, then
    min_lr (the steps an extended run adds; optax holds the end value after decay_steps)."""
    return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=opts.lr,
                                              warmup_steps=opts.warmup_steps, decay_steps=opts.schedule_steps,
                                              end_value=opts.min_lr)


def make_optimizer(opts: TrainConfig) -> optax.GradientTransformation:
    """clip_by_global_norm(grad_clip) (skipped when 0), then AdamW(b1=0.9, b2=0.95) on the schedule."""
    adamw = optax.adamw(learning_rate_schedule(opts), b1=0.9, b2=0.95, weight_decay=opts.weight_decay,
                        mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(opts.grad_clip), adamw) if opts.grad_clip > 0 else adamw


def token_nll(graphdef, params, rest, windows: jax.Array) -> jax.Array:
    """Per-token next-token cross-entropy [B, T] float32 (nats) for windows [B, T + 1] int32."""
    model = nnx.merge(graphdef, params, rest)
    logits, _, _ = model(windows[:, :-1], use_cache=False)
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:])


MASK_EPS = 1e-3  # smallest masking ratio t of the diffusion objective
VAL_MASK_SEED = 20250214  # fixed masks for every diffusion validation run


def masked_nll(graphdef, params, rest, windows: jax.Array, noise: jax.Array):
    """Masked-diffusion loss terms (LLaDA section 2.1) for the first T tokens x0 of windows [B, T + 1].

    noise: [B, T + 1] float32 uniforms in [0, 1): column 0 sets t = eps + (1 - eps) u per row, columns 1..T
    mask token i when u_i < t. Returns (cross-entropy [B, T] float32 nats, masked [B, T] bool, t [B, 1]).
    With cfg.shifted_prediction token i is scored on the output at position i - 1, and token 0 is never masked.
    """
    model = nnx.merge(graphdef, params, rest)
    x0 = windows[:, :-1]
    t = MASK_EPS + (1.0 - MASK_EPS) * noise[:, :1]
    masked = noise[:, 1:] < t
    if model.cfg.shifted_prediction:
        masked = masked & (jnp.arange(x0.shape[1]) > 0)
    logits, _, _ = model(jnp.where(masked, model.cfg.mask_token_id, x0), use_cache=False)
    if model.cfg.shifted_prediction:  # position i - 1 predicts token i; token 0 (never masked) gets a dummy row
        logits = jnp.concatenate([logits[:, :1], logits[:, :-1]], axis=1)
    return optax.softmax_cross_entropy_with_integer_labels(logits, x0), masked, t


def training_loss(graphdef, params, rest, windows: jax.Array, noise: jax.Array | None) -> jax.Array:
    """Mean loss [] float32: next-token nats (noise None) or the 1/t-weighted masked-diffusion loss."""
    if noise is None:
        return token_nll(graphdef, params, rest, windows).mean()
    nll, masked, t = masked_nll(graphdef, params, rest, windows, noise)
    return (nll * masked / t).sum() / nll.size


# Options baked into the compiled update (the learning-rate schedule and the optimizer).
OPTIMIZER_FIELDS = ("schedule_steps", "lr", "min_lr", "warmup_steps", "weight_decay", "grad_clip")


def make_step_functions(graphdef, opts: TrainConfig):
    """(train_step, eval_step), both jitted; opts must be resolved (see TrainConfig.resolved).

    train_step(params, opt_state, rest, windows [B, T+1] int32, noise) -> (params, opt_state, mean loss []
      float32); params and opt_state are donated; noise: None (AR) or [B, T+1] float32 uniforms (diffusion,
      see masked_nll).
    eval_step(params, rest, windows [B, T+1] int32, weights [B, T] float32, noise) -> (summed nats [], weight
      sum []); for diffusion the sums run over masked tokens only.
    Cached per (model graph, optimizer options), so repeated train() calls in one process compile once.
    """
    return (_train_step(graphdef, tuple(getattr(opts, f) for f in OPTIMIZER_FIELDS), opts.fsdp),
            _eval_step(graphdef))


@functools.lru_cache(maxsize=8)
def _train_step(graphdef, optimizer_key: tuple, fsdp: bool = False):
    tx = make_optimizer(TrainConfig(**dict(zip(OPTIMIZER_FIELDS, optimizer_key))))

    def train_step(params, opt_state, rest, windows, noise=None):
        """One AdamW update on the mean training loss of windows [B, T+1] (see training_loss)."""
        loss, grads = jax.value_and_grad(lambda p: training_loss(graphdef, p, rest, windows, noise))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = constrain_state(optax.apply_updates(params, updates), fsdp)  # on a mesh: same layout
        return params, constrain_state(opt_state, fsdp), loss

    return jax.jit(train_step, donate_argnums=(0, 1))


@functools.lru_cache(maxsize=8)
def _eval_step(graphdef):
    def eval_step(params, rest, windows, weights, noise=None):
        """Weighted sum of per-token losses and the sum of weights (diffusion: masked tokens only)."""
        if noise is None:
            nll = token_nll(graphdef, params, rest, windows)
        else:
            nll, masked, _ = masked_nll(graphdef, params, rest, windows, noise)
            weights = weights * masked
        return (nll * weights).sum(), weights.sum()

    return jax.jit(eval_step)


# The training session ------------------------------------------------------------------------------------

@dataclass
class _Session:
    """Everything one call of train() works with (host side)."""

    cfg: ModelConfig
    opts: TrainConfig
    out_dir: str
    data_path: str
    data_sha256: str
    tokenizer: TextTokenizer
    data: TokenData
    graphdef: Any
    rest: Any
    params: Any
    opt_state: Any
    rng: np.random.Generator
    step: int = 0
    elapsed_s: float = 0.0  # seconds spent in training steps and evaluations, over all sessions
    step_time_s: float = 0.0  # seconds spent in training steps only (compilation included), all sessions
    last_val: float = float("nan")  # latest validation loss (nats/token)
    train_loss: float = float("nan")  # latest training-batch loss (nats/token)
    saved_step: int = -1  # step of the latest checkpoint written or restored
    eval_step: Any = None  # the jitted eval function, built on first use
    init_val: float | None = None  # validation loss of the init_from weights before any step
    mesh: Any = None  # the jax.sharding.Mesh of opts.mesh, or None (one device)

    @property
    def ckpt_dir(self) -> str:
        """out_dir/checkpoint."""
        return os.path.join(self.out_dir, "checkpoint")

    @property
    def tokens_seen(self) -> int:
        """Training tokens consumed so far: step * B * T."""
        return self.step * self.opts.batch_size * self.opts.seq_len


def train(cfg: ModelConfig, data_path: str | os.PathLike, out_dir: str | os.PathLike, *,
          log: Callable[[str], None] = print, progress: bool = True, stop_at: int | None = None,
          progress_every_s: float = DEFAULT_EVERY_S, **options: Any) -> dict:
    """Train a model on a UTF-8 text file and write a run directory to ``out_dir``.

    cfg: model shape; its vocab_size is replaced by the tokenizer's.
    options: TrainConfig fields (tokenizer, bpe_vocab_size, steps, batch_size, seq_len, lr, min_lr,
      warmup_steps, weight_decay, grad_clip, eval_every, eval_batches, checkpoint_every, seed,
      val_fraction, resume).
    init_from (option): a run directory whose tokenizer (plus ``<mask>`` for diffusion) and weights start a
      fresh run (dantinox.train.init_from: AR -> diffusion adaptation); its validation loss before the first
      step is logged and kept as init_val_loss in the summary.
    log: receives one line per evaluation and a start / end line (``print``: flushed at once).
    progress: show a tqdm bar when stderr is a terminal, else log a plain progress line (step, loss, lr, tok/s,
      ETA) every progress_every_s seconds (``dantinox.train.progress``); False: neither.
    stop_at: stop after this step (writing a checkpoint and the run directory) even if steps is larger;
      a later call with the same options resumes from there. Stopping before the end of the learning-rate
      schedule (stop_at, or a resumed run's steps below its schedule_steps) is said in the log at the start
      and in the last line, with the learning rate reached (``schedule_note``).
    Returns the model_summary.json dict: val_loss and train_loss (nats/token), val_nats_per_char, steps,
    tokens_seen, training_time_s (steps + evaluations, all sessions), tokens_per_s (training tokens per
    second of step time, compilation included), parameters, kv_bytes_per_token, data_file, data_sha256.
    Raises TrainError (bad option, out_dir is a file, checkpoint made with other options / data),
    FileNotFoundError / DataError
    (data file), ConfigError (model config), CheckpointError (unreadable checkpoint).
    """
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(TrainConfig)})
    if unknown:
        raise TrainError(f"unknown training option(s) {unknown}; allowed: "
                         f"{[f.name for f in dataclasses.fields(TrainConfig)]}")
    if options.get("init_from") is not None:
        options = _tokenizer_options_from(options)
    opts = TrainConfig(**options)
    opts.resolved(cfg)  # bad options fail before the data is read (resuming may fill defaults differently)
    check_out_dir(out_dir, "out_dir")
    if stop_at is not None:
        _check_int("stop_at", stop_at, minimum=1)
    if isinstance(progress_every_s, bool) or not isinstance(progress_every_s, (int, float)) \
            or not progress_every_s >= 0:
        _bad("progress_every_s", progress_every_s, "a number of seconds >= 0")
    log = flushed_print if log is print else log
    session = _start_session(cfg, os.fspath(data_path), os.fspath(out_dir), opts, log)
    until = min(session.opts.steps, stop_at or session.opts.steps)
    note = schedule_note(session.opts, until)
    if note:
        log(f"note: {note}")
    _run_steps(session, until, log, progress, progress_every_s)
    return _finish(session, log)


def schedule_note(opts: TrainConfig, until: int) -> str:
    """"" when step ``until`` ends the learning-rate schedule (opts resolved), else what stopping there means:
    the schedule's length, the learning rate at ``until`` against its peak and final values, and the step that
    finishes it. The schedule is the run's (resuming keeps the checkpoint's schedule_steps: a --steps below
    it ends the call early, it does not shorten the schedule)."""
    if until >= opts.schedule_steps:
        return ""
    lr = float(learning_rate_schedule(opts)(until))
    return (f"this call stops at step {until}, but the learning-rate schedule of the run spans "
            f"{opts.schedule_steps} steps: the learning rate there is {lr:.3g} (peak {opts.lr:.3g}, min_lr "
            f"{opts.min_lr:.3g} at step {opts.schedule_steps}); run it to step {opts.schedule_steps} to finish the "
            "schedule")


def check_out_dir(out_dir: str | os.PathLike, name: str = "out_dir") -> None:
    """Raise TrainError naming ``name`` when ``out_dir`` exists but is not a directory (a run directory is
    written there: a new one, or one to resume)."""
    path = os.fspath(out_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise TrainError(f"{name} {path} is a file, not a directory: give the path of a run directory (a new one, "
                         "or one to resume)")


def _tokenizer_options_from(options: dict) -> dict:
    """options with tokenizer / bpe_vocab_size taken from the init_from run's tokenizer; TrainError if the
    caller asked for another kind or size (the new model must keep the source's token ids)."""
    source = load_source_tokenizer(options["init_from"])
    base_size = source.hf.get_vocab_size(with_added_tokens=False)
    wanted = {"tokenizer": source.kind, **({"bpe_vocab_size": base_size} if source.kind == "bpe" else {})}
    for name, value in wanted.items():
        if options.get(name, value) != value:
            raise TrainError(f"training option {name}={options[name]!r} conflicts with init_from="
                             f"{options['init_from']!r}, whose tokenizer is {source.kind} with {base_size} "
                             f"tokens; the new model reuses that tokenizer (omit {name})")
    return {**options, **wanted}


def _start_session(cfg: ModelConfig, data_path: str, out_dir: str, opts: TrainConfig, log) -> _Session:
    text = read_text(data_path)
    train_text, val_text = split_text(text, opts.val_fraction)
    ckpt_dir = os.path.join(out_dir, "checkpoint")
    meta = ckpt.read_checkpoint_meta(ckpt_dir) if opts.resume else None
    opts = (continue_options(opts, meta, ckpt_dir) if meta is not None else opts).resolved(cfg)
    if meta is not None:
        tokenizer = TextTokenizer.from_json(meta["tokenizer"])
    elif opts.init_from is not None:
        tokenizer = load_source_tokenizer(opts.init_from)
    else:
        tokenizer = train_tokenizer(train_text, opts.tokenizer,
                                    opts.bpe_vocab_size if opts.tokenizer == "bpe" else None)
    if cfg.paradigm == "diffusion":
        tokenizer = with_mask_token(tokenizer)
        cfg = cfg.replace(vocab_size=tokenizer.vocab_size, mask_token_id=tokenizer.hf.token_to_id(MASK))
    else:
        cfg = cfg.replace(vocab_size=tokenizer.vocab_size)
    sha = file_sha256(data_path)
    if meta is not None:
        _check_resumable(meta, cfg, opts, sha, ckpt_dir)
    data = TokenData.from_text(tokenizer, train_text, val_text, opts.seq_len)
    model = build_model(cfg, seed=opts.seed)
    if meta is None and opts.init_from is not None:
        grown = init_from_run(model, tokenizer, opts.init_from)
        log(f"initialised from {opts.init_from}" + (f" (grown along the vocabulary: {grown})" if grown else ""))
    mesh = mesh_from_flag(opts.mesh, "mesh")
    with naming_flag(opts.mesh, "mesh"):
        check_batch(opts.batch_size, mesh)
        shard_model(model, mesh, opts.fsdp)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    s = _Session(cfg, opts, out_dir, data_path, sha, tokenizer, data, graphdef, rest, params,
                 place_state(make_optimizer(opts).init(params), mesh, opts.fsdp), np.random.default_rng(opts.seed),
                 mesh=mesh)
    os.makedirs(out_dir, exist_ok=True)
    if meta is not None:
        _restore(s, ckpt_dir)
        rd.truncate_log(out_dir, s.step)
        log(f"resumed from {ckpt_dir} at step {s.step}")
    else:
        _clear_previous(out_dir)
    log(f"model: {rd.count_params(model):,} parameters, vocab {cfg.vocab_size} ({tokenizer.kind}); "
        f"data: {data.train.size:,} training / {data.val.size:,} validation tokens")
    return s


RESUME_HINT = "; pass resume=False to start over, or use another out_dir"


def continue_options(opts: TrainConfig, meta: dict, ckpt_dir: str) -> TrainConfig:
    """The options of a resumed run: steps may differ from the checkpoint's (a finished run is extended by
    a larger steps), while the learning-rate schedule stays the checkpoint's: schedule_steps, and
    warmup_steps and seq_len when not given, come from it, so the extension trains at min_lr.
    Raises TrainError when steps is below the checkpoint's step."""
    saved = meta.get("train_options", {})
    at = int(meta.get("step", 0))
    if opts.steps < at:
        raise TrainError(f"training option steps={opts.steps} is not allowed: the checkpoint {ckpt_dir} is at "
                         f"step {at}; give steps={at} or more to continue it (more steps extend the run at "
                         f"min_lr){RESUME_HINT}")
    fill = {name: saved.get(name) for name in ("warmup_steps", "seq_len") if getattr(opts, name) is None}
    if opts.schedule_steps is None:
        fill["schedule_steps"] = saved.get("schedule_steps") or saved.get("steps")
    return dataclasses.replace(opts, **{k: v for k, v in fill.items() if v is not None})


def _check_resumable(meta: dict, cfg: ModelConfig, opts: TrainConfig, sha: str, ckpt_dir: str) -> None:
    hint = RESUME_HINT
    saved_cfg = meta.get("model_config", {})
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.default is not dataclasses.MISSING}
    for name, value in cfg.to_dict().items():
        saved = saved_cfg.get(name, defaults.get(name))   # a field added since the checkpoint: its default
        if saved != value:
            raise TrainError(f"checkpoint {ckpt_dir} was made with ModelConfig.{name}={saved!r}, not {value!r} "
                             f"(the model shape comes from the preset or config file and any overrides: give "
                             f"the ones the run was started with){hint}")
    saved_opts = meta.get("train_options", {})
    saved_opts = {**saved_opts, "schedule_steps": saved_opts.get("schedule_steps") or saved_opts.get("steps")}
    for name in TRAJECTORY_FIELDS:
        if saved_opts.get(name) != getattr(opts, name):
            raise TrainError(f"checkpoint {ckpt_dir} was made with {name}={saved_opts.get(name)!r}, not "
                             f"{getattr(opts, name)!r}{hint}")
    if meta.get("data_sha256") != sha:
        raise TrainError(f"checkpoint {ckpt_dir} was made from different data (sha256 "
                         f"{meta.get('data_sha256')}, now {sha}){hint}")


def _clear_previous(out_dir: str) -> None:
    """A fresh run: drop an old checkpoint and training log so they cannot mix with this run."""
    shutil.rmtree(os.path.join(out_dir, "checkpoint"), ignore_errors=True)
    log_path = os.path.join(out_dir, rd.LOG_FILE)
    if os.path.exists(log_path):
        os.remove(log_path)


def _restore(s: _Session, ckpt_dir: str) -> None:
    state, meta = ckpt.load_checkpoint(ckpt_dir, {"params": s.params, "opt_state": s.opt_state})
    s.params, s.opt_state = place_like(state["params"], s.params), place_like(state["opt_state"], s.opt_state)
    s.rng.bit_generator.state = meta["rng_state"]
    s.step, s.elapsed_s = int(meta["step"]), float(meta["elapsed_s"])
    s.step_time_s = float(meta["step_time_s"])
    s.last_val = float("nan") if meta.get("val_loss") is None else float(meta["val_loss"])
    s.train_loss = float("nan") if meta.get("train_loss") is None else float(meta["train_loss"])
    s.init_val = meta.get("init_val_loss")
    s.saved_step = s.step


def _save_checkpoint(s: _Session) -> None:
    meta = {"step": s.step, "rng_state": s.rng.bit_generator.state, "elapsed_s": s.elapsed_s,
            "step_time_s": s.step_time_s, "tokens_seen": s.tokens_seen,
            "val_loss": s.last_val if math.isfinite(s.last_val) else None,
            "train_loss": s.train_loss if math.isfinite(s.train_loss) else None, "model_config": s.cfg.to_dict(),
            "train_options": dataclasses.asdict(s.opts), "data_sha256": s.data_sha256,
            "init_val_loss": s.init_val,
            "tokenizer": s.tokenizer.to_json()}
    ckpt.save_checkpoint(s.ckpt_dir, {"params": s.params, "opt_state": s.opt_state}, meta)
    s.saved_step = s.step


def _run_steps(s: _Session, until: int, log, progress: bool, progress_every_s: float) -> None:
    train_step, eval_step = make_step_functions(s.graphdef, s.opts)
    s.eval_step = eval_step
    schedule = learning_rate_schedule(s.opts)
    bar = StepProgress(s.opts.steps, s.step, until, log, progress, progress_every_s)
    emit = bar.emit
    window_tokens, window_time, loss = 0, 0.0, float("nan")
    if s.step == 0 and s.opts.init_from is not None:
        t0 = time.perf_counter()
        s.init_val = evaluate(s)
        s.elapsed_s += time.perf_counter() - t0
        emit(f"step 0: val {s.init_val:.4f} with the weights of {s.opts.init_from}")
    tokens_per_step = s.opts.batch_size * s.opts.seq_len
    with deferred_interrupts() as interrupt:  # Ctrl-C: finish the step, checkpoint it, stop (step 6)
        while s.step < until and not interrupt.requested:
            batch = sample_batch(s.data.train, s.rng, s.opts.batch_size, s.opts.seq_len)
            noise = _mask_noise(s.cfg, s.rng, batch.shape)
            t0 = time.perf_counter()
            with mesh_scope(s.mesh):
                s.params, s.opt_state, loss_arr = train_step(s.params, s.opt_state, s.rest,
                                                             place_batch(batch, s.mesh), noise)
            loss = float(loss_arr)
            dt = time.perf_counter() - t0
            s.step += 1
            s.elapsed_s += dt
            s.step_time_s += dt
            window_tokens, window_time = window_tokens + tokens_per_step, window_time + dt
            tok_s = window_tokens / max(window_time, 1e-9)
            if not math.isfinite(loss):
                bar.close()
                raise TrainError(f"training loss became {loss} at step {s.step}; lower lr (now {s.opts.lr})")
            if s.step % s.opts.eval_every == 0 or s.step == s.opts.steps:
                s.elapsed_s += _evaluate_and_log(s, loss, float(schedule(s.step)), tok_s, emit)
                window_tokens, window_time = 0, 0.0
            if s.opts.checkpoint_every and s.step % s.opts.checkpoint_every == 0:
                _save_checkpoint(s)
            bar.update(s.step, loss, float(schedule(s.step)), tok_s, s.last_val)
            s.train_loss = loss
        bar.close()
        if interrupt.requested:
            _stop_interrupted(s)


def _stop_interrupted(s: _Session) -> None:
    """After a Ctrl-C between two steps: checkpoint the last whole step (unless it is saved already) and raise
    Interrupted saying where; nothing is saved before the first step."""
    if s.step == 0:
        raise Interrupted("before the first training step: nothing was saved")
    if s.saved_step != s.step:
        _save_checkpoint(s)
    raise Interrupted(f"checkpoint saved at step {s.step} in {s.ckpt_dir}; the same command resumes from there")


def _mask_noise(cfg: ModelConfig, rng: np.random.Generator, shape) -> jax.Array | None:
    """Uniforms [B, T+1] float32 for the diffusion masks (see masked_nll); None for AR (rng untouched)."""
    if cfg.paradigm != "diffusion":
        return None
    return jnp.asarray(rng.random(shape, dtype=np.float32))


def evaluate(s: _Session) -> float:
    """Mean validation loss over up to opts.eval_batches deterministic batches: nats/token (AR) or nats per
    masked token (diffusion, fixed masks drawn from VAL_MASK_SEED)."""
    total, count = 0.0, 0.0
    mask_rng = np.random.default_rng(VAL_MASK_SEED)
    for windows, weights in val_batches(s.data.val, s.opts.batch_size, s.opts.seq_len, s.opts.eval_batches):
        noise = _mask_noise(s.cfg, mask_rng, windows.shape)
        with mesh_scope(s.mesh):
            nats, n = s.eval_step(s.params, s.rest, jnp.asarray(windows), jnp.asarray(weights), noise)
        total, count = total + float(nats), count + float(n)
    return total / count


def _evaluate_and_log(s: _Session, train_loss: float, lr: float, tok_s: float, emit) -> float:
    """Evaluate, append a training_log.csv row, emit a line; returns the seconds spent."""
    t0 = time.perf_counter()
    s.last_val = evaluate(s)
    spent = time.perf_counter() - t0
    row = {"step": s.step, "lr": f"{lr:.6g}", "train_loss": f"{train_loss:.6f}",
           "val_loss": f"{s.last_val:.6f}",
           "tokens_per_s": f"{tok_s:.1f}", "elapsed_s": f"{s.elapsed_s + spent:.3f}"}
    rd.append_log_row(s.out_dir, row)
    unit = "nats/masked token" if s.cfg.paradigm == "diffusion" else "nats/token"
    emit(f"step {s.step}/{s.opts.steps}  train {train_loss:.4f}  val {s.last_val:.4f} {unit} "
         f"({s.last_val * s.data.tokens_per_char:.4f} nats/char)  lr {lr:.3g}  {tok_s:,.0f} tok/s")
    return spent


def _finish(s: _Session, log) -> dict:
    if s.eval_step is None:
        s.eval_step = make_step_functions(s.graphdef, s.opts)[1]
    if not math.isfinite(s.last_val) or s.step % s.opts.eval_every:
        s.last_val = evaluate(s)
    if s.saved_step != s.step:
        _save_checkpoint(s)
    model = nnx.merge(s.graphdef, s.params, s.rest)
    summary = {"val_loss": s.last_val, "val_nats_per_char": s.last_val * s.data.tokens_per_char,
               "train_loss": s.train_loss if math.isfinite(s.train_loss) else None, "steps": s.step,
               "tokens_seen": s.tokens_seen, "training_time_s": round(s.elapsed_s, 3),
               "tokens_per_s": round(s.tokens_seen / max(s.step_time_s, 1e-9), 1),
               "data_file": os.path.basename(s.data_path), "data_sha256": s.data_sha256,
               "seq_len": s.opts.seq_len, "batch_size": s.opts.batch_size, "schedule_steps": s.opts.schedule_steps,
               **({"init_from": s.opts.init_from, "init_val_loss": s.init_val} if s.opts.init_from else {}),
               "val_loss_unit": "nats per masked token" if s.cfg.paradigm == "diffusion" else "nats per token"}
    rd.save_run(s.out_dir, model, s.cfg, s.tokenizer, summary)
    unit = "nats/masked token" if s.cfg.paradigm == "diffusion" else "nats/token"
    early = ""
    if s.step < s.opts.schedule_steps:
        early = (f" of a {s.opts.schedule_steps}-step schedule (learning rate "
                 f"{float(learning_rate_schedule(s.opts)(s.step)):.3g}, not yet decayed to min_lr "
                 f"{s.opts.min_lr:.3g}; run it to step {s.opts.schedule_steps} to finish the schedule)")
    log(f"done: step {s.step}{early}, val {s.last_val:.4f} {unit}, run directory {s.out_dir}")
    return rd.read_summary(s.out_dir)



