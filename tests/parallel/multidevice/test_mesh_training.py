"""Training on a mesh: data parallel, tensor parallel and FSDP give the single-device losses; checkpoints
move between mesh shapes (issue 13)."""

import csv
import os

import numpy as np
import pytest

import dantinox as dx
from dantinox.parallel.mesh import MeshError
from dantinox.train.trainer import train

TEXT = ("nel mezzo del cammin di nostra vita mi ritrovai per una selva oscura "
        "che la diritta via era smarrita ahi quanto a dir qual era e cosa dura ") * 20
OPTS = dict(steps=5, batch_size=8, seq_len=16, eval_every=1, eval_batches=1, checkpoint_every=0, lr=3e-3,
            warmup_steps=1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return str(path)


def losses(out_dir) -> np.ndarray:
    with open(os.path.join(out_dir, "training_log.csv"), encoding="utf-8") as f:
        return np.array([float(row["train_loss"]) for row in csv.DictReader(f)])


def cfg():
    return dx.ModelConfig.from_preset("tiny", attention="gqa", kv_heads=4, num_blocks=1)


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("single"))
    train(cfg(), corpus, out, log=lambda _: None, progress=False, **OPTS)
    return losses(out)


@pytest.mark.parametrize("mesh,fsdp", [("data=2,model=4", False), ("data=2,model=4", True),
                                       ("data=8", True)])
def test_five_steps_equal_single_device(corpus, single, tmp_path, mesh, fsdp):
    train(cfg(), corpus, str(tmp_path), log=lambda _: None, progress=False, mesh=mesh, fsdp=fsdp, **OPTS)
    got = losses(tmp_path)
    assert len(got) == 5 and np.abs(got - single).max() <= 1e-5, (mesh, fsdp, got, single)


def test_checkpoint_resumes_on_another_mesh_shape(corpus, single, tmp_path):
    train(cfg(), corpus, str(tmp_path), log=lambda _: None, progress=False, stop_at=3, mesh="data=2,model=4",
          fsdp=True, **OPTS)
    train(cfg(), corpus, str(tmp_path), log=lambda _: None, progress=False, mesh="data=4,model=2", **OPTS)
    got = losses(tmp_path)
    assert len(got) == 5 and np.abs(got - single).max() <= 1e-5, (got, single)
    model = dx.Generator(str(tmp_path), warmup=False).model  # the run directory loads on one device
    assert model.cfg.num_blocks == 1


def test_bad_training_mesh(corpus, tmp_path):
    with pytest.raises(MeshError, match=r"batch_size=6 is not divisible by mesh axis data=4"):
        train(cfg(), corpus, str(tmp_path), log=lambda _: None, progress=False, mesh="data=4,model=2",
              **{**OPTS, "batch_size": 6})
    with pytest.raises(MeshError, match=r"axis 'tp' is not allowed"):
        train(cfg(), corpus, str(tmp_path), log=lambda _: None, progress=False, mesh="tp=8", **OPTS)


def test_fsdp_shards_parameters_and_adam_moments(corpus, tmp_path):
    import jax

    from dantinox.train.trainer import TrainConfig, _start_session

    opts = TrainConfig(**OPTS, mesh="data=2,model=4", fsdp=True).resolved(cfg())
    s = _start_session(cfg(), corpus, str(tmp_path), opts, lambda _: None)
    P = jax.sharding.PartitionSpec
    kernel = s.params["blocks"][0]["attn"]["qkv"]["kernel"].get_value()
    assert kernel.sharding.spec == P("data", "model")  # embed over data (FSDP), heads over model
    adam = [x for x in jax.tree_util.tree_leaves(s.opt_state) if getattr(x, "shape", ()) == kernel.shape]
    assert len(adam) == 2 and all(x.sharding.is_equivalent_to(kernel.sharding, 2) for x in adam)
    shard = kernel.addressable_shards[0].data
    assert shard.shape == (kernel.shape[0] // 2, kernel.shape[1] // 4)
