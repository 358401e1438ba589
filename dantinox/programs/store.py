"""Compiled programs that start without tracing: a jitted function whose lowered programs are kept on disk.

A warm start with JAX's persistent compilation cache still traces and lowers every program before it can look
the executable up (the cache is keyed by the lowered module), and for a model of 30 unrolled blocks that is
most of the start: SmolLM2's 64-token serving prefill traced and lowered in 0.6-0.95 s, then loaded its
executable from the cache in 0.4 s (docs/explanation/performance.md, "Start-up"). ``stored_jit`` wraps a function like
``jax.jit`` and keeps each of its programs as a ``jax.export`` artifact (StableHLO, about 0.1 MB for that
prefill) in ``<compilation cache>/programs``, keyed by everything that decides what tracing produces; the next
process deserializes it (milliseconds) and compiles it, which the persistent compilation cache answers, so
the same prefill was ready in 0.54 s instead of 1.03 s, with the same tokens.

The key (sha256) covers: the function's module and name; its static arguments (by ``repr``: an nnx GraphDef's
repr carries the model's ModelConfig and module tree); the argument tree and every leaf's shape, dtype and weak
type; the donated arguments; the versions of jax, jaxlib, flax and dantinox; a digest of dantinox's own
source files and compiled extensions; ``XLA_FLAGS`` and every ``DANTINOX_*`` variable but the cache's own; JAX's
trace context (every setting jit keys its own cache with: x64, the default matmul precision, the PRNG
implementation, the random seed offset, the Gumbel sampler's range, ...); the platform, device kind and the
CPU's feature flags. A stored program whose key matches was therefore produced by the same code from the same
inputs. A file that does not load or compile (truncated, garbled, another format), or that holds another key's
program or other argument types, is removed and exported again, with one warning line.

Calls fall back to the plain ``jax.jit`` (same results, traced as usual) when the store is off (the
compilation cache is off, or ``DANTINOX_PROGRAM_STORE=off``), inside another trace, for arrays placed on
more than one device (a mesh), and for a function ``jax.export`` cannot serialize (it is then remembered and
logged once). Programs stay loaded in this process until ``clear_programs`` (tests call it where they call
``jax.clear_caches``), or, with a cap (``set_max_loaded_programs``, ``DANTINOX_MAX_LOADED_PROGRAMS``, serve's
``--max-loaded-programs``), until more than the cap are loaded: the least recently used program is then
dropped and its memory returned (each loaded program of SmolLM2's 30 unrolled blocks holds 45-60 MiB of host
memory, docs/explanation/performance.md, "Host memory"); using it again loads it from the store and the persistent
compilation cache (about 0.5 s for SmolLM2).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import pickle
import re
import tempfile
import threading
import time
from collections import OrderedDict

import jax
import numpy as np
from jax import export
from jax._src import config as jax_config   # trace_context: the settings jit keys its cache with

from ..xla import compilation_cache_dir

log = logging.getLogger("dantinox.programs")
ENV = "DANTINOX_PROGRAM_STORE"
FORMAT = 2   # 2: the record holds its key
CAP_ENV = "DANTINOX_MAX_LOADED_PROGRAMS"
MAX_STORE_BYTES = 256 << 20  # the store directory's cap; past it the least recently used files go
_NOT_KEYED = ("DANTINOX_XLA_CACHE", "DANTINOX_XLA_CACHE_MAX_SIZE", "DANTINOX_MMAP_THRESHOLD", ENV, CAP_ENV)
_FALLBACK = object()
_CUSTOM_CALLS: dict = {}   # FFI target name -> the function that registers its handler
_state: dict = {}
_state_lock = threading.Lock()
_LOADED: OrderedDict = OrderedDict()   # (StoredFunction, memo) -> _Program, least recently used first
_loaded_lock = threading.Lock()


def store_dir() -> str | None:
    """The directory of stored programs (``<compilation cache>/programs``), or None when the store is off."""
    if os.environ.get(ENV, "").strip().lower() in ("off", "0", "false", "no"):
        return None
    cache = compilation_cache_dir()
    return None if cache is None else os.path.join(cache, "programs")


def clear_programs() -> None:
    """Drop every program the stored functions hold loaded in this process (their files stay)."""
    with _loaded_lock:
        _LOADED.clear()


def set_max_loaded_programs(count: int | None) -> None:
    """Cap the programs loaded at once in this process (None: no cap, the default unless
    ``DANTINOX_MAX_LOADED_PROGRAMS`` is set). Raises ValueError for a count below 1."""
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ValueError(f"max loaded programs must be a whole number >= 1 (or None for no cap), got {count!r}")
    _state["cap"] = count
    _evict()


def max_loaded_programs() -> int | None:
    """The cap in force: ``set_max_loaded_programs``'s, else ``DANTINOX_MAX_LOADED_PROGRAMS`` (a whole number
    >= 1; ValueError naming the variable otherwise), else None."""
    if "cap" in _state:
        return _state["cap"]
    text = os.environ.get(CAP_ENV, "").strip()
    if not text or text.lower() == "unlimited":
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{CAP_ENV}={text!r} is not allowed: a whole number >= 1, or unlimited")
    return int(text)


def loaded_programs() -> int:
    """How many programs are loaded now (all stored functions)."""
    with _loaded_lock:
        return len(_LOADED)


def _evict() -> None:
    cap = max_loaded_programs()
    with _loaded_lock:
        while cap is not None and len(_LOADED) > cap:
            _LOADED.popitem(last=False)


def register_custom_calls(targets, register) -> None:
    """Declare FFI custom-call targets a stored program may contain (``jax.export`` refuses unknown ones) and
    ``register``, a function of no arguments that registers their handlers; it runs before every compile of
    a stored program, since a program loaded without tracing never runs the code that would register them.
    (``dantinox.quant.block_kernel`` declares the block kernel's targets.)"""
    for target in targets:
        _CUSTOM_CALLS[target] = register


def stored_jit(*, static_argnames: tuple = (), donate_argnames: tuple = ()):
    """Decorator: ``jax.jit(fun, static_argnames=..., donate_argnames=...)`` whose programs are kept on disk
    (``StoredFunction``)."""
    def wrap(fun):
        return StoredFunction(fun, static_argnames, donate_argnames)
    return wrap


class StoredFunction:
    """A jitted function whose programs load from the store without tracing (module docstring).

    Call it as the function; ``prepare(*args)`` makes the program for those arguments ready without running
    it (warm-up); ``lower`` and ``jitted`` give the plain ``jax.jit`` for inspection. Raises what the function
    raises (its errors come from tracing, on the first call of a program that is not stored yet).
    """

    def __init__(self, fun, static_argnames: tuple, donate_argnames: tuple):
        self.jitted = jax.jit(fun, static_argnames=static_argnames, donate_argnames=donate_argnames)
        self.signature = inspect.signature(fun)
        self.static_argnames, self.donate_argnames = tuple(static_argnames), tuple(donate_argnames)
        self.name = f"{fun.__module__}.{fun.__qualname__}"
        self._fallback: set = set()
        self._lock = threading.Lock()
        self._building: dict = {}
        functools.update_wrapper(self, fun)

    def __call__(self, *args, **kwargs):
        found = self._find(args, kwargs)
        if found is None:
            return self.jitted(*args, **kwargs)
        program, leaves = found
        return program(leaves)

    def prepare(self, *args, **kwargs) -> None:
        """Make the program for these arguments ready without running it: loaded, or with a cap on loaded
        programs that is reached, stored and compiled into the persistent cache but not kept (a program stored
        already is then left alone), so a warm-up ordered most likely first keeps the likeliest loaded."""
        full = max_loaded_programs() is not None and loaded_programs() >= max_loaded_programs()
        if self._find(args, kwargs, keep=not full) is None:
            self.jitted.lower(*args, **kwargs).compile()

    def output_shapes(self, *args, **kwargs):
        """The results' shapes and dtypes (a tree of jax.ShapeDtypeStruct) for these arguments (arrays or
        ShapeDtypeStructs), read off the loaded program or the stored file without running or compiling it (so
        a warm-up can prepare the next function of a pipeline at the same time); traced with
        ``jax.eval_shape`` when nothing is stored or the plain jit would run the call."""
        call = self._call(args, kwargs)
        if call is not None:
            directory, bound, names, _, tree, avals, memo = call
            program = self._loaded(memo)
            if program is not None:
                return _shapes(program.out_tree, jax.tree_util.tree_leaves(program.compiled.out_info))
            key, _ = self._key(bound, names, tree, avals)
            stored = None if key is None else _read(os.path.join(directory, key + ".jexp"), key, avals)
            if stored is not None:   # read off the stored record: nothing compiled
                exported, out_tree = stored
                return _shapes(out_tree, exported.out_avals)
        return jax.eval_shape(self.jitted, *args, **kwargs)

    def lower(self, *args, **kwargs):
        """The plain ``jax.jit``'s ``lower`` (inspection; does not use the store)."""
        return self.jitted.lower(*args, **kwargs)

    def _find(self, args, kwargs, keep: bool = True):
        """(the loaded program, the argument leaves), or None for a call the plain jit should run."""
        call = self._call(args, kwargs)
        if call is None:
            return None
        directory, bound, names, leaves, tree, avals, memo = call
        program = self._loaded(memo)
        if program is None:
            program = self._build(memo, directory, bound, names, tree, avals, keep)
        return None if program is _FALLBACK else (program, leaves)

    def _call(self, args, kwargs):
        """(store directory, bound arguments, names of the traced ones, their leaves, tree, leaf types, memo
        key), or None for a call the plain jit should run."""
        directory = store_dir()
        if directory is None:
            return None
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        statics = tuple(bound.arguments[name] for name in self.static_argnames)
        names = [name for name in bound.arguments if name not in self.static_argnames]
        leaves, tree = jax.tree_util.tree_flatten([bound.arguments[name] for name in names])
        avals = _leaf_types(leaves)
        if avals is None:
            return None
        memo = (statics, tree, avals, _trace_context())
        if memo in self._fallback:
            return None
        return directory, bound, names, leaves, tree, avals, memo

    def _loaded(self, memo):
        with _loaded_lock:
            program = _LOADED.get((self, memo))
            if program is not None:
                _LOADED.move_to_end((self, memo))
            return program

    def _build(self, memo, directory, bound, names, tree, avals, keep: bool):
        """Load or export the program of ``memo`` once, even when two threads ask for it together; keep it
        loaded (evicting past the cap) when ``keep``."""
        with self._lock:
            lock = self._building.setdefault(memo, threading.Lock())
        with lock:
            program = self._loaded(memo)
            if program is None:
                program = self._make(directory, bound, names, tree, avals, keep)
                if program is _FALLBACK:
                    self._fallback.add(memo)
                elif keep:
                    with _loaded_lock:
                        _LOADED[(self, memo)] = program
                    _evict()
        with self._lock:
            self._building.pop(memo, None)
        return program

    def _key(self, bound, names, tree, avals) -> tuple[str | None, tuple[int, ...]]:
        """(the store key of this call, or None when a static argument has no stable repr; the donated leaves)."""
        statics = [(name, bound.arguments[name]) for name in self.static_argnames]
        donated = _donated_leaves(names, self.donate_argnames, bound, tree)
        return program_key(self.name, statics, tree, avals, donated), donated

    def _make(self, directory, bound, names, tree, avals, keep: bool = True):
        key, donated = self._key(bound, names, tree, avals)
        if key is None:
            return _FALLBACK
        path = os.path.join(directory, key + ".jexp")
        if not keep and os.path.isfile(path):
            return None   # prepare under a full cap: stored already, loaded when first used
        started = time.perf_counter()
        loaded = _read(path, key, avals)
        if loaded is not None:
            try:
                program = _compile(loaded, donated)
            except Exception as err:   # noqa: BLE001 - bytes that deserialize but do not compile: export again
                _discard(path, err)
                loaded = None
        if loaded is None:
            try:
                loaded = self._export(bound, names, tree, avals)
            except Exception as err:   # noqa: BLE001 - anything jax.export refuses: the plain jit runs it
                log.info("%s: not stored (%s: %s); the plain jit runs it", self.name, type(err).__name__, err)
                return _FALLBACK
            _write(path, key, loaded, directory)
            program = _compile(loaded, donated)
        log.debug("%s: ready in %.2f s (%s)", self.name, time.perf_counter() - started, os.path.basename(path))
        return program

    def _export(self, bound, names, tree, avals):
        """Trace the function once for these argument types: (jax.export.Exported, its output tree)."""
        box = {}

        def flat(*leaves):
            arguments = dict(bound.arguments)
            arguments.update(zip(names, jax.tree_util.tree_unflatten(tree, leaves)))
            call = inspect.BoundArguments(self.signature, arguments)
            out_leaves, box["out_tree"] = jax.tree_util.tree_flatten(self.jitted(*call.args, **call.kwargs))
            return out_leaves

        checks = [export.DisabledSafetyCheck.custom_call(target) for target in _CUSTOM_CALLS]
        specs = [jax.ShapeDtypeStruct(shape, dtype, weak_type=weak) for shape, dtype, weak in avals]
        exported = export.export(jax.jit(flat), disabled_checks=checks)(*specs)
        return exported, box["out_tree"]


class _Program:
    """A compiled program over argument leaves, with the output tree to rebuild its results."""

    __slots__ = ("compiled", "out_tree")

    def __init__(self, compiled, out_tree):
        self.compiled, self.out_tree = compiled, out_tree

    def __call__(self, leaves):
        return jax.tree_util.tree_unflatten(self.out_tree, self.compiled(*leaves))


def _compile(loaded, donated) -> _Program:
    """Compile an exported program (the persistent compilation cache answers a warm start)."""
    exported, out_tree = loaded
    for register in set(_CUSTOM_CALLS.values()):
        register()
    compiled = jax.jit(exported.call, donate_argnums=donated).lower(
        *(jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in exported.in_avals)).compile()
    return _Program(compiled, out_tree)


def _shapes(out_tree, avals):
    """The output tree of jax.ShapeDtypeStructs (shape, dtype, weak type only) of these output avals."""
    return jax.tree_util.tree_unflatten(out_tree, [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
                                                   for a in avals])


def _leaf_types(leaves) -> tuple | None:
    """Each leaf's (shape, dtype, weak type); None when a leaf is a tracer or spans several devices."""
    types = []
    for leaf in leaves:
        if isinstance(leaf, jax.core.Tracer):
            return None
        if isinstance(leaf, jax.ShapeDtypeStruct):   # prepare / output_shapes for arguments not made yet
            types.append((leaf.shape, leaf.dtype, leaf.weak_type))
        elif isinstance(leaf, jax.Array):
            if len(leaf.sharding.device_set) != 1:
                return None
            types.append((leaf.shape, leaf.dtype, getattr(leaf, "weak_type", False)))
        elif isinstance(leaf, (np.ndarray, np.generic)):
            types.append((leaf.shape, leaf.dtype, False))
        else:
            aval = jax.typeof(leaf)
            types.append((aval.shape, aval.dtype, aval.weak_type))
    return tuple(types)


def _donated_leaves(names, donate_argnames, bound, tree) -> tuple[int, ...]:
    """Indices of the leaves of the donated arguments among all argument leaves."""
    donated, start = [], 0
    for name in names:
        count = len(jax.tree_util.tree_leaves(bound.arguments[name]))
        if name in donate_argnames:
            donated += range(start, start + count)
        start += count
    return tuple(donated)


_UNSTABLE = re.compile(r" at 0x[0-9a-f]+")
_FUNCTION = re.compile(r"<function ([\w.<>]+) at 0x[0-9a-f]+>")  # nnx Linear holds jax's dot_general


def program_key(name: str, statics, tree, avals, donated) -> str | None:
    """The store key (sha256 hex) of one program, or None when a static argument has no stable repr."""
    parts = [name, repr(donated), str(tree), repr([(s, str(d), w) for s, d, w in avals]), environment_digest(),
             _stable_repr(_trace_context())]
    for static_name, value in statics:
        text = _static_repr(value)
        if _UNSTABLE.search(text):
            return None
        parts.append(f"{static_name}={text}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


@functools.lru_cache(maxsize=32)
def _static_repr_cached(value) -> str:
    graphdef = getattr(value, "graphdef", value)   # serving.runner.StaticGraph holds the GraphDef
    return _FUNCTION.sub(r"<function \1>", repr(graphdef))


def _static_repr(value) -> str:
    try:
        return _static_repr_cached(value)
    except TypeError:   # unhashable: not a valid jit static anyway
        return repr(value)


_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl", "jax_threefry_partitionable")


def _trace_context():
    """JAX's trace context: the values of every setting that changes what tracing produces (jit keys its cache
    with it: x64, the default matmul precision, the PRNG settings, the Gumbel sampler's range, the random seed
    offset, ...), hashable; where this JAX version does not expose it, the values of ``_SETTINGS``."""
    context = getattr(jax_config, "trace_context", None)
    return context() if context is not None else tuple(getattr(jax.config, name) for name in _SETTINGS)


def _stable_repr(value) -> str:
    """repr with object addresses replaced by type names (a process-independent text for the key)."""
    if isinstance(value, tuple):
        return "(" + ", ".join(_stable_repr(v) for v in value) + ")"
    text = repr(value)
    return type(value).__qualname__ if _UNSTABLE.search(text) else text


def environment_digest() -> str:
    """A digest of everything outside a function's arguments that changes what tracing produces (module
    docstring); computed once per process."""
    with _state_lock:
        if "environment" not in _state:
            _state["environment"] = hashlib.sha256("\n".join(_environment()).encode()).hexdigest()
        return _state["environment"]


def _environment() -> list[str]:
    import flax
    import jaxlib

    from .._version import __version__
    device = jax.devices()[0]
    env = sorted(f"{k}={v}" for k, v in os.environ.items()
                 if (k.startswith("DANTINOX_") and k not in _NOT_KEYED) or k == "XLA_FLAGS")
    return [f"format={FORMAT}", jax.__version__, jaxlib.__version__, flax.__version__, __version__,
            device.platform, device.device_kind, _cpu_flags(), _source_digest(), *env]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return line.strip()
    except OSError:
        pass
    import platform
    return platform.processor()


def _source_digest() -> str:
    """sha256 over dantinox's Python sources and compiled extensions (names and bytes)."""
    root = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "bundled"))
        for file in sorted(files):
            if file.endswith((".py", ".so", ".pyd")):
                path = os.path.join(folder, file)
                digest.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as handle:
                    digest.update(handle.read())
    return digest.hexdigest()


