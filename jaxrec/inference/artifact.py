"""Load and run an exported artifact without the model's Python code.

This module imports only ``jax``, ``numpy`` and the standard library (no
``jaxrec`` module: it also loads on its own, by file path, where jaxrec is
not installed; ``import jaxrec.inference`` runs ``jaxrec/__init__``, which
imports the layers in ``jaxrec.modules``, though never the model classes of
``jaxrec.models``). The forward pass is the
deserialized ``jax.export`` module (see :mod:`jaxrec.inference.export` for
the artifact layout and its per-sample input layout), the weights are
one ``.npz`` file. Inputs are validated on the host, so a bad request gets a
:class:`InputError` (a ``ValueError``) naming the feature and the limit,
never a silent wrong answer: in particular ids outside ``[0, num_embeddings)``
are rejected here, because the exported lookup drops them (bounds checks in
the compiled module cannot report). Features read through managed collision
(manifest ``"raw_id_features"``) take raw ids instead: any int32, or, in an
artifact of 64-bit ids (``"ids_dtype": "uint32x2"``), any int64 or uint64,
which the loader packs into ``uint32[..., 2]`` id words.

The artifact is verified before use: the sha256 of the module, of the weights
and of every manifest field must match those recorded at export, and the
manifest's facts must match the module's input/output types and the weights
present; otherwise :class:`ArtifactError` names the file and what differs.
An artifact from before checksums (``jaxrec.export/1``) loads with an
:class:`UnverifiedArtifactWarning` rather than an error, so that a deployed
artifact whose model is gone keeps working; re-export it to add checksums.
The fact checks apply to it too. Checksums stored beside the data catch
corruption and careless edits, not a deliberate forgery (that needs a
signature over the files).

Batch sizes are rounded up to a bucket (powers of two by default) with empty
padding samples, so a stream of requests of varying sizes compiles a handful
of times: the artifact's batch dimension is symbolic, but XLA compiles once
per concrete shape.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypeGuard

import jax
import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:  # not at run time: this module loads without jaxrec (see _is_kjt)
    from ..sparse import KeyedJaggedTensor

FORMAT = "jaxrec.export/2"  # /2 adds the "integrity" section
WIDE_IDS = "uint32x2"  # manifest "ids_dtype" of 64-bit ids as id words (values [b, C, 2])
ID32 = (-(2**31), 2**31)  # raw ids of the int32 layout, [lo, hi)
ID64 = (-(2**63), 2**64)  # raw ids of the id-word layout: int64 or uint64
_MASK64 = 2**64 - 1
LEGACY_FORMATS = ("jaxrec.export/1",)
MANIFEST = "manifest.json"
MODULE = "module.jaxexport"
WEIGHTS = "weights.npz"

# {feature: ids per sample} or a KeyedJaggedTensor (see ExportedModel)
SparseInput: TypeAlias = "Mapping[str, Sequence] | KeyedJaggedTensor"


class InputError(ValueError):
    """An invalid prediction input (unknown/missing feature, wrong type, too many ids...)."""


class ArtifactError(ValueError):
    """An artifact whose files fail their checksums or disagree with each other."""


class UnverifiedArtifactWarning(UserWarning):
    """An artifact from before checksums (format ``jaxrec.export/1``) was loaded unverified."""


def load(
    path: str | os.PathLike,
    *,
    batch_buckets: str | Sequence[int] | None = "pow2",
    max_batch_size: int | None = None,
) -> ExportedModel:
    """Loads an artifact written by :func:`jaxrec.inference.export`.

    Args:
        path: the artifact directory.
        batch_buckets: ``"pow2"`` pads each batch to the next power of two,
            a sequence of sizes pads to the smallest that fits (a larger batch
            is an error), ``None`` runs every batch size as is.
        max_batch_size: reject larger batches (default: no limit, or the
            largest bucket).

    Returns:
        An :class:`ExportedModel`: ``model(dense, sparse) -> np.ndarray``.

    Raises:
        ArtifactError: a file fails its checksum or the files disagree (the
            artifact was modified or corrupted: re-export it).
        ValueError: an unknown format, or a platform/JAX version it was not
            exported for.

    Example:
        >>> predict = load("/tmp/dlrm_artifact")
        >>> predict([[0.1] * 13, [0.2] * 13], {"f1": [[1, 2], []], "f2": [[3], [4]]})
    """
    return ExportedModel(path, batch_buckets=batch_buckets, max_batch_size=max_batch_size)


class ExportedModel:
    """A loaded artifact; call it with dense features and sparse features.

    ``sparse`` is either a raw dict ``{feature: [ids of sample 0, ids of
    sample 1, ...]}`` or a ``KeyedJaggedTensor`` (any key order, host or device
    arrays). ``dense`` is ``[B, num_dense]`` (nested lists or an array).
    Returns the model output ``[B, ...]`` as a numpy array.
    """

    def __init__(
        self,
        path,
        *,
        batch_buckets: str | Sequence[int] | None = "pow2",
        max_batch_size: int | None = None,
    ):
        self.path = Path(path)
        if not (self.path / MANIFEST).is_file():
            raise FileNotFoundError(f"{self.path} is not an export artifact (no {MANIFEST})")
        self.manifest = read_manifest(self.path)
        verify_checksums(self.path, self.manifest)
        _check_runtime(self.manifest, self.path)
        m = self.manifest
        self.features: tuple[str, ...] = tuple(m["features"])
        self.max_ids = tuple(int(m["max_ids_per_sample"][k]) for k in self.features)
        self.num_embeddings = tuple(int(m["num_embeddings"][k]) for k in self.features)
        self.wide_ids = m.get("ids_dtype", "int32") == WIDE_IDS
        raw = set(m.get("raw_id_features", ()))
        self.raw_ids = tuple(k in raw for k in self.features)
        # ids allowed per feature, [lo, hi): a table's rows, or raw ids (managed
        # collision) of the layout's width
        self.id_bounds = tuple(
            (ID64 if self.wide_ids else ID32) if r else (0, n)
            for r, n in zip(self.raw_ids, self.num_embeddings, strict=True)
        )
        self.starts = np.concatenate([[0], np.cumsum(self.max_ids)]).astype(np.int64)
        self.num_dense = int(m["num_dense"])
        self.dense_dtype = np.dtype(jax.numpy.dtype(m["dense_dtype"]))
        self.weighted = bool(m["weighted"])
        self.buckets: Literal["pow2"] | tuple[int, ...] | None = _buckets(batch_buckets)
        self.max_batch_size = max_batch_size
        if max_batch_size is None and self.buckets and self.buckets != "pow2":
            self.max_batch_size = max(self.buckets)
        try:
            self.exported = jax.export.deserialize(bytearray((self.path / MODULE).read_bytes()))
        except Exception as e:
            raise _tampered(self.path, MODULE, f"does not deserialize ({e!r:.200})") from e
        with np.load(self.path / WEIGHTS, allow_pickle=False) as npz:
            check_facts(self.path, m, self.exported, npz)
            self._weights = [jax.device_put(_load_leaf(self.path, npz, w)) for w in m["weights"]]
        self._call = jax.jit(self.exported.call)
        self._lock = threading.Lock()
        self.compiled_batch_sizes: set[int] = set()

    def __repr__(self) -> str:
        return (
            f"ExportedModel({str(self.path)!r}, features={list(self.features)}, "
            f"num_dense={self.num_dense}, output={self.manifest['output']})"
        )

    # ----- calling -----
    def __call__(
        self, dense: npt.ArrayLike, sparse: SparseInput, weights: Mapping | None = None
    ) -> np.ndarray:
        """Predictions ``[B, ...]`` for a batch (see the class docstring)."""
        return self.run(*self.prepare(dense, sparse, weights))

    def prepare(
        self, dense: npt.ArrayLike, sparse: SparseInput, weights: Mapping | None = None
    ) -> tuple:
        """Validated per-sample arrays ``(dense, values, lengths[, weights])``."""
        d = self._dense(dense)
        b = d.shape[0]
        if _is_kjt(sparse):
            if weights is not None:
                raise InputError("a KeyedJaggedTensor carries its own weights; pass weights=None")
            arrays = self._from_kjt(sparse, b)
        elif isinstance(sparse, Mapping):
            arrays = self._from_dict(sparse, b, weights)
        else:
            raise InputError(
                "sparse features must be a dict {feature: [ids per sample]} or a "
                f"KeyedJaggedTensor, got {type(sparse).__name__}"
            )
        return (d, *arrays)

    def run(self, dense, values, lengths, weights=None) -> np.ndarray:
        """Runs prepared per-sample arrays, padded to the batch bucket."""
        b = dense.shape[0]
        if self.max_batch_size is not None and b > self.max_batch_size:
            raise InputError(f"batch of {b} samples exceeds max_batch_size={self.max_batch_size}")
        if b == 0:
            return np.zeros((0, *self.manifest["output"]["shape"][1:]), np.float32)
        padded = self._bucket(b)
        args = [dense, values, lengths] + ([weights] if self.weighted else [])
        if padded != b:
            args = [
                np.concatenate([a, np.zeros((padded - b, *a.shape[1:]), a.dtype)]) for a in args
            ]
        with self._lock:
            self.compiled_batch_sizes.add(padded)
        out = self._call(self._weights, *args)
        return np.asarray(out)[:b]

    # ----- input conversion -----
    def _dense(self, dense: npt.ArrayLike) -> np.ndarray:
        try:
            d = np.asarray(dense, dtype=self.manifest["dense_dtype"])
        except (TypeError, ValueError) as e:
            raise InputError(f"dense features must be numbers [B, {self.num_dense}]: {e}") from None
        if d.ndim != 2 or d.shape[1] != self.num_dense:
            raise InputError(
                f"dense features must be [B, {self.num_dense}] (num_dense={self.num_dense}), "
                f"got shape {d.shape}"
            )
        return d

    def check_features(self, keys: Sequence[str]) -> None:
        unknown = [k for k in keys if k not in self.features]
        if unknown:
            raise InputError(
                f"unknown feature(s) {unknown}; this model's features are {list(self.features)}"
            )
        missing = [k for k in self.features if k not in keys]
        if missing:
            raise InputError(
                f"missing feature(s) {missing}: give every feature for every sample "
                "(an empty id list for none)"
            )

    def _from_dict(self, sparse: Mapping, b: int, weights: Mapping | None) -> tuple:
        self.check_features(list(sparse))
        if self.weighted and weights is None:
            raise InputError("this model reads weighted features: pass weights={feature: [...]}")
        if weights is not None and not self.weighted:
            raise InputError("this model reads unweighted features; pass weights=None")
        values = empty_values(self, b)
        lengths = np.zeros((b, len(self.features)), np.int32)
        wts = np.zeros((b, int(self.starts[-1])), np.float32) if self.weighted else None
        for k, key in enumerate(self.features):
            samples = sparse[key]
            if not isinstance(samples, Sequence) or isinstance(samples, str | bytes):
                raise InputError(
                    f"feature {key!r} must be a list with one id list per sample, "
                    f"got {type(samples).__name__}"
                )
            if len(samples) != b:
                raise InputError(
                    f"feature {key!r} has {len(samples)} samples but dense features have {b}"
                )
            w_samples = None
            if wts is not None:
                w_samples = weights.get(key) if isinstance(weights, Mapping) else None
                if w_samples is None or len(w_samples) != b:
                    raise InputError(f"weights[{key!r}] must be a list of {b} weight lists")
            for i, ids in enumerate(samples):
                arr = self._ids(key, k, i, ids)
                n, lo = arr.shape[0], int(self.starts[k])
                values[i, lo : lo + n] = arr
                lengths[i, k] = n
                if wts is not None and w_samples is not None:  # checked above
                    w = np.asarray(w_samples[i], np.float32).reshape(-1)
                    if w.shape[0] != n:
                        raise InputError(
                            f"feature {key!r} sample {i}: {w.shape[0]} weights for {n} ids"
                        )
                    wts[i, lo : lo + n] = w
        return (values, lengths) + ((wts,) if wts is not None else ())

    def _ids(self, key: str, k: int, i: int, ids: object) -> np.ndarray:
        where = f"feature {key!r} sample {i}"
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence | np.ndarray):
            raise InputError(f"{where}: ids must be a list of integers, got {type(ids).__name__}")
        if isinstance(ids, np.ndarray):
            arr = ids
            if arr.size and (arr.ndim != 1 or arr.dtype.kind not in "iu"):
                raise InputError(
                    f"{where}: ids must be a flat list of integers, got dtype {arr.dtype.name} "
                    f"shape {arr.shape}"
                )
        else:
            bad = next((x for x in ids if not _is_int(x)), None)
            if isinstance(bad, bool | np.bool_):
                raise InputError(f"{where}: ids must be integers, got a bool")
            if bad is not None:
                what = (
                    f"dtype {np.asarray(bad).dtype.name}"
                    if isinstance(bad, float | complex | np.number)
                    else type(bad).__name__
                )
                raise InputError(
                    f"{where}: ids must be a flat list of integers, got {what} {bad!r:.40}"
                )
            try:
                arr = np.asarray(ids, np.int64).reshape(-1)
            except OverflowError:  # past int64 (uint64, or too wide: the check says)
                arr = np.array([int(x) for x in ids], dtype=object)
        if not arr.size:
            arr = np.zeros((0,), np.int64)
        self._check_ids(key, k, arr, where, arr.shape[0])
        return pack_ids(arr, self.wide_ids)

    def _check_ids(self, key: str, k: int, ids: np.ndarray, where: str, count: int) -> None:
        limit = self.max_ids[k]
        if count > limit:
            raise InputError(
                f"{where} has {count} ids; this artifact allows at most {limit} "
                f"(max_ids_per_sample[{key!r}] = {limit})"
            )
        if ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            first, end = self.id_bounds[k]
            if lo < first or hi >= end:
                raise InputError(f"{where}: {id_range_error(self, k, lo if lo < first else hi)}")

    def _from_kjt(self, kjt: KeyedJaggedTensor, b: int) -> tuple:
        keys = list(kjt.keys())
        self.check_features(keys)
        if kjt.stride() != b:
            raise InputError(f"the KJT has batch size {kjt.stride()} but dense features have {b}")
        all_vals = np.asarray(kjt.values())
        if all_vals.ndim == 2 and all_vals.shape[1] == 2 and all_vals.dtype == np.uint32:
            all_vals = _from_words(all_vals)  # id words: as int64 (uint64 past 2**63)
        if all_vals.ndim != 1 or all_vals.dtype.kind not in "iu":
            raise InputError(
                "KJT values must be integer ids or uint32[N, 2] id words, got dtype "
                f"{all_vals.dtype.name} shape {all_vals.shape}"
            )
        all_lens = np.asarray(kjt.lengths()).reshape(len(keys), b)
        offs = kjt.capacity_offsets()
        w_all = kjt.weights_or_none()
        if self.weighted != (w_all is not None):
            need = "weighted" if self.weighted else "unweighted"
            raise InputError(f"this model reads {need} features; the KJT does not match")
        w_all = None if w_all is None else np.asarray(w_all, np.float32)
        values = empty_values(self, b)
        lengths = np.zeros((b, len(self.features)), np.int32)
        wts = np.zeros((b, int(self.starts[-1])), np.float32) if self.weighted else None
        for k, key in enumerate(self.features):
            j = keys.index(key)
            lens = all_lens[j].astype(np.int64)
            if (lens < 0).any():
                raise InputError(f"feature {key!r}: negative lengths")
            n = int(lens.sum())
            if n > offs[j + 1] - offs[j]:
                raise InputError(f"feature {key!r}: lengths sum {n} exceeds its KJT capacity")
            ids = all_vals[offs[j] : offs[j] + n]
            worst = int(np.argmax(lens)) if b else 0
            self._check_ids(
                key, k, ids, f"feature {key!r} sample {worst}", int(lens.max(initial=0))
            )
            row = np.repeat(np.arange(b), lens)
            col = np.arange(n) - np.repeat(np.cumsum(lens) - lens, lens) + int(self.starts[k])
            values[row, col] = pack_ids(ids, self.wide_ids)
            lengths[:, k] = lens
            if wts is not None and w_all is not None:  # both or neither: checked above
                wts[row, col] = w_all[offs[j] : offs[j] + n]
        return (values, lengths) + ((wts,) if wts is not None else ())

    def _bucket(self, b: int) -> int:
        if not self.buckets:
            return b
        if self.buckets == "pow2":
            return 1 << (b - 1).bit_length()
        fits = [s for s in self.buckets if s >= b]
        if not fits:
            raise InputError(f"batch of {b} samples exceeds the largest bucket {max(self.buckets)}")
        return min(fits)


def _is_int(x: object) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def empty_values(model: ExportedModel, b: int) -> np.ndarray:
    """Zero ``values`` for ``b`` samples: ``[b, C]`` int32, or ``[b, C, 2]`` uint32 words."""
    c = int(model.starts[-1])
    return np.zeros((b, c, 2), np.uint32) if model.wide_ids else np.zeros((b, c), np.int32)


def pack_ids(ids: npt.ArrayLike, wide: bool) -> np.ndarray:
    """Checked integer ids (numpy, or Python ints as an object array) as the layout's
    values: int32 ``[N]``, or ``uint32[N, 2]`` id words (low word first; signed ids as
    two's complement, unsigned by value), as ``jaxrec.sparse.ids64.to_id_words``."""
    a = np.asarray(ids)
    if not wide:
        return a.astype(np.int32)
    if a.dtype == object:
        u = np.array([int(x) & _MASK64 for x in a], np.uint64)
    elif a.dtype.kind == "i":
        u = a.astype(np.int64).view(np.uint64)
    else:
        u = a.astype(np.uint64)
    return np.stack([u & np.uint64(0xFFFFFFFF), u >> np.uint64(32)], axis=-1).astype(np.uint32)


def _from_words(words: np.ndarray) -> np.ndarray:
    """``uint32[N, 2]`` id words as host ids: int64, or uint64 if any is past ``2**63 - 1``."""
    u = (words[:, 1].astype(np.uint64) << np.uint64(32)) | words[:, 0].astype(np.uint64)
    return u if u.size and int(u.max()) >= 2**63 else u.view(np.int64)


def id_range_error(model: ExportedModel, k: int, bad: int) -> str:
    """Why id ``bad`` of feature ``k`` is refused (bounds: ``model.id_bounds[k]``)."""
    key, (lo, hi) = model.features[k], model.id_bounds[k]
    if not model.raw_ids[k]:
        return f"id {bad} is outside [0, {hi}) (num_embeddings of the table reading {key!r})"
    if model.wide_ids:
        return (
            f"id {bad} does not fit 64 bits; raw ids of {key!r} (a managed-collision "
            f"feature) are int64 or uint64, in [{lo}, {hi})"
        )
    return (
        f"id {bad} does not fit int32; this artifact takes int32 ids (export it with a "
        "batch of uint32[C, 2] id words, jaxrec.sparse.ids64.to_id_words, for 64-bit ids)"
    )


def _buckets(spec) -> Literal["pow2"] | tuple[int, ...] | None:
    if spec is None:
        return None
    if spec == "pow2":
        return "pow2"
    if isinstance(spec, str):
        raise ValueError(f"batch_buckets must be 'pow2', None or a list of sizes, got {spec!r}")
    sizes = tuple(sorted({int(s) for s in spec}))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch_buckets must be positive sizes, got {list(spec)}")
    return sizes


def _platform() -> str:
    p = jax.default_backend()
    return "cuda" if p == "gpu" else p


def _check_runtime(m: Mapping, path: Path) -> None:
    here = _platform()
    if here not in m["platforms"]:
        raise ValueError(
            f"{path} was exported for platforms {m['platforms']}, but this JAX runs on "
            f"{here!r}; re-export with platforms=(..., {here!r})"
        )
    if not m.get("portable", True) and m["jax_version"] != jax.__version__:
        raise ValueError(
            f"{path} holds {m['implementation']} custom calls that only load on the JAX "
            f"version that exported them ({m['jax_version']}); this is {jax.__version__}. "
            "Re-export, or export with implementation='xla' (portable)"
        )


# ----- integrity -----
def field_checksum(value: Any) -> str:
    """sha256 of a manifest field's canonical JSON."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def file_checksum(path: Path) -> dict:
    """``{"sha256": hex, "bytes": size}`` of a file (read in chunks)."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"sha256": digest, "bytes": path.stat().st_size}


def integrity_section(path: Path, manifest: Mapping) -> dict:
    """What :func:`export` records: checksums of the module, the weights and every field."""
    return {
        "algorithm": "sha256",
        "files": {name: file_checksum(path / name) for name in (MODULE, WEIGHTS)},
        "fields": {k: field_checksum(v) for k, v in manifest.items() if k != "integrity"},
    }


def _tampered(path: Path, name: str, what: str) -> ArtifactError:
    return ArtifactError(
        f"{path / name}: {what}. The artifact was modified or corrupted after export: "
        "re-export the model (or restore the artifact from a good copy)"
    )


def read_manifest(path: Path) -> dict:
    """The parsed ``manifest.json`` of a known format (raises :class:`ArtifactError`)."""
    try:
        m = json.loads((path / MANIFEST).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(
            f"{path / MANIFEST} is not valid JSON ({e}). The artifact was modified or "
            "corrupted after export: re-export the model"
        ) from None
    fmt = m.get("format") if isinstance(m, dict) else None
    if fmt != FORMAT and fmt not in LEGACY_FORMATS:
        raise ValueError(
            f"{path}: unknown artifact format {fmt!r}, expected {FORMAT!r} (or {LEGACY_FORMATS})"
        )
    return m


def verify_checksums(path: Path, m: Mapping) -> None:
    """Checks every manifest field and file against the checksums recorded at export.

    A legacy artifact (``jaxrec.export/1``, no checksums) only warns
    (:class:`UnverifiedArtifactWarning`); its facts are still checked against
    the module and the weights by :func:`check_facts`.
    """
    if m["format"] in LEGACY_FORMATS:
        warnings.warn(
            f"{path} has no checksums (format {m['format']!r}, from an older jaxrec): its "
            "files are loaded unverified; re-export the model to add them",
            UnverifiedArtifactWarning,
            stacklevel=4,
        )
        return
    sums = m.get("integrity")
    if not isinstance(sums, dict) or not isinstance(sums.get("fields"), dict):
        raise _tampered(path, MANIFEST, "no 'integrity' section (checksums) in a /2 manifest")
    fields = {k: v for k, v in m.items() if k != "integrity"}
    extra = sorted(set(fields) - set(sums["fields"]))
    if extra:
        raise _tampered(path, MANIFEST, f"field(s) {extra} have no checksum")
    for k, digest in sums["fields"].items():
        if k not in fields:
            raise _tampered(path, MANIFEST, f"field {k!r} is missing")
        if field_checksum(fields[k]) != digest:
            raise _tampered(path, MANIFEST, f"field {k!r} differs from what was exported")
    files = sums.get("files")
    if not isinstance(files, dict) or set(files) != {MODULE, WEIGHTS}:
        raise _tampered(path, MANIFEST, f"'integrity.files' must list {[MODULE, WEIGHTS]}")
    for name, want in files.items():
        if not (path / name).is_file():
            raise _tampered(path, name, "missing")
        size = (path / name).stat().st_size
        if size != want.get("bytes"):
            raise _tampered(
                path, name, f"{size} bytes but the manifest records {want.get('bytes')}"
            )
        got = file_checksum(path / name)["sha256"]
        if got != want.get("sha256"):
            raise _tampered(
                path,
                name,
                f"sha256 {got[:12]}... but the manifest records {str(want.get('sha256'))[:12]}...",
            )


def _shape(aval: Any) -> str:
    dims = ", ".join(str(d) for d in aval.shape)
    return f"[{dims}] {np.dtype(aval.dtype).name}"


def check_facts(
    path: Path, m: Mapping, exported: jax.export.Exported, npz: np.lib.npyio.NpzFile
) -> None:
    """The manifest's facts against the module's input/output types and the weights.

    Raises:
        ArtifactError: naming the file and what differs.
    """
    feats = m["features"]
    if len(set(feats)) != len(feats):
        raise _tampered(path, MANIFEST, f"features repeat: {feats}")
    for key in ("max_ids_per_sample", "num_embeddings"):
        if sorted(m[key]) != sorted(feats):
            raise _tampered(path, MANIFEST, f"{key} names {sorted(m[key])}, features {feats}")
    ws = m["weights"]
    ins = exported.in_avals
    n_args = 3 + bool(m["weighted"])
    if len(ins) != len(ws) + n_args:
        raise _tampered(
            path,
            MODULE,
            f"takes {len(ins)} inputs; {MANIFEST} lists {len(ws)} weights + {n_args} inputs "
            f"(weighted={m['weighted']})",
        )
    names = sorted(npz.files)
    if names != sorted(w["name"] for w in ws):
        raise _tampered(path, WEIGHTS, f"holds {names}; {MANIFEST} lists {[w['name'] for w in ws]}")
    for w, aval in zip(ws, ins, strict=False):
        said = f"[{', '.join(str(d) for d in w['shape'])}] {w['dtype']}"
        if said != _shape(aval):
            raise _tampered(
                path,
                MANIFEST,
                f"weight {w['name']} ({w['path']}): {MANIFEST} says {said}, {MODULE} takes "
                f"{_shape(aval)}",
            )
    dense, values, lengths = ins[len(ws) : len(ws) + 3]
    if dense.shape[1] != m["num_dense"] or np.dtype(dense.dtype).name != m["dense_dtype"]:
        raise _tampered(
            path,
            MODULE,
            f"takes dense features {_shape(dense)}; {MANIFEST} says num_dense={m['num_dense']} "
            f"{m['dense_dtype']}",
        )
    if lengths.shape[1] != len(feats):
        raise _tampered(
            path,
            MODULE,
            f"takes lengths for {lengths.shape[1]} features; {MANIFEST} lists {len(feats)}",
        )
    slots = sum(int(m["max_ids_per_sample"][k]) for k in feats)
    wide = m.get("ids_dtype", "int32") == WIDE_IDS
    layout = ([2], "uint32") if wide else ([], "int32")
    if ([int(d) for d in values.shape[2:]], np.dtype(values.dtype).name) != layout:
        raise _tampered(
            path,
            MODULE,
            f"takes id values {_shape(values)}; {MANIFEST} says ids_dtype={m.get('ids_dtype')!r}",
        )
    if values.shape[1] != slots:
        raise _tampered(
            path,
            MODULE,
            f"takes {values.shape[1]} id slots per sample; {MANIFEST}'s max_ids_per_sample "
            f"sum to {slots}",
        )
    out, said = exported.out_avals[0], m["output"]
    if [int(d) for d in out.shape[1:]] != list(said["shape"][1:]) or np.dtype(
        out.dtype
    ).name != said["dtype"]:
        raise _tampered(
            path, MODULE, f"returns {_shape(out)}; {MANIFEST} says {said['shape']} {said['dtype']}"
        )
    if list(exported.platforms) != list(m["platforms"]):
        raise _tampered(
            path,
            MODULE,
            f"is lowered for {list(exported.platforms)}; {MANIFEST} says {m['platforms']}",
        )


def _load_leaf(path: Path, npz: np.lib.npyio.NpzFile, w: Mapping) -> np.ndarray:
    arr = npz[w["name"]]
    dtype = np.dtype(jax.numpy.dtype(w["dtype"]))
    if arr.dtype != dtype and arr.dtype.itemsize == dtype.itemsize:  # e.g. bfloat16 as uint16
        arr = arr.view(dtype)
    if arr.dtype != dtype or list(arr.shape) != list(w["shape"]):
        raise _tampered(
            path,
            WEIGHTS,
            f"weight {w['name']} ({w['path']}) is {list(arr.shape)} {arr.dtype.name}; "
            f"{MANIFEST} says {w['shape']} {w['dtype']}",
        )
    return arr


def _is_kjt(x: object) -> TypeGuard[KeyedJaggedTensor]:
    """``isinstance(x, jaxrec.sparse.KeyedJaggedTensor)`` without importing jaxrec (this
    module also loads on its own): a KeyedJaggedTensor exists only once its module has
    been imported."""
    module = sys.modules.get("jaxrec.sparse.keyed_jagged_tensor")
    return module is not None and isinstance(x, module.KeyedJaggedTensor)
