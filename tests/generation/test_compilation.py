"""No recompilation between decode steps or across requests (issue 2, point 5), and no cache-sized copies
inside the compiled decode loop (../shared/PERFORMANCE.md, item 1)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx
from paths import TESTS

import dantinox as dx
from dantinox.kv.static import first_slots


def test_compile_count_across_prompts_sampling_and_lengths():
    """CompileCounter.compilations counts programs compiled and programs loaded from the run's persistent
    compilation cache alike (an earlier module may have compiled the same program): what matters is how many
    programs each call needs."""
    model = dx.build_model(tiny_config(max_context=128))
    rng = np.random.default_rng(0)
    with dx.CompileCounter() as first:
        dx.generate(model, [[1, 2, 3], [4, 5, 6, 7, 8]], 20)
    assert first.compilations >= 2  # prefill (bucket 16) and the decode loop at least
    with dx.CompileCounter() as warm:
        for length_a, length_b in ((1, 16), (9, 2), (12, 12)):
            prompts = [rng.integers(0, 128, length_a).tolist(), rng.integers(0, 128, length_b).tolist()]
            dx.generate(model, prompts, 20)
            dx.generate(model, prompts, 50, temperature=0.7, top_k=5, top_p=0.9, seed=length_a)
            dx.generate(model, prompts, 33, temperature=[0.0, 1.3], top_k=[0, 3], top_p=[1.0, 0.5], seed=7)
            list(dx.stream_tokens(model, prompts, 20, chunk_size=4))
    assert warm.compilations == 0 and warm.cache_hits == 0, warm
    with dx.CompileCounter() as bucket:
        dx.generate(model, [rng.integers(0, 128, 17).tolist(), [3]], 20)  # a new prompt bucket (32)
        dx.generate(model, [rng.integers(0, 128, 30).tolist(), [3]], 50, temperature=0.5)
    assert bucket.compilations == 1, bucket  # only the prefill for the new bucket



def test_one_row_on_a_long_context_attends_over_a_window_its_request_needs():
    """Issue 23 item 6: at B = 1 with S = 1024 a short request decodes in a 512-slot window, not over S: the
    same tokens as the uncached forward (greedy and sampled), one decode program per window size used."""
    gen = sys.modules["dantinox.generation.decode"]
    cfg = tiny_config(max_context=1024)
    assert gen.decode_windows(cfg, 1) == (1024,)                   # no bound known: the whole cache
    assert gen.decode_windows(cfg, 1, 300) == (512,)
    assert gen.decode_windows(cfg, 1, 513) == (1024,)
    assert gen.decode_windows(tiny_config(max_context=384), 1, 10) == (384,)   # short contexts: unchanged
    # batches: the ladder up to S or the bound's top; with the attention kernel (it reads only the filled
    # slots) and for int8 caches (XLA's attention, the ladder)
    kernel = gen.reads_only_filled_slots(cfg)
    assert gen.decode_windows(cfg, 2) == ((1024,) if kernel else (128, 256, 384, 512, 1024))
    assert gen.decode_windows(cfg, 2, 10) == ((512,) if kernel else (128, 256, 384, 512))
    int8 = cfg.replace(cache_dtype="int8")
    assert not gen.reads_only_filled_slots(int8)
    assert gen.decode_windows(int8, 2) == (128, 256, 384, 512, 1024)
    assert gen.decode_windows(int8, 2, 600) == (128, 256, 384, 512, 1024)
    mla = tiny_config(max_context=1024, attention="mla", kv_latent_dim=32, rope_head_dim=8)
    assert gen.decode_windows(mla, 1, 10) == (128, 256, 384, 512)
    model = dx.build_model(cfg)
    prompt = [[5, 9, 2, 7, 1]]
    with dx.CompileCounter() as first:
        cached = dx.generate(model, prompt, 40)
    with dx.CompileCounter() as same_window:
        sampled = dx.generate(model, prompt, 60, temperature=0.8, top_k=7, seed=3)
        streamed = np.concatenate(list(dx.stream_tokens(model, prompt, 40, chunk_size=16)), axis=1)
    with dx.CompileCounter() as longer:
        tail = dx.generate(model, prompt, 600)                      # bound 605: the 1024 window, one more program
    assert first.compilations >= 2 and same_window.compilations == 0 and longer.compilations == 1, (first, longer)
    np.testing.assert_array_equal(cached, dx.generate(model, prompt, 40, use_cache=False))
    np.testing.assert_array_equal(streamed, cached)
    np.testing.assert_array_equal(sampled, dx.generate(model, prompt, 60, temperature=0.8, top_k=7, seed=3,
                                                       use_cache=False))
    np.testing.assert_array_equal(tail[:, :40], cached)


def test_a_batch_on_a_long_context_stops_its_windows_at_the_request_bound():
    """B = 2 on S = 1024: a short request's windows end at 512 (no cut of the slots past it), greedy tokens equal
    the uncached forward's, and a longer request (bound over 512) needs exactly one more decode program."""
    model = dx.build_model(tiny_config(max_context=1024))
    prompts = [[5, 9, 2, 7, 1], [3, 8]]
    with dx.CompileCounter() as first:
        cached = dx.generate(model, prompts, 40)
    with dx.CompileCounter() as same_top:
        dx.generate(model, prompts, 90, temperature=0.8, seed=1)
    with dx.CompileCounter() as longer:
        tail = dx.generate(model, prompts, 600)
    assert first.compilations >= 2 and same_top.compilations == 0 and longer.compilations == 1, (first, longer)
    np.testing.assert_array_equal(cached, dx.generate(model, prompts, 40, use_cache=False))
    np.testing.assert_array_equal(tail[:, :40], cached)


