"""The sharded DLRM job runs to completion on 8 CPU devices (it used to abort in XLA).

A loop that dispatches multi-device programs far ahead of the devices can
deadlock XLA:CPU's collectives (see ``jaxrec.train.in_flight``); the job's
training and evaluation loops bound how far they run ahead.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp

from jaxrec.jobs import dlrm_parts
from jaxrec.jobs.train_dlrm import parse_config


def test_sharded_job_small_per_device_batch_completes(tmp_path):
    # A subprocess: an XLA collective deadlock aborts the whole process. The
    # collective timeout is lowered from 40 s so that a hang fails fast.
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_cpu_collective_call_terminate_timeout_seconds=20"
    run_dir = tmp_path / "run"
    argv = ["--devices", "8", "--sharding", "row_wise", "--batch-size", "32"]
    argv += ["--num-train", "2048", "--num-eval", "2048", "--max-steps", "4"]
    argv += ["--checkpoint-every", "2", "--quiet", "--run-dir", str(run_dir)]
    code = "import sys; from jaxrec.jobs.train_dlrm import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["devices"] == 8 and summary["steps"] == 4
    assert 0 <= summary["eval"]["auc"] <= 1


def test_evaluate_never_runs_far_ahead_of_the_device():
    # The device is made slower than the host (~10-30 ms of matrix products
    # per batch): without a bound every batch would be dispatched at once.
    config = parse_config(["--num-train", "512", "--num-eval", "640", "--batch-size", "32"])
    _, evals = dlrm_parts.load_data(config)

    @jax.jit
    def eval_step(state, batch):
        m = jnp.full((256, 256), 1e-3, jnp.float32) + batch.labels.sum()
        m = jax.lax.fori_loop(0, 60, lambda _, x: jnp.tanh(x @ x), m)
        return jnp.full(batch.labels.shape, 0.5, jnp.float32) + 0.0 * m[0, 0]

    outs, outstanding = [], []

    def spy(state, batch):
        outstanding.append(sum(not o.is_ready() for o in outs))
        outs.append(eval_step(state, batch))
        return outs[-1]

    metrics = dlrm_parts.evaluate(spy, None, evals, config, None)
    assert len(outs) == 20 and metrics["calibration"] > 0
    assert max(outstanding) <= 3, outstanding
