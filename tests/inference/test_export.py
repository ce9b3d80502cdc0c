"""jax.export artifacts: round trip vs the in-process model, symbolic batch, raw dicts,
input validation, a fresh process without the model classes, multi-platform, Pallas."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from export_cases import KEYS, MAX_IDS, NUM_DENSE, REPO, ROWS, make_batch, make_model

from jaxrec import KeyedJaggedTensor
from jaxrec.inference import InputError, export, load
from jaxrec.inference.export import TRITON_TARGET

ARTIFACT_PY = os.path.join(REPO, "jaxrec", "inference", "artifact.py")


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def artifact(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("export") / "dlrm"
    dense, kjt, _ = make_batch(4)
    export(model, (dense, kjt), path)
    return path


@pytest.fixture(scope="module")
def loaded(artifact):
    return load(artifact)


def test_manifest(artifact, loaded):
    m = json.loads((artifact / "manifest.json").read_text())
    assert m["features"] == list(KEYS)
    assert m["max_ids_per_sample"] == dict.fromkeys(KEYS, MAX_IDS)
    assert m["num_embeddings"] == dict(zip(KEYS, ROWS, strict=True))
    assert m["num_dense"] == NUM_DENSE and m["platforms"] == ["cpu"]
    assert m["output"]["shape"] == ["batch", 1] and m["portable"]
    assert m["jax_version"] == jax.__version__
    with np.load(artifact / "weights.npz") as npz:
        assert sorted(npz.files) == [w["name"] for w in m["weights"]]
    # one artifact, a symbolic batch dimension
    shapes = [str(a.shape[0]) for a in loaded.exported.in_avals[-3:]]
    assert shapes == ["b", "b", "b"]


@pytest.mark.parametrize("b", [1, 3, 8])
def test_round_trip_matches_model(model, loaded, b):
    dense, kjt, raw = make_batch(b, seed=b)
    expected = np.asarray(model(jnp.asarray(dense), kjt))
    got = loaded(dense, kjt)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(loaded(dense.tolist(), raw), got)  # raw dict == KJT


def test_batch_buckets_bound_compiles(loaded):
    assert loaded.compiled_batch_sizes <= {1, 4, 8}
    dense, kjt, _ = make_batch(5)
    loaded(dense, kjt)
    assert 8 in loaded.compiled_batch_sizes and 5 not in loaded.compiled_batch_sizes


def test_fixed_buckets(artifact):
    m = load(artifact, batch_buckets=[2, 4])
    dense, _, raw = make_batch(3)
    assert m(dense, raw).shape == (3, 1)
    assert m.compiled_batch_sizes == {4}
    dense, _, raw = make_batch(5)
    with pytest.raises(InputError, match="max_batch_size=4"):
        m(dense, raw)


def _bad(raw, **change):
    out = {k: [list(x) for x in v] for k, v in raw.items()}
    out.update(change)
    return out


@pytest.mark.parametrize(
    "case, match",
    [
        ("unknown", r"unknown feature\(s\) \['nope'\]"),
        ("missing", r"missing feature\(s\) \['f2'\]"),
        ("float_ids", "feature 'f0' sample 0: ids must be a flat list of integers, got dtype f"),
        ("str_ids", "feature 'f0' sample 0: ids must be a list of integers, got str"),
        ("too_many", r"feature 'f1' sample 1 has 4 ids; .* at most 3 \(max_ids_per_sample\['f1'\]"),
        ("out_of_range", r"feature 'f2' sample 0: id 20 is outside \[0, 20\)"),
        ("negative", r"feature 'f0' sample 1: id -1 is outside"),
        ("dense_width", r"dense features must be \[B, 4\]"),
        ("samples", "feature 'f0' has 1 samples but dense features have 2"),
    ],
)
def test_bad_inputs(loaded, case, match):
    dense, _, raw = make_batch(2)
    raw = _bad(raw, f0=[[1], [2]], f1=[[1], [2]], f2=[[1], [2]])
    bad = {
        "unknown": lambda: (dense, {**raw, "nope": [[1], [1]]}),
        "missing": lambda: (dense, {k: raw[k] for k in ("f0", "f1")}),
        "float_ids": lambda: (dense, _bad(raw, f0=[[1.5], [2]])),
        "str_ids": lambda: (dense, _bad(raw, f0=["12", [2]])),
        "too_many": lambda: (dense, _bad(raw, f1=[[1], [1, 2, 3, 4]])),
        "out_of_range": lambda: (dense, _bad(raw, f2=[[20], [2]])),
        "negative": lambda: (dense, _bad(raw, f0=[[1], [-1]])),
        "dense_width": lambda: (dense[:, :3], raw),
        "samples": lambda: (dense, _bad(raw, f0=[[1]])),
    }[case]()
    with pytest.raises(ValueError, match=match):
        loaded(*bad)


def test_bad_kjt(loaded):
    dense = np.zeros((2, NUM_DENSE), np.float32)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        list(KEYS), [1, 2, 3, 4, 5, 6], [4, 0, 1, 0, 1, 0], capacities=8
    )
    with pytest.raises(InputError, match=r"feature 'f0' sample 0 has 4 ids; .* at most 3"):
        loaded(dense, kjt)
    with pytest.raises(InputError, match="missing feature"):
        loaded(dense, kjt.permute([0, 1]))


def test_kjt_look_alike_is_refused(loaded):
    # the loader reads a KeyedJaggedTensor by type, not by its method names
    class LooksLikeAKjt:
        def keys(self):
            return list(KEYS)

        def capacity_per_key(self):
            return (MAX_IDS,) * len(KEYS)

    dense = np.zeros((1, NUM_DENSE), np.float32)
    with pytest.raises(InputError, match="a dict .* or a KeyedJaggedTensor, got LooksLikeAKjt"):
        loaded(dense, LooksLikeAKjt())


def test_export_sets_lookups_of_collections_only(model, tmp_path):
    """export's copy runs the collections with XLA and IGNORE bounds checks; a module
    that is no collection keeps its own attributes, whatever their names."""
    from flax import nnx

    from jaxrec import BoundsCheckMode

    class Wrapper(nnx.Module):
        def __init__(self, inner):
            self.inner = inner
            self.table_configs = ()  # a user's own attributes, not a collection's
            self.implementation = "the wrapper's own"

        def __call__(self, dense, sparse):
            return self.inner(dense, sparse)

    seen = {}

    def apply_fn(m, dense, sparse):
        ebc = m.inner.sparse_arch.embedding_bag_collection
        seen.update(wrapper=m.implementation, ebc=(ebc.implementation, ebc.bounds_check_mode))
        return m(dense, sparse)

    dense, kjt, _ = make_batch(2)
    export(Wrapper(model), (dense, kjt), tmp_path / "w", apply_fn=apply_fn)
    assert seen == {"wrapper": "the wrapper's own", "ebc": ("xla", BoundsCheckMode.IGNORE)}


FRESH = """
import json, sys
import numpy as np
from jaxrec.inference import load
m = load(sys.argv[1])
raw = json.loads(sys.argv[2])
out = m(np.asarray(raw["dense"], np.float32), raw["sparse"])
# The model classes stay unimported. jaxrec/__init__ itself imports jaxrec.modules
# (the layers), so this path cannot avoid those; STANDALONE below shows they are unused.
assert "jaxrec.models" not in sys.modules, "the model classes were imported"
assert "jaxrec.jobs" not in sys.modules
print(json.dumps(out.tolist()))
"""

STANDALONE = """
import importlib.util, json, sys
import numpy as np
spec = importlib.util.spec_from_file_location("artifact", sys.argv[3])
artifact = importlib.util.module_from_spec(spec)
sys.modules["artifact"] = artifact
spec.loader.exec_module(artifact)
m = artifact.load(sys.argv[1])
raw = json.loads(sys.argv[2])
out = m(np.asarray(raw["dense"], np.float32), raw["sparse"])
assert "jaxrec.models" not in sys.modules and "jaxrec.modules" not in sys.modules
assert not any(name.startswith("jaxrec") for name in sys.modules), "jaxrec was imported"
print(json.dumps(out.tolist()))
"""

PLAIN_JAX = """
import json, sys
import jax, numpy as np
path = sys.argv[1]
man = json.load(open(f"{path}/manifest.json"))
exp = jax.export.deserialize(bytearray(open(f"{path}/module.jaxexport", "rb").read()))
npz = np.load(f"{path}/weights.npz")
w = [npz[x["name"]] for x in man["weights"]]
req = json.loads(sys.argv[2])
b = len(req["dense"])
caps = [man["max_ids_per_sample"][k] for k in man["features"]]
starts = np.cumsum([0] + caps)
values = np.zeros((b, starts[-1]), np.int32)
lengths = np.zeros((b, len(caps)), np.int32)
for k, key in enumerate(man["features"]):
    for i, ids in enumerate(req["sparse"][key]):
        values[i, starts[k]:starts[k] + len(ids)] = ids
        lengths[i, k] = len(ids)