def _read(path: str, key: str, avals):
    """(Exported, out_tree) from a stored file, None when absent; a file that does not load, or holds another
    key's program or other argument types, is removed (``_discard``)."""
    try:
        with open(path, "rb") as handle:
            record = pickle.load(handle)
        if record.get("format") != FORMAT or record.get("key") != key:
            raise ValueError(f"format {record.get('format')!r} and key {str(record.get('key'))[:12]}..., expected "
                             f"format {FORMAT} and key {key[:12]}...")
        exported = export.deserialize(record["exported"])
        found = [(tuple(a.shape), str(a.dtype), bool(a.weak_type)) for a in exported.in_avals]
        if found != [(tuple(shape), str(dtype), bool(weak)) for shape, dtype, weak in avals]:
            raise ValueError("its argument types differ from the call's")
        loaded = exported, record["out_tree"]
    except FileNotFoundError:
        return None
    except Exception as err:   # noqa: BLE001 - a damaged file is exported again
        _discard(path, err)
        return None
    try:
        os.utime(path)   # least recently used goes first when the store is over its cap
    except OSError:
        pass
    return loaded


def _discard(path: str, err: Exception) -> None:
    log.warning("stored program %s does not load (%s: %s); exporting it again", path, type(err).__name__,
                str(err)[:200])
    try:
        os.remove(path)
    except OSError:
        pass


