"""End to end: train a tiny DLRM with the job, rebuild it from the run directory,
export it (examples/export_dlrm.py) and predict in a fresh process."""

import importlib.util
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np

from jaxrec.inference import load
from jaxrec.jobs.from_run import model_from_run
from jaxrec.jobs.train_dlrm import main as train_main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = [
    "--num-train",
    "1024",
    "--num-eval",
    "256",
    "--batch-size",
    "128",
    "--max-steps",
    "4",
    "--embedding-dim",
    "4",
    "--dense-arch",
    "8,4",
    "--over-arch",
    "8,1",
    "--quiet",
]


def test_train_export_serve(tmp_path):
    run = tmp_path / "run"
    assert train_main([*TINY, "--run-dir", str(run)]) == 0
    info = json.loads((run / "args.json").read_text())
    assert info["args"]["max_steps"] == 4 and len(info["data"]["keys"]) == 26

    model, (dense, sparse) = model_from_run(run)
    spec = importlib.util.spec_from_file_location(
        "export_dlrm", os.path.join(REPO, "examples", "export_dlrm.py")
    )
    export_dlrm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export_dlrm)
    art = tmp_path / "art"
    assert export_dlrm.main([str(run), str(art)]) == 0
    predict = load(art)
    assert predict.manifest["output"] == {
        "name": "click_probability",
        "shape": ["batch"],
        "dtype": "float32",
    }

    # two samples: ids from the tables' range, as many as the run's data allows
    rng = np.random.default_rng(0)
    keys, sizes = info["data"]["keys"], info["data"]["num_embeddings_per_feature"]
    raw = {k: [rng.integers(0, n, 1).tolist(), []] for k, n in zip(keys, sizes, strict=True)}
    dense = rng.standard_normal((2, info["data"]["num_dense"])).astype(np.float32)
    got = predict(dense, raw)
    assert got.shape == (2,) and ((got > 0) & (got < 1)).all()

    # the restored model in-process agrees (trained values, not the init)
    from jaxrec import KeyedJaggedTensor

    lengths = np.array([[len(raw[k][i]) for i in range(2)] for k in keys]).reshape(-1)
    values = np.concatenate([np.concatenate([[], *raw[k]]) for k in keys]).astype(np.int32)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, capacities=2)
    expected = np.asarray(1 / (1 + np.exp(-np.asarray(model(jnp.asarray(dense), kjt))[:, 0])))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)

    script = (
        "import json, sys\n"
        "from jaxrec.inference import load\n"
        "req = json.loads(sys.argv[2])\n"
        "out = load(sys.argv[1])(req['dense'], req['sparse'])\n"
        "assert 'jaxrec.models' not in sys.modules\n"
        "print(json.dumps(out.tolist()))\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    env.pop("XLA_FLAGS", None)
    req = json.dumps({"dense": dense.tolist(), "sparse": raw})
    proc = subprocess.run(
        [sys.executable, "-c", script, str(art), req],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    np.testing.assert_allclose(json.loads(proc.stdout.splitlines()[-1]), got, rtol=1e-6)
