"""One process of the 2-process test (tests/parallel/test_distributed.py): joins the group, runs greedy generation and
3 training steps on a (data=2, model=2) mesh over both processes' devices, prints a JSON line."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dantinox as dx  # noqa: E402
from dantinox.parallel.distributed import initialize  # noqa: E402

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
TRAIN = dict(steps=3, batch_size=4, seq_len=16, eval_every=1, eval_batches=1, checkpoint_every=0, lr=3e-3,
             warmup_steps=1)


def config():
    return dx.ModelConfig.from_preset("tiny", attention="gqa", kv_heads=4, num_blocks=1)


def run(mesh, corpus: str, out_dir: str) -> dict:
    """Greedy tokens and the per-step training losses (mesh None: one device)."""
    import csv

    from dantinox.train.trainer import train

    tokens = dx.generate(dx.build_model(config(), 3), PROMPTS, 6, temperature=0.0,
                         mesh=None if mesh is None else dx.make_mesh(**mesh))
    train(config(), corpus, out_dir, log=lambda _: None, progress=False,
          mesh=None if mesh is None else f"data={mesh['data']},model={mesh['model']}", **TRAIN)
    with open(os.path.join(out_dir, "training_log.csv"), encoding="utf-8") as f:
        losses = [float(row["train_loss"]) for row in csv.DictReader(f)]
    return {"tokens": tokens.tolist(), "losses": losses}


if __name__ == "__main__":
    coordinator, pid, corpus, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    initialize(coordinator, 2, pid, timeout_s=60)
    import jax

    assert jax.device_count() == 4 and jax.local_device_count() == 2, jax.devices()
    print(json.dumps(run(dict(data=2, model=2), corpus, out_dir)), flush=True)