def _write(path: str, key: str, loaded, directory: str) -> None:
    """Write atomically (a temporary file renamed), then keep the directory under MAX_STORE_BYTES."""
    exported, out_tree = loaded
    data = pickle.dumps({"format": FORMAT, "key": key, "exported": exported.serialize(), "out_tree": out_tree})
    temp = None
    try:
        os.makedirs(directory, exist_ok=True)
        handle, temp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temp, path)
        temp = None
        _prune(directory)
    except OSError as err:   # a read-only or full disk: the program still runs, it is just not kept
        log.warning("could not store program %s (%s)", path, err)
    finally:
        if temp is not None:
            try:
                os.remove(temp)
            except OSError:
                pass


def _prune(directory: str) -> None:
    """Remove the least recently used files past MAX_STORE_BYTES, and temporary files of writes that died
    (older than an hour)."""
    entries = []
    for name in os.listdir(directory):
        if name.endswith(".tmp"):
            try:
                if time.time() - os.stat(os.path.join(directory, name)).st_mtime > 3600:
                    os.remove(os.path.join(directory, name))
            except OSError:
                pass
        elif name.endswith(".jexp"):
            try:
                stat = os.stat(os.path.join(directory, name))
            except OSError:
                continue
            entries.append((stat.st_mtime, stat.st_size, name))
    total = sum(size for _, size, _ in entries)
    for _, size, name in sorted(entries):
        if total <= MAX_STORE_BYTES:
            break
        try:
            os.remove(os.path.join(directory, name))
            total -= size
        except OSError:
            pass
