"""The program store (dantinox.programs.store): a stored program is traced once, loaded afterwards without
tracing, gives the plain jit's results bit for bit (generation and the serving engine), keeps donation, and a
damaged file is exported again. The suite runs with the store off (conftest); these tests turn it on in a
temporary directory."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from serving_util import drain, lively_model, make_engine

import dantinox as dx
from dantinox.programs import store as program_store
from dantinox.programs.store import StoredFunction, clear_programs
from dantinox.serving.request import SamplingOptions


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The store on, in tmp_path/programs; nothing loaded before or after the test."""
    monkeypatch.setenv("DANTINOX_PROGRAM_STORE", "on")
    monkeypatch.setenv("DANTINOX_XLA_CACHE", str(tmp_path))
    clear_programs()
    yield tmp_path / "programs"
    clear_programs()


def _counting_function():
    """A StoredFunction whose Python body records each trace."""
    traces = []

    def scale_and_add(x, y, *, n):
        traces.append(x.shape)
        return {"out": x * n + y, "n": jnp.int32(n)}

    return StoredFunction(scale_and_add, ("n",), ("y",)), traces


def test_traced_once_then_loaded_without_tracing(store):
    fn, traces = _counting_function()
    x, y = np.arange(6, dtype=np.float32), np.ones(6, np.float32)
    first = fn(x, jnp.asarray(y), n=3)
    assert len(traces) == 1 and len(list(store.glob("*.jexp"))) == 1
    clear_programs()                 # as a new process would: nothing loaded, the file is there
    again, traces_again = _counting_function()
    second = again(x, jnp.asarray(y), n=3)
    assert traces_again == []        # loaded from the file: the function body never ran
    np.testing.assert_array_equal(second["out"], first["out"])
    np.testing.assert_array_equal(second["out"], x * 3 + y)
    assert int(second["n"]) == 3


def test_new_shapes_and_statics_are_new_programs(store):
    fn, traces = _counting_function()
    y = jnp.ones(6, jnp.float32)
    fn(np.zeros(6, np.float32), y, n=2)
    fn(np.zeros(6, np.float32), jnp.ones(6, jnp.float32), n=2)   # same program: no trace
    assert len(traces) == 1
    fn(np.zeros(6, np.float32), jnp.ones(6, jnp.float32), n=5)   # another static
    fn(np.zeros(4, np.float32), jnp.ones(4, jnp.float32), n=2)   # another shape
    fn(np.zeros(6, np.int32), jnp.ones(6, jnp.int32), n=2)       # another dtype
    assert len(traces) == 4 and len(list(store.glob("*.jexp"))) == 4


def test_donation_is_kept(store):
    fn, _ = _counting_function()
    y = jnp.ones(6, jnp.float32)
    fn(np.zeros(6, np.float32), y, n=2)
    assert y.is_deleted()            # donated, as with the plain jit


def _reload(x, caplog):
    """Drop the loaded programs and call a fresh counting function once, warnings captured: (result, traces)."""
    clear_programs()
    again, traces = _counting_function()
    with caplog.at_level("WARNING", logger="dantinox.programs"):
        out = again(x, jnp.zeros(x.shape, jnp.float32), n=2)
    return out, traces


def test_a_damaged_file_is_exported_again(store, caplog):
    fn, traces = _counting_function()
    x = np.arange(3, dtype=np.float32)
    fn(x, jnp.zeros(3, jnp.float32), n=2)
    (path,) = store.glob("*.jexp")
    path.write_bytes(path.read_bytes()[:100])   # truncated
    out, traces_again = _reload(x, caplog)
    assert "does not load" in caplog.text and len(traces_again) == 1
    np.testing.assert_array_equal(out["out"], x * 2)


def test_inside_a_trace_and_with_the_store_off_the_plain_jit_runs(store, monkeypatch):
    fn, traces = _counting_function()
    inner = jax.jit(lambda x: fn(x, jnp.ones(3, jnp.float32), n=2)["out"])
    np.testing.assert_array_equal(inner(np.ones(3, np.float32)), np.full(3, 3.0))
    assert not store.exists()        # traced inside the outer jit, nothing stored
    monkeypatch.setenv("DANTINOX_PROGRAM_STORE", "off")
    fn(np.ones(3, np.float32), jnp.ones(3, jnp.float32), n=2)
    assert not store.exists()


def test_the_key_covers_the_environment(monkeypatch):
    base = program_store._environment()
    monkeypatch.setenv("DANTINOX_BLOCK_KERNEL", "off")            # changes what tracing produces
    assert program_store._environment() != base
    monkeypatch.delenv("DANTINOX_BLOCK_KERNEL")
    monkeypatch.setenv("DANTINOX_XLA_CACHE_MAX_SIZE", "2GiB")      # does not
    assert program_store._environment() == base


