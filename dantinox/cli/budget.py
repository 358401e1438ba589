"""``dantinox budget``: KV cache bytes per sequence and the largest batch, per attention kind and context.

    dantinox budget --preset reference --device-memory 40GB --context 512 1024 4096 --dtype bf16 [--measure]

The model shape comes from --preset, --config (a YAML or JSON file of ModelConfig fields, optionally under a
``model:`` key) or --run_dir (its config.json). Tables are printed for the MHA, GQA, MQA and MLA variants of
that shape (same width, heads and layers; the given config's own kind is marked with *):

1. KV cache MiB per sequence at each context length (``dantinox.budget.memory.kv_cache_bytes``);
2. the largest batch that fits in --device-memory beside the float32 weights (counted from the parameter
   tree, built abstractly) and a --reserve-fraction of headroom (``dantinox.budget.memory.max_batch_size``).

With --measure every variant's cache is allocated with ``init_cache`` (batch 1, max_context = the context
length, in --dtype) and the bytes actually allocated are printed next to the formula: the arrays' own nbytes
and the change in device memory (``memory_stats()["bytes_in_use"]`` where the backend reports it, the total
of ``jax.live_arrays()`` otherwise, as on CPU). Exit status 1 if any array size disagrees with the formula.

With --kv-host-memory and / or --kv-disk-bytes (the KV tiers of ``dantinox serve``: ``dantinox.kv.tiers``) a
third table gives, per variant, the bytes one prefix block of --block-size tokens takes in a tier
(``dantinox.kv.sizes.tier_block_bytes``; an int8 prefix's first block adds its sink rows) and how many blocks
and prompt tokens each tier holds.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import jax

from ..budget.memory import kv_cache_bytes, memory_split, param_bytes
from ..budget.per_device import plan_mesh
from ..budget.size_flags import parse_size_flag
from ..config import CACHE_DTYPES, PRESETS, ModelConfig, canonical_dtype
from ..kv import sizes
from ..kv.sizes import token_bytes as token_bytes_of
from ..kv.spec import layer_specs
from ..kv.static import cache_nbytes
from ..kv.cache import init_cache
from ..kv.channel_keys import config_with_kv_keys
from ..parallel.mesh import MeshError, parse_mesh

MIB = 2 ** 20


def add_budget_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``budget`` options to ``parser`` (a subcommand parser)."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=sorted(PRESETS), help="a named model shape")
    source.add_argument("--config", help="YAML or JSON file of ModelConfig fields (or under a 'model:' key)")
    source.add_argument("--run_dir", help="a run directory (reads its config.json)")
    parser.add_argument("--device-memory", dest="device_memory", default="40GB", metavar="SIZE",
                        help="device memory, e.g. 40GB, 40GiB, 512MiB, 2e9 (default 40GB)")
    parser.add_argument("--context", type=int, nargs="+", default=None,
                        help="context lengths in tokens (default: max_context / 4, max_context / 2 and "
                             "max_context of the model; longer ones are marked ^: the model cannot run them)")
    parser.add_argument("--dtype", default=None,
                        help="cache dtype: fp32, bf16 or int8 (int8: values with a float32 scale per token and "
                             "KV head, keys per channel in groups of --kv-key-group tokens, or per token with "
                             "--kv-keys token; default: the model's cache_dtype)")
    parser.add_argument("--reserve-fraction", dest="reserve_fraction", type=float, default=0.1,
                        help="device memory kept free for activations and workspaces (default 0.1)")
    parser.add_argument("--kv-heads", dest="kv_heads", type=int, default=None,
                        help="KV heads of the GQA row (default: the config's, else n_heads / 4)")
    parser.add_argument("--kv-latent-dim", dest="kv_latent_dim", type=int, default=None,
                        help="d_c of the MLA row (default: the config's, else 4 * head_size)")
    parser.add_argument("--rope-head-dim", dest="rope_head_dim", type=int, default=None,
                        help="d_rope of the MLA row; 0 = no RoPE key (default: the config's, else "
                             "head_size / 2)")
    parser.add_argument("--gen-len", dest="gen_len", type=int, default=None,
                        help="masked diffusion: tokens generated per context; prints the DualCache table "
                             "(default for paradigm=diffusion models: context / 2)")
    parser.add_argument("--mesh", default=None, metavar="data=D,model=M",
                        help="also print memory per device and the largest batch on a D x M device mesh "
                             "(docs/how-to/multi-device.md)")
    parser.add_argument("--kv-keys", dest="kv_keys", default=None, metavar="token|channel",
                        help="int8 keys: channel (a scale per channel and group of --kv-key-group tokens, KIVI; "
                             "MLA rows stay per token) or token (a scale per token and KV head); default: the "
                             "config's, channel unless set")
    parser.add_argument("--kv-key-group", dest="kv_key_group", type=int, default=None, metavar="G",
                        help="tokens per key-scale group with per-channel keys (default: the config's, 64)")
    parser.add_argument("--kv-host-memory", dest="kv_host_memory", default=None, metavar="SIZE",
                        help="price a host-memory KV tier of this size (serve --kv-host-memory): blocks and tokens")
    parser.add_argument("--kv-disk-bytes", dest="kv_disk_bytes", default=None, metavar="SIZE",
                        help="price a disk KV tier of this size (serve --kv-disk-bytes): blocks and tokens")
    parser.add_argument("--block-size", dest="block_size", type=int, default=None, metavar="P",
                        help="tokens per KV block for the tier table (default: serve's, 16, or the key group with "
                             "per-channel int8 keys)")
    parser.add_argument("--measure", action="store_true",
                        help="allocate each cache with init_cache; print measured bytes next to the formula")


def run_budget(args: argparse.Namespace) -> int:
    """Print the tables; returns 0, or 1 when --measure finds a measured size that differs from the formula.

    Every value is checked and every table built before anything is printed, so bad input gives one line
    and exit status 2 (from the CLI) with no partial table. Raises ValueError / ConfigError /
    FileNotFoundError for bad input (the CLI prints them as one line).
    """
    mesh_sizes = mesh_sizes_from_flag(args.mesh)  # checked before anything is printed
    cfg = load_config(args)
    dtype, device_bytes, contexts = check_budget_args(args, cfg)
    tiers = tier_sizes(args)
    shape = cfg.replace(paradigm="ar", mask_token_id=None, shifted_prediction=False)  # KV sizes: paradigm-free
    if args.kv_keys is not None or args.kv_key_group is not None:   # checked against the --dtype cache
        if dtype != "int8" and args.kv_keys == "channel":
            raise ValueError(f"--kv-keys channel needs --dtype int8 (the cache dtype is {dtype})")
        shape = config_with_kv_keys(shape.replace(cache_dtype="int8") if dtype == "int8" else shape, args.kv_keys,
                                    args.kv_key_group)
    rows = attention_variants(shape, args.kv_heads, args.kv_latent_dim, args.rope_head_dim)
    heads = [f"{c} tok" + ("^" if c > cfg.max_context else "") for c in contexts]
    per_seq = [[label, _bytes_text(token_bytes(v, dtype))] + [_mib(kv_cache_bytes(v, 1, c, dtype))
                                                             for c in contexts] for label, v in rows]
    batch = [_batch_row(label, v, device_bytes, contexts, args.reserve_fraction, dtype) for label, v in rows]
    wants_diffusion = cfg.attention != "mla" and (cfg.paradigm == "diffusion" or args.gen_len is not None)
    diffusion = diffusion_rows(cfg, contexts, dtype, args.gen_len) if wants_diffusion and dtype != "int8" else None
    print(f"Model: {cfg.num_blocks} blocks, dim {cfg.dim}, {cfg.n_heads} heads x {cfg.head_size}, "
          f"vocab {cfg.vocab_size}; cache dtype {dtype}")
    channel = shape.replace(cache_dtype=dtype).channel_keys   # per-channel int8 keys: the int8 default (not MLA)
    print("KV bytes per sequence = L x 2 x S x H_kv x D x bytes (MLA: L x S x (d_c + d_rope) x bytes); int8 "
          "adds a 4-byte scale per token and KV head (MLA: 2 per token)" + (
              f"; per-channel keys (G = {shape.key_group}; --kv-keys token for per-token keys): value scales per "
              f"token, key scales per channel and group, ceil(S / G) x H_kv x D x 4, and a ring of 2 G x H_kv x D "
              f"x 4 float32 residual keys, per layer (MLA rows stay per token)" if channel else "") + "\n")
    if any(c > cfg.max_context for c in contexts):
        print(f"^ longer than the model's max_context={cfg.max_context}: the model cannot run it; the figures "
              "are for the same shape with a longer context\n")
    print_table(["attention", "bytes/token"] + heads, per_seq, title="KV cache per sequence (MiB)")
    print_kinds(shape, dtype, contexts, heads)
    notes = [f"{row[0].lstrip(' *')} {note}" for row, note in batch if note is not None] + stored_weights_note(args)
    print_table(["attention", "weights MiB"] + heads, [row for row, _ in batch],
                title=f"Max batch at {args.device_memory} ({device_bytes} B), reserve "
                      f"{args.reserve_fraction:.0%}, float32 weights", notes=notes)
    if dtype == "int8":
        print_dtype_table(rows)
    if mesh_sizes is not None:
        print_mesh_budget(rows, mesh_sizes, device_bytes, contexts, args.reserve_fraction, dtype, print_table)
    if wants_diffusion and dtype == "int8":
        print("Masked diffusion: no DualCache table for --dtype int8 (the DualCache has no int8 form)\n")
    if diffusion is not None:
        print_table(["context", "prompt", "gen_len", "DualCache", "AR cache", "ratio"], diffusion,
                    title="Masked diffusion: DualCache (prefix + suffix KV) vs AR cache per sequence (MiB)")
    if tiers:
        print_tier_table(rows, tiers, args.block_size, dtype)
    return measure(rows, contexts, dtype) if args.measure else 0


def tier_sizes(args: argparse.Namespace) -> dict[str, int]:
    """{"host memory": bytes, "disk": bytes} of --kv-host-memory / --kv-disk-bytes (those given); ValueError
    naming the flag for a bad size or --block-size."""
    sizes = {}
    for flag, name, text in (("--kv-host-memory", "host memory", getattr(args, "kv_host_memory", None)),
                             ("--kv-disk-bytes", "disk", getattr(args, "kv_disk_bytes", None))):
        if text is not None:
            sizes[name] = parse_size_flag(flag, text)
    block = getattr(args, "block_size", None)
    if block is not None and block < 1:
        raise ValueError(f"--block-size {block} is not allowed: an integer >= 1")
    return sizes


def print_tier_table(rows: list[tuple[str, ModelConfig]], tiers: dict[str, int], block_size: int | None,
                     dtype: str) -> None:
    """Per variant: bytes of one prefix block in a KV tier and each tier's blocks and tokens (module docstring).
    A tier smaller than one block is flagged, as serve refuses it."""
    from ..kv.sizes import tier_block_bytes
    from ..serving.step_plan import default_block_size

    table, notes = [], []
    for label, variant in rows:
        cfg = variant.replace(cache_dtype=dtype) if variant.cache_dtype != dtype else variant
        P = block_size or default_block_size(cfg)
        block, first = tier_block_bytes(cfg, P), tier_block_bytes(cfg, P, first=True)
        row = [label, str(P), str(block), str(first - block) if first > block else "-"]
        for name, nbytes in tiers.items():
            count = nbytes // block if nbytes >= first else 0
            row += [f"{count:,}", f"{count * P:,}"]
            if count == 0:
                notes.append(f"{label.lstrip(' *')}: the {name} tier holds no block (serve refuses it)")
        table.append(row)
    head = ["attention", "P", "bytes/block", "sinks B"]
    for name in tiers:
        head += [f"{name} blocks", f"{name} tokens"]
    sizes = ", ".join(f"{name} {nbytes / MIB:,.0f} MiB" for name, nbytes in tiers.items())
    print_table(head, table, title=f"KV tiers ({sizes}): prefix blocks of P tokens; sinks B: the extra bytes of a "
                                   "prefix's first block (int8 sink rows)", notes=notes)


def check_budget_args(args: argparse.Namespace, cfg: ModelConfig) -> tuple[str, int, list[int]]:
    """(cache dtype, device bytes, context lengths) from the flags; ValueError naming the flag as typed for
    any value that is not allowed (checked before anything is printed)."""
    try:
        dtype = canonical_dtype("cache_dtype", args.dtype or cfg.cache_dtype, CACHE_DTYPES)
    except ValueError:
        raise ValueError(f"--dtype {args.dtype!r} is not allowed: bf16, bfloat16, fp32, float32 or int8") from None
    device_bytes = parse_size_flag("--device-memory", args.device_memory)
    if not 0 <= args.reserve_fraction < 1:
        raise ValueError(f"--reserve-fraction {args.reserve_fraction} is not allowed: a number in [0, 1) "
                         "(the share of device memory kept free)")
    for flag, value, low in (("--kv-heads", args.kv_heads, 1), ("--kv-latent-dim", args.kv_latent_dim, 1),
                             ("--rope-head-dim", args.rope_head_dim, 0), ("--gen-len", args.gen_len, 1)):
        if value is not None and value < low:
            raise ValueError(f"{flag} {value} is not allowed: an integer >= {low}")
    if args.kv_heads is not None and cfg.n_heads % args.kv_heads:
        raise ValueError(f"--kv-heads {args.kv_heads} is not allowed: it must divide n_heads={cfg.n_heads}")
    contexts = [int(c) for c in args.context] if args.context else default_contexts(cfg.max_context)
    for c in contexts:
        if c <= 0:
            raise ValueError(f"--context {c} is not allowed: context lengths are positive integers")
    return dtype, device_bytes, contexts


def print_kinds(cfg: ModelConfig, dtype: str, contexts: list[int], heads: list[str]) -> None:
    """For a model whose layers are of more than one kind (sliding-window layers beside full ones) or keep a
    window's ring: its cache per sequence split by layer kind (``dantinox.kv.sizes.bytes_by_kind``), beside
    the same model with every layer full-length. Prints nothing for a model of one kind without rings."""
    variant = cfg.replace(cache_dtype=dtype)
    specs = layer_specs(variant)
    if len({spec.kind for spec in specs}) < 2 and not any(spec.ring for spec in specs):
        return
    rows = []
    for kind in dict.fromkeys(spec.kind for spec in specs):
        chosen = [spec for spec in specs if spec.kind == kind]
        ring = f", ring {chosen[0].ring} slots" if chosen[0].ring else ""
        label = f"{kind} x {len(chosen)}" + (f" (W {chosen[0].window}{ring})" if chosen[0].window else "")
        rows.append([label] + [_mib(sizes.bytes_by_kind(variant.replace(max_context=c), c).get(kind, 0))
                               for c in contexts])
    rows.append(["all layers"] + [_mib(kv_cache_bytes(variant, 1, c)) for c in contexts])
    whole = variant.replace(window_cache="full", layer_types=None, sliding_window=None)
    rows.append(["every layer full-length"] + [_mib(kv_cache_bytes(whole, 1, c)) for c in contexts])
    print_table(["layers"] + heads, rows, title="KV cache per sequence by layer kind (MiB)")


def token_bytes(cfg: ModelConfig, dtype: str) -> float:
    """Cache bytes per token, all layers, in ``dtype`` (``dantinox.kv.sizes.token_bytes``: with per-channel int8
    keys a key group's scales are shared by its G tokens; the residual ring and the sinks are per sequence)."""
    return token_bytes_of(cfg, dtype)


def _bytes_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


def print_dtype_table(rows: list[tuple[str, ModelConfig]]) -> None:
    """KV bytes per token (all layers) of each attention variant in every cache dtype, with int8 / float32
    (printed for --dtype int8)."""
    names = ["float32", "bfloat16", "int8"]
    table = []
    for label, v in rows:
        sizes = [token_bytes(v, d) for d in names]
        table.append([label] + [_bytes_text(n) for n in sizes] + [f"{sizes[-1] / sizes[0]:.3f}"])
    print_table(["attention"] + names + ["int8/float32"], table,
                title="KV bytes per token by cache dtype (int8 includes its float32 scales)")


def diffusion_rows(cfg: ModelConfig, contexts: list[int], dtype: str, gen_len: int | None) -> list[list[str]]:
    """Rows of the DualCache table: peak bytes (dantinox.budget.memory.diffusion_cache_bytes) next to the AR cache,
    one row per context: prompt = context - gen_len tokens (gen_len default context // 2).
    Raises ValueError naming --gen-len when it does not leave a prompt of at least one token."""
    from ..budget.memory import diffusion_cache_bytes

    rows = []
    for c in contexts:
        g = gen_len if gen_len is not None else c // 2
        if not 0 < g < c:
            raise ValueError(f"--gen-len {g} is not allowed for --context {c}: between 1 and {c - 1}")
        shape = cfg.replace(max_context=max(c, cfg.max_context), cache_dtype=dtype)
        r = diffusion_cache_bytes(shape, c - g, g)
        rows.append([str(c), str(c - g), str(g), _mib(r["dual_cache"]), _mib(r["ar_same_length"]),
                     f"{r['ratio_same_length']:.3f}"])
    return rows


def default_contexts(max_context: int) -> list[int]:
    """max_context / 4, max_context / 2 and max_context (distinct, >= 1): lengths the model can run."""
    return sorted({max(1, max_context // 4), max(1, max_context // 2), max_context})


def load_config(args: argparse.Namespace) -> ModelConfig:
    """The ModelConfig named by --preset, --config or --run_dir; ValueError when none is given."""
    if getattr(args, "config", None):
        return ModelConfig.from_dict(_model_fields(_read_mapping(args.config, "--config"), args.config))
    if getattr(args, "run_dir", None):
        from ..runs.bundled import resolve_run_dir

        path = os.path.join(resolve_run_dir(args.run_dir), "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--run_dir {args.run_dir}: no config.json there")
        return ModelConfig.from_dict(_model_fields(_read_mapping(path, f"--run_dir {args.run_dir}:"), path))
    if getattr(args, "preset", None):
        return ModelConfig.from_preset(args.preset)
    raise ValueError("no model shape given: pass one of --preset NAME (e.g. --preset reference), "
                     "--config FILE or --run_dir DIR")


def _read_mapping(path: str, label: str) -> dict:
    """The mapping in a YAML or JSON (``*.json``) file; ValueError naming ``label`` and the file otherwise
    (``dantinox.runs.input_files``)."""
    from ..runs.input_files import read_json, read_yaml

    data = (read_json if path.endswith(".json") else read_yaml)(path, label)
    if not isinstance(data, dict):
        raise ValueError(f"{label} {path}: a mapping of ModelConfig fields is required")
    return data


def _model_fields(data: dict, path: str) -> dict:
    model = data.get("model", data)
    if not isinstance(model, dict):
        raise ValueError(f"config file {path}: 'model' must be a mapping of ModelConfig fields")
    return model


def attention_variants(cfg: ModelConfig, kv_heads: int | None = None, kv_latent_dim: int | None = None,
                       rope_head_dim: int | None = None) -> list[tuple[str, ModelConfig]]:
    """(label, config) for the MHA, GQA, MQA and MLA variants of cfg's shape; cfg's own kind is starred.

    GQA uses kv_heads, else cfg.kv_heads for a GQA config, else n_heads / 4 (or the largest divisor of n_heads
    between 1 and n_heads; no GQA row if there is none). MLA uses kv_latent_dim / rope_head_dim, else cfg's,
    else 4 * head_size and head_size / 2 (DeepSeek-V2's ratios); its query latent is cfg's.
    """
    H = cfg.n_heads
    plain = dict(kv_latent_dim=None, rope_head_dim=None, q_latent_dim=None)
    out = [("mha", cfg.replace(attention="mha", kv_heads=None, **plain), f"H_kv={H}")]
    gqa = kv_heads or (cfg.kv_heads if cfg.attention == "gqa" else None) or _default_gqa_heads(H)
    if gqa is not None:
        out.append(("gqa", cfg.replace(attention="gqa", kv_heads=gqa, **plain), f"H_kv={gqa}"))
    out.append(("mqa", cfg.replace(attention="mqa", kv_heads=None, **plain), "H_kv=1"))
    mla = cfg.attention == "mla"
    latent = kv_latent_dim or (cfg.kv_latent_dim if mla else 4 * cfg.head_size)
    rope = rope_head_dim if rope_head_dim is not None else (cfg.rope_head_dim if mla else None)
    mla_cfg = cfg.replace(attention="mla", kv_heads=None, kv_latent_dim=latent, rope_head_dim=rope,
                          q_latent_dim=cfg.q_latent_dim if mla else None)
    out.append(("mla", mla_cfg, f"d_c={mla_cfg.kv_latent_dim}, d_rope={mla_cfg.rope_head_dim}"))
    return [(f"{'*' if kind == cfg.attention else ' '}{kind} ({detail})", v) for kind, v, detail in out]


def _default_gqa_heads(n_heads: int) -> int | None:
    if n_heads % 4 == 0 and n_heads // 4 > 1:
        return n_heads // 4
    divisors = [d for d in range(2, n_heads) if n_heads % d == 0]
    return divisors[-1] if divisors else None


def stored_weights_note(args) -> list[str]:
    """A note when --run_dir stores its weights in another form than float32 (GGUF blocks, bf16, int8): the
    table counts float32 weights for every variant, the run's file holds fewer bytes (model.safetensors' size,
    its small header included). [] otherwise, or when the run has no model_summary.json."""
    if not getattr(args, "run_dir", None):
        return []
    from ..runs.bundled import resolve_run_dir
    run = resolve_run_dir(args.run_dir)
    try:
        with open(os.path.join(run, "model_summary.json"), encoding="utf-8") as f:
            form = json.load(f).get("weight_format", "float32")
        size = os.path.getsize(os.path.join(run, "model.safetensors"))
    except (OSError, ValueError):
        return []
    if form == "float32":
        return []
    return [f"this run stores its weights as {form}: {size / MIB:.4g} MiB in model.safetensors; the table counts "
            "float32 weights for every variant, so beside the stored weights more sequences fit"]


def _batch_row(label: str, cfg: ModelConfig, device_bytes: int, contexts: list[int], reserve: float,
               dtype: str) -> tuple[list[str], str | None]:
    """(the row's cells, None), or (cells with "-" per context, the reason) when the weights do not fit."""
    weights = param_bytes(cfg)
    try:
        budget = memory_split(cfg, device_bytes, weights, reserve).kv_budget_bytes
    except ValueError:
        kept = math.ceil(device_bytes * reserve)
        return [label, _mib(weights)] + ["-" for _ in contexts], (
            f"does not fit in {device_bytes} B: weights {weights} B + reserve {kept} B ({reserve:.0%}) = "
            f"{weights + kept} B, {weights + kept - device_bytes} B more than the device has")
    return [label, _mib(weights)] + [str(budget // kv_cache_bytes(cfg, 1, c, dtype)) for c in contexts], None


def measure(rows: list[tuple[str, ModelConfig]], contexts: list[int], dtype: str) -> int:
    """Allocate each cache (batch 1) and compare its bytes with the formula; 1 if any differ, else 0.

    A device allocator may round allocations up; such a difference between the arrays' nbytes and the change
    in device memory is printed next to the row but is not a mismatch of the formula.
    """
    device = jax.devices()[0]
    stats = device.memory_stats()
    source = "memory_stats bytes_in_use" if stats else "jax.live_arrays() total"
    table, mismatches = [], 0
    for label, cfg in rows:
        for ctx in contexts:
            sized = cfg.replace(max_context=ctx, cache_dtype=dtype)
            before = _device_bytes_in_use(device)
            cache = jax.block_until_ready(init_cache(sized, 1))
            allocated = _device_bytes_in_use(device) - before
            formula, nbytes = kv_cache_bytes(cfg, 1, ctx, dtype), cache_nbytes(cache)
            del cache
            mismatches += formula != nbytes
            status = ("MISMATCH" if formula != nbytes else "ok" if allocated == nbytes
                      else f"ok (device {allocated - nbytes:+d} B)")
            table.append([label, str(ctx), str(formula), str(nbytes), str(allocated), status])
    print_table(["attention", "context", "formula B", "nbytes B", "allocated B", ""], table,
                title=f"Measured on {device.platform}:{device.id} (allocated = change in {source})")
    if stats:
        keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
        print("memory_stats: " + ", ".join(f"{k}={stats[k]}" for k in keys if k in stats))
    else:
        print(f"memory_stats: None on {device.platform}; live arrays now hold "
              f"{sum(a.nbytes for a in jax.live_arrays())} B")
    return 1 if mismatches else 0


def _device_bytes_in_use(device) -> int:
    stats = device.memory_stats()
    if stats and "bytes_in_use" in stats:
        return int(stats["bytes_in_use"])
    return int(sum(a.nbytes for a in jax.live_arrays()))


def _mib(n: int) -> str:
    return f"{n / MIB:.4g}"


def print_table(header: list[str], rows: list[list[str]], title: str, notes: list[str] = ()) -> None:
    """Print a titled, aligned table (first column left, others right), then each note on its own line."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    print(title)
    for n, row in enumerate([header] + rows):
        print("  " + "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths))
    for note in notes:
        print(f"  {note}")
    print()


def mesh_sizes_from_flag(text: str | None) -> dict[str, int] | None:
    """{"data": D, "model": M} from ``--mesh`` (no devices needed: budget plans for any mesh), or None."""
    return None if text is None else parse_mesh(text, "--mesh")


def mesh_rows(rows: list[tuple[str, ModelConfig]], sizes: dict[str, int], device_bytes: int,
              contexts: list[int], reserve: float, dtype: str) -> list[list[str]]:
    """Table rows: attention, weights MiB/device, reserve MiB, then per context 'KV MiB/seq -> max batch',
    then the cache layout."""
    table = []
    for label, cfg in rows:
        try:
            plans = [plan_mesh(cfg, sizes, device_bytes, c, reserve, dtype) for c in contexts]
        except MeshError as err:
            table.append([label, "-", "-"] + ["-" for _ in contexts] + [f"cannot shard: {err}"])
            continue
        first = plans[0]
        cells = [f"{p.kv_bytes_per_sequence / MIB:.4g} -> {p.max_batch}" for p in plans]
        table.append([label, f"{first.weights_bytes / MIB:.4g}", f"{first.reserve_bytes / MIB:.4g}"] + cells
                     + [first.cache_layout])
    return table


def print_mesh_budget(rows, sizes: dict[str, int], device_bytes: int, contexts: list[int], reserve: float,
                      dtype: str, print_table) -> None:
    """Print the per-device table for mesh ``sizes`` (see the module docstring)."""
    heads = [f"{c} tok: KV MiB/seq -> batch" for c in contexts]
    print_table(["attention", "weights MiB/dev", "reserve MiB"] + heads + ["cache layout"],
                mesh_rows(rows, sizes, device_bytes, contexts, reserve, dtype),
                title=f"Per device on mesh data={sizes['data']},model={sizes['model']} "
                      f"({sizes['data'] * sizes['model']} devices of {device_bytes} B each; batch = whole mesh)")