out = exp.call(w, np.asarray(req["dense"], np.float32), values, lengths)
assert not any(m.startswith("jaxrec") for m in sys.modules)
print(json.dumps(np.asarray(out).tolist()))
"""


@pytest.mark.parametrize(
    "script", [FRESH, STANDALONE, PLAIN_JAX], ids=["jaxrec_load", "standalone", "plain_jax"]
)
def test_fresh_process_without_model_classes(loaded, artifact, script):
    dense, _, raw = make_batch(3, seed=7)
    expected = loaded(dense, raw)
    req = json.dumps({"dense": dense.tolist(), "sparse": raw})
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-c", script, str(artifact), req, ARTIFACT_PY],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.asarray(json.loads(proc.stdout.strip().splitlines()[-1]), np.float32)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_multi_platform_export(model, tmp_path):
    dense, kjt, raw = make_batch(2)
    manifest = export(model, (dense, kjt), tmp_path / "a", platforms=("cpu", "cuda"))
    assert manifest["platforms"] == ["cpu", "cuda"]
    m = load(tmp_path / "a")
    np.testing.assert_allclose(
        m(dense, raw), np.asarray(model(jnp.asarray(dense), kjt)), rtol=1e-5, atol=1e-6
    )
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export(model, (dense, kjt), tmp_path / "a")


@pytest.mark.parametrize("dtype", ["int8", "int4", "fp16", "bf16"])
def test_quantized_model_round_trip(model, tmp_path, dtype):
    from jaxrec.inference import quantize_inference_model

    q = quantize_inference_model(model, dtype=dtype, implementation="xla")
    dense, kjt, raw = make_batch(3)
    export(q, (dense, kjt), tmp_path / "q")
    expected = np.asarray(q(jnp.asarray(dense), kjt))
    np.testing.assert_allclose(load(tmp_path / "q")(dense, raw), expected, rtol=1e-5, atol=1e-6)


def test_cuda_only_artifact_refused_on_cpu(model, tmp_path):
    dense, kjt, _ = make_batch(2)
    export(model, (dense, kjt), tmp_path / "gpu", platforms=("cuda",), max_ids_per_sample=2)
    with pytest.raises(ValueError, match=r"exported for platforms \['cuda'\].*'cpu'"):
        load(tmp_path / "gpu")


def test_pallas_triton_call_is_refused_by_jax_export():
    """A Pallas Triton kernel lowers to a custom call jax.export will not serialize
    (no compatibility guarantee); disabling that one check lets it through."""
    from jaxrec.pallas.pooled import pooled_lookup

    args = (
        jnp.ones((64, 16), jnp.float32),
        jnp.arange(8, dtype=jnp.int32),
        jnp.array([0, 4], jnp.int32),
        jnp.array([4, 8], jnp.int32),
    )
    f = jax.jit(lambda w, r, s, e: pooled_lookup(w, r, s, e))
    with pytest.raises(ValueError, match="no compatibility guarantees"):
        jax.export.export(f, platforms=("cuda",))(*args)
    check = jax.export.DisabledSafetyCheck.custom_call(TRITON_TARGET)
    exp = jax.export.export(f, platforms=("cuda",), disabled_checks=[check])(*args)
    assert TRITON_TARGET in exp.mlir_module()


def test_pallas_export_is_refused(model, tmp_path):
    """The Triton kernels need static grids, and an artifact's batch is symbolic."""
    dense, kjt, _ = make_batch(2)
    with pytest.raises(ValueError, match="implementation='xla'"):
        export(model, (dense, kjt), tmp_path / "p", platforms=("cuda",), implementation="pallas")
    assert not (tmp_path / "p").exists()


def test_pallas_kernel_with_a_symbolic_batch_does_not_lower_for_cuda():
    """Why the refusal: if JAX learns dynamic Triton grids, this fails and export may allow it."""
    from jaxrec.pallas.pooled import pooled_lookup

    (b,) = jax.export.symbolic_shape("b")
    args = (
        jax.ShapeDtypeStruct((64, 16), jnp.float32),
        jax.ShapeDtypeStruct((8,), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
    )
    f = jax.jit(lambda w, r, s, e: pooled_lookup(w, r, s, e))
    check = jax.export.DisabledSafetyCheck.custom_call(TRITON_TARGET)
    with pytest.raises((NotImplementedError, ValueError), match="dynamic"):
        jax.export.export(f, platforms=("cuda",), disabled_checks=[check])(*args)