def test_generation_matches_the_plain_jit(store, monkeypatch, caplog):
    model = lively_model(tiny_config())
    prompts = [[5, 9, 11, 3], [7, 1]]
    stored = [np.asarray(dx.generate(model, p, 12, temperature=t, seed=4)).tolist()
              for p in prompts for t in (0.0, 0.9)]
    assert len(list(store.glob("*.jexp"))) >= 2                   # prefill and the decode loop
    clear_programs()
    with caplog.at_level("WARNING", logger="dantinox.programs"):   # loaded as stored (PRNG key arguments too)
        assert [np.asarray(dx.generate(model, p, 12, temperature=t, seed=4)).tolist()
                for p in prompts for t in (0.0, 0.9)] == stored
    assert caplog.text == ""
    monkeypatch.setenv("DANTINOX_PROGRAM_STORE", "off")
    plain = [np.asarray(dx.generate(model, p, 12, temperature=t, seed=4)).tolist()
             for p in prompts for t in (0.0, 0.9)]
    assert stored == plain


def _serve(model):
    engine = make_engine(model)
    for i, prompt in enumerate([[5, 9, 11, 3, 8, 2, 6, 1, 4], [7, 1], [3, 3, 12]]):
        engine.add_request(prompt, SamplingOptions(max_new_tokens=10, temperature=0.7 * (i % 2), seed=i), f"r{i}")
    return drain(engine)


def test_the_serving_engine_matches_the_plain_jit(store, monkeypatch, caplog):
    model = lively_model(tiny_config())
    stored = _serve(model)
    names = {p.name for p in store.glob("*.jexp")}
    assert len(names) >= 2                                         # forward steps and decode_steps
    clear_programs()
    with caplog.at_level("WARNING", logger="dantinox.programs"):
        assert _serve(model) == stored                             # loaded from the files
    assert caplog.text == ""
    assert {p.name for p in store.glob("*.jexp")} == names         # nothing new exported
    monkeypatch.setenv("DANTINOX_PROGRAM_STORE", "off")
    assert _serve(model) == stored


def test_a_second_process_loads_without_tracing(tmp_path):
    """Two `dantinox generate` processes on the bundled model: the second exports nothing and prints the
    same text."""
    env = {**os.environ, "DANTINOX_PROGRAM_STORE": "on", "DANTINOX_XLA_CACHE": str(tmp_path)}
    command = [sys.executable, "-m", "dantinox.cli", "generate", "--prompt", "The lord of", "--max_new_tokens", "16",
               "--temperature", "0"]
    runs = []
    for _ in range(2):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        runs.append((done.stdout, sorted(p.name for p in (tmp_path / "programs").glob("*.jexp"))))
    assert runs[0][1] and runs[1] == runs[0]


def test_a_cap_keeps_the_most_recently_used_programs(store):
    fn, traces = _counting_function()
    program_store.set_max_loaded_programs(1)
    try:
        x = np.arange(4, dtype=np.float32)
        first = fn(x, jnp.zeros(4, jnp.float32), n=2)
        fn(x, jnp.zeros(4, jnp.float32), n=3)                      # the n=2 program is dropped
        assert program_store.loaded_programs() == 1 and len(traces) == 2
        again = fn(x, jnp.zeros(4, jnp.float32), n=2)              # loaded again from its file, not traced
        assert len(traces) == 2
        np.testing.assert_array_equal(again["out"], first["out"])
        fn.prepare(x, jnp.zeros(4, jnp.float32), n=7)             # the cap is full: stored, not kept
        assert program_store.loaded_programs() == 1 and len(traces) == 3
        assert len(list(store.glob("*.jexp"))) == 3
    finally:
        program_store.set_max_loaded_programs(None)
        program_store._state.pop("cap", None)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_caps_are_refused(bad):
    with pytest.raises(ValueError, match="max loaded programs must be a whole number >= 1"):
        program_store.set_max_loaded_programs(bad)


@pytest.mark.parametrize("text", ["0", "two", "-1"])
def test_a_bad_cap_variable_is_named(text, monkeypatch):
    monkeypatch.setenv("DANTINOX_MAX_LOADED_PROGRAMS", text)
    monkeypatch.delitem(program_store._state, "cap", raising=False)
    with pytest.raises(ValueError, match=f"DANTINOX_MAX_LOADED_PROGRAMS='{text}' is not allowed"):
        program_store.max_loaded_programs()


def test_settings_that_change_tracing_are_new_programs(store):
    """JAX settings in jit's trace context (here the random seed offset, which changes every sampled token)
    key the program: a stored program of another setting is not reused (new-user break test, 2026-12-04)."""
    fn = StoredFunction(lambda x: jax.random.uniform(jax.random.key(0), x.shape) + x, (), ())
    x = np.zeros(3, np.float32)
    plain = np.asarray(fn(x))
    jax.config.update("jax_random_seed_offset", 7)
    try:
        offset = np.asarray(fn(x))
        clear_programs()
        again = np.asarray(fn(x))
    finally:
        jax.config.update("jax_random_seed_offset", 0)
    assert not np.array_equal(plain, offset) and np.array_equal(offset, again)
    assert len(list(store.glob("*.jexp"))) == 2


