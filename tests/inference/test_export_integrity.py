"""Export artifacts are verified on load: sha256 of every file and of every manifest
field, and the manifest's facts against the serialized module and the weights. Each
tampering class is caught with an error naming the file; an untampered artifact (and
an old one without checksums, with a warning) loads and predicts as before."""

import hashlib
import json
import shutil

import numpy as np
import pytest
from export_cases import KEYS, make_batch

from jaxrec.inference import ArtifactError, load
from jaxrec.inference.artifact import UnverifiedArtifactWarning


@pytest.fixture(scope="module")
def original(dlrm_artifact):
    path = dlrm_artifact
    dense, _, raw = make_batch(5, seed=11)
    return path, (dense, raw), load(path)(dense, raw)


@pytest.fixture
def art(original, tmp_path):
    shutil.copytree(original[0], tmp_path / "art")
    return tmp_path / "art"


def edit_manifest(path, change, reseal=False):
    m = json.loads((path / "manifest.json").read_text())
    change(m)
    if reseal:  # a consistent-looking edit: field checksums recomputed
        m["integrity"]["fields"] = {
            k: hashlib.sha256(
                json.dumps(v, sort_keys=True, separators=(",", ":")).encode()
            ).hexdigest()
            for k, v in m.items()
            if k != "integrity"
        }
    (path / "manifest.json").write_text(json.dumps(m, indent=1))


def flip_byte(file, where=0.5):
    data = bytearray(file.read_bytes())
    data[int(len(data) * where)] ^= 0x01
    file.write_bytes(bytes(data))


def test_untampered_artifact_loads_and_predicts_as_before(original, art):
    _, (dense, raw), expected = original
    np.testing.assert_array_equal(load(art)(dense, raw), expected)
    m = json.loads((art / "manifest.json").read_text())
    for name in ("module.jaxexport", "weights.npz"):
        digest = hashlib.sha256((art / name).read_bytes()).hexdigest()
        assert m["integrity"]["files"][name] == {
            "sha256": digest,
            "bytes": (art / name).stat().st_size,
        }


def _swap_features(m):
    m["features"] = [m["features"][1], m["features"][0], *m["features"][2:]]


def _shrink_table(m):
    m["num_embeddings"][KEYS[0]] -= 10


def _drop_last_feature(m):
    last = m["features"].pop()
    del m["max_ids_per_sample"][last], m["num_embeddings"][last]


def _other_weights(path):
    with np.load(path / "weights.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    rng = np.random.default_rng(0)
    arrays = {k: (v + rng.standard_normal(v.shape)).astype(v.dtype) for k, v in arrays.items()}
    np.savez(path / "weights.npz", **arrays)


TAMPER = {
    "feature_order_swapped": (
        lambda p: edit_manifest(p, _swap_features),
        r"manifest.json: field 'features' differs",
    ),
    "table_size_edited": (
        lambda p: edit_manifest(p, _shrink_table),
        r"manifest.json: field 'num_embeddings' differs",
    ),
    "field_added": (
        lambda p: edit_manifest(p, lambda m: m.update(extra=1)),
        r"manifest.json: field\(s\) \['extra'\] have no checksum",
    ),
    "weights_replaced_same_shape": (
        _other_weights,
        r"weights.npz: sha256 [0-9a-f]{12}\.* but the manifest records [0-9a-f]{12}",
    ),
    "module_byte_flipped": (
        lambda p: flip_byte(p / "module.jaxexport"),
        r"module.jaxexport: sha256 .* but the manifest records",
    ),
    "weights_byte_flipped": (
        lambda p: flip_byte(p / "weights.npz", 0.9),
        r"weights.npz: sha256 .* but the manifest records",
    ),
    "weights_truncated": (
        lambda p: (p / "weights.npz").write_bytes((p / "weights.npz").read_bytes()[:-10]),
        r"weights.npz: .* bytes but the manifest records",
    ),
    "checksums_removed": (
        lambda p: edit_manifest(p, lambda m: m.pop("integrity")),
        r"manifest.json: no 'integrity' section",
    ),
    "manifest_not_json": (
        lambda p: (p / "manifest.json").write_text("{oops"),
        r"manifest.json is not valid JSON",
    ),
    # Edits with the field checksums recomputed: the manifest's facts are still
    # checked against the module and the weights.
    "resealed_dense_width": (
        lambda p: edit_manifest(p, lambda m: m.update(num_dense=m["num_dense"] + 1), True),
        r"module.jaxexport: takes dense features \[b, 4\] float32; manifest.json says num_dense=5",
    ),
    "resealed_max_ids": (
        lambda p: edit_manifest(p, lambda m: m["max_ids_per_sample"].update({KEYS[0]: 4}), True),
        r"module.jaxexport: takes 9 id slots per sample; manifest.json's max_ids_per_sample sum "
        "to 10",
    ),
    "resealed_feature_dropped": (
        lambda p: edit_manifest(p, _drop_last_feature, True),
        r"module.jaxexport: takes lengths for 3 features; manifest.json lists 2",
    ),
    "resealed_weight_shape": (
        lambda p: edit_manifest(p, lambda m: m["weights"][0].update(shape=[1, 2, 3]), True),
        r"weight w0000 .*: manifest.json says \[1, 2, 3\] .*module.jaxexport takes",
    ),
    "resealed_output": (
        lambda p: edit_manifest(p, lambda m: m["output"].update(shape=["batch", 2]), True),
        r"module.jaxexport: returns \[b, 1\] float32; manifest.json says",
    ),
}


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_tampered_artifact_is_refused(art, case):
    tamper, match = TAMPER[case]
    tamper(art)
    with pytest.raises(ArtifactError, match=match) as info:
        load(art)
    msg = str(info.value)
    assert str(art) in msg
    assert "modified or corrupted" in msg and "re-export" in msg


def test_old_artifact_without_checksums_loads_with_a_warning(original, art):
    _, (dense, raw), expected = original
    edit_manifest(art, lambda m: (m.pop("integrity"), m.update(format="jaxrec.export/1")))
    with pytest.warns(UnverifiedArtifactWarning, match="no checksums.*re-export"):
        model = load(art)
    np.testing.assert_array_equal(model(dense, raw), expected)
    # the facts are still checked against the module and the weights
    edit_manifest(art, lambda m: m.update(num_dense=m["num_dense"] + 1))
    with pytest.warns(UnverifiedArtifactWarning), pytest.raises(ArtifactError, match="num_dense"):
        load(art)