def decode_hlo(cfg: dx.ModelConfig, batch: int) -> str:
    """Optimised HLO text of the compiled decode loop."""
    gen = sys.modules["dantinox.generation.decode"]
    model = dx.build_model(cfg)
    graphdef, params = nnx.split(model)
    state = gen.DecodeState(jnp.int32(1), jnp.zeros((batch,), jnp.int32), jnp.full((batch,), 3, jnp.int32),
                            jnp.zeros((batch,), bool), jnp.zeros((batch, cfg.max_context), jnp.int32),
                            dx.init_cache(cfg, batch))
    lowered = gen.decode.lower(graphdef, params, state, jnp.int32(5), jax.random.key(0),
                               dx.make_sampling_params(batch), jnp.int32(-1), jnp.int32(0))
    return lowered.compile().as_text()


def cache_shaped_copies(hlo: str, cfg: dx.ModelConfig, batch: int) -> int:
    shape = f"[{batch},{cfg.kv_heads},{cfg.max_context},{cfg.head_size}]"
    return sum(1 for line in hlo.splitlines() if " copy(" in line and shape in line)


SHAPES = [dict(attention="mha", kv_heads=None), dict(attention="gqa", kv_heads=2),
          dict(attention="mqa", kv_heads=None)]


@pytest.mark.parametrize("attn", SHAPES, ids=lambda a: a["attention"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("max_context", [128, 384])   # 384: GQA and MQA batches decode in windows
def test_no_cache_copies_in_compiled_decode_loop(attn, batch, max_context):
    cfg = dx.ModelConfig.from_preset("reference", num_blocks=2, max_context=max_context, **attn)
    assert cache_shaped_copies(decode_hlo(cfg, batch), cfg, batch) == 0


def test_copy_counter_sees_copies_when_the_xla_flag_is_off():
    """Guards the test above: without region analysis XLA does copy the cache, and the counter sees it."""
    code = ("import sys; sys.path[:0] = [%r, %r]; import test_compilation as t, dantinox as dx;"
            "cfg = dx.ModelConfig.from_preset('reference', num_blocks=2, max_context=128);"
            "print(t.cache_shaped_copies(t.decode_hlo(cfg, 1), cfg, 1))") % (os.path.dirname(__file__), TESTS)
    env = dict(os.environ, XLA_FLAGS="--xla_cpu_copy_insertion_use_region_analysis=false",
               DANTINOX_XLA_CACHE="off")   # compiled here with the other flag, never loaded from the run's cache
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip().splitlines()[-1]) > 0


@pytest.mark.parametrize("batch", [1, 4])
def test_no_latent_cache_copies_in_the_windowed_mla_decode_loop(batch):
    cfg = dx.ModelConfig.from_preset("reference", attention="mla", kv_heads=None, num_blocks=2, max_context=384,
                                     kv_latent_dim=32, rope_head_dim=16)
    assert sys.modules["dantinox.generation.decode"].decode_windows(cfg, batch) == (128, 256, 384)
    hlo = decode_hlo(cfg, batch)
    shapes = (f"[{batch},{cfg.max_context},{cfg.kv_latent_dim}]", f"[{batch},{cfg.max_context},{cfg.rope_head_dim}]")
    assert sum(1 for line in hlo.splitlines() if " copy(" in line and any(s in line for s in shapes)) == 0


def decode_loop_carry(hlo: str) -> str:
    """The state tuple of the compiled decode loop (the outer while over generated tokens)."""
    return next(line.split(" while(")[0] for line in hlo.splitlines()
                if " while(" in line and 'op_name="jit(decode)/while"' in line)


@pytest.mark.parametrize("attn", [dict(attention="gqa", kv_heads=2, kv_keys="token"),
                                  dict(attention="gqa", kv_heads=2, kv_key_group=24),
                                  dict(attention="mla", kv_heads=None, kv_latent_dim=32, rope_head_dim=16)],
                         ids=["gqa-token-keys", "gqa-channel-keys", "mla"])
def test_int8_decode_loop_holds_int8_rows_and_scales_and_copies_nothing_cache_sized(attn):
    """max_context 384, batch 4: the loop decodes in windows (128, 256, 384), one while loop per window over a
    cache of the window's first slots (``dantinox.kv.static.first_slots``). Each loop's state holds the int8
    rows and their float32 scales at its width, and no float array of the rows' shapes (no dequantized copy is
    carried from step to step); no copy of rows or scales anywhere. (Each step reads its window back inside
    attention.) The float32 attention-sink rows (A = 4 tokens, ``dantinox.kv.sinks``) are carried at
    their own size in every loop, and so, with per-channel keys (the int8 default; G = 24 here, so no shape
    of the key scales per group (ceil(width / G) groups), the filling group or the ring of 2 G slots is
    another field's), are the key scales and the ring. (The
    sinks and the ring, a few slots each and not cache-sized, are rewritten by a select every step.)"""
    batch = 4
    cfg = dx.ModelConfig.from_preset("reference", num_blocks=2, max_context=384, cache_dtype="int8", **attn)
    assert sys.modules["dantinox.generation.decode"].decode_windows(cfg, batch) == (128, 256, 384)
    hlo = decode_hlo(cfg, batch)
    layer = dx.init_cache(cfg, batch)[0]
    carries = [line.split(" while(")[0] for line in hlo.splitlines()
               if " while(" in line and 'op_name="jit(decode)/while"' in line]
    assert len(carries) == 3
    every = []
    for width in (128, 256, 384):
        cut = first_slots(layer, width)
        rows = [",".join(map(str, a.shape)) for a in cut if a.dtype == jnp.int8]
        floats = [",".join(map(str, a.shape)) for a in cut if a.dtype == jnp.float32]   # scales, sinks, ring
        assert len(rows) == 2 and len(floats) == len(layer) - 2 and not set(rows) & set(floats)
        every += rows + [",".join(map(str, a.shape)) for name, a in zip(cut._fields, cut) if "scale" in name]
        held = [c for c in carries if all(f"s8[{r}]" in c for r in rows) and all(f"f32[{x}]" in c for x in floats)]
        assert len(held) == 1, width
        assert not any(f"{t}[{r}]" in c for c in carries for r in rows for t in ("f32", "bf16"))
    copies = [line for line in hlo.splitlines() if " copy(" in line]
    assert not [line for line in copies if any(f"[{s}]" in line for s in every)]