def test_bytes_that_deserialize_but_do_not_compile_are_exported_again(store, caplog):
    fn, traces = _counting_function()
    x = np.arange(3, dtype=np.float32)
    fn(x, jnp.zeros(3, jnp.float32), n=2)
    (path,) = store.glob("*.jexp")
    data = bytearray(path.read_bytes())
    start = data.index(b"ML\xefR") + 16                               # inside the StableHLO bytecode
    data[start:start + 40] = b"X" * 40
    path.write_bytes(bytes(data))
    out, traces_again = _reload(x, caplog)
    assert "does not load" in caplog.text and len(traces_again) == 1
    np.testing.assert_array_equal(out["out"], x * 2)
    clear_programs()
    third, traces_third = _counting_function()
    third(x, jnp.zeros(3, jnp.float32), n=2)
    assert traces_third == []                                         # the rewritten file loads


def test_a_file_under_another_key_is_not_used(store, caplog):
    fn, _ = _counting_function()
    fn(np.zeros(3, np.float32), jnp.zeros(3, jnp.float32), n=2)
    fn(np.zeros(5, np.float32), jnp.zeros(5, jnp.float32), n=2)
    a, b = sorted(store.glob("*.jexp"))
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)                                              # swapped names
    out, traces = _reload(np.ones(3, np.float32), caplog)
    assert "does not load" in caplog.text and len(traces) == 1
    np.testing.assert_array_equal(out["out"], np.full(3, 2.0))


def test_serve_refuses_a_bad_cap_variable_before_loading(tmp_path, monkeypatch, capsys):
    """A bad DANTINOX_MAX_LOADED_PROGRAMS stopped serve's engine thread after it listened (break test,
    2026-12-04); now one line and status 2 before anything loads."""
    from dantinox import cli
    monkeypatch.setenv("DANTINOX_MAX_LOADED_PROGRAMS", "0")
    monkeypatch.delitem(program_store._state, "cap", raising=False)
    assert cli.main(["serve", "--run_dir", str(tmp_path / "no-such-run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "DANTINOX_MAX_LOADED_PROGRAMS='0' is not allowed" in err


def test_output_shapes_come_off_the_stored_file_without_tracing_or_compiling(store, monkeypatch):
    fn, traces = _counting_function()
    x, y = np.arange(6, dtype=np.float32), jnp.ones(6, jnp.float32)
    fn(x, y, n=3)
    want = {"out": jax.ShapeDtypeStruct((6,), jnp.float32), "n": jax.ShapeDtypeStruct((), jnp.int32)}
    assert fn.output_shapes(x, jnp.ones(6, jnp.float32), n=3) == want     # loaded program
    clear_programs()
    again, traces_again = _counting_function()
    compiled = []
    monkeypatch.setattr(program_store, "_compile", lambda *a: compiled.append(a))
    spec = jax.ShapeDtypeStruct((6,), jnp.float32)
    assert again.output_shapes(spec, spec, n=3) == want                     # the file: not traced, not compiled
    assert traces_again == [] and compiled == []
    assert again.output_shapes(jax.ShapeDtypeStruct((5,), jnp.float32), jax.ShapeDtypeStruct((5,), jnp.float32),
                               n=3)["out"].shape == (5,)                    # not stored: traced abstractly


def test_prepare_with_shapes_makes_the_program_of_the_arrays(store):
    """A warm-up can prepare a program from shapes alone; the call with arrays of those shapes then runs it
    without tracing."""
    fn, traces = _counting_function()
    spec = jax.ShapeDtypeStruct((6,), jnp.float32)
    fn.prepare(spec, spec, n=2)
    assert len(traces) == 1
    out = fn(np.arange(6, dtype=np.float32), jnp.ones(6, jnp.float32), n=2)
    assert len(traces) == 1
    np.testing.assert_array_equal(out["out"], np.arange(6) * 2 + 1)


def test_generator_warm_up_loads_without_running_and_the_turn_traces_nothing(store):
    """Generator.warm_up makes prefill and the decode loop ready without running them; in a second "process"
    (programs dropped) the warm-up loads them from the files, and the generation that follows neither traces
    nor compiles, with the same tokens."""
    from dantinox.generation import decode
    from dantinox.generation.generator import warm_up
    from dantinox.xla import CompileCounter

    model = lively_model(tiny_config())
    warm_up(model, [5], 8)
    stored = np.asarray(dx.generate(model, [5, 9, 11, 3, 8], 8, temperature=0.8, seed=2)).tolist()
    clear_programs()
    ran, executed = [], []
    original, run_program = decode.prefill.jitted, program_store._Program.__call__
    decode.prefill.jitted = lambda *a, **k: ran.append(a) or original(*a, **k)
    program_store._Program.__call__ = lambda self, leaves: executed.append(self) or run_program(self, leaves)
    try:
        warm_up(model, [5], 8)
        assert executed == [] and len(program_store._LOADED) == 2     # loaded, not run
        with CompileCounter() as counted:
            again = np.asarray(dx.generate(model, [5, 9, 11, 3, 8], 8, temperature=0.8, seed=2)).tolist()
    finally:
        decode.prefill.jitted, program_store._Program.__call__ = original, run_program
    assert ran == [] and counted.compilations == 0, counted
    assert len(executed) == 2                                             # the turn: prefill, then decode
    assert again == stored
