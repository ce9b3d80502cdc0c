"""Export a model to a ``jax.export`` artifact: StableHLO with a symbolic batch size.

An artifact is a directory::

    manifest.json       features, per-sample id limits, table sizes, dense width,
                        dtypes, output shape, jax version, platforms, weight files,
                        and "integrity": sha256 of the two files below and of
                        every other manifest field
    module.jaxexport    jax.export.export(...).serialize(): the forward pass,
                        weight-independent (weights are arguments)
    weights.npz         the weights, one array per state leaf (w0000, w0001, ... in
                        the module's argument order; non-numpy dtypes such as
                        bfloat16 stored as same-width unsigned ints; PRNG keys as
                        their uint32 key data, "key_impl" in their manifest entry)

**The symbolic batch and ragged ids.** A ``KeyedJaggedTensor``'s per-key
capacities are static Python ints, and its helpers do host-side (numpy)
arithmetic on them, so a KJT cannot have a symbolic stride or capacity. The
exported function therefore takes a *per-sample* layout and maps the model
over the batch with ``jax.vmap``: for a symbolic batch ``b`` its inputs are ::

    dense    [b, num_dense]   float32
    values   [b, C]           int32    C = sum(max_ids_per_sample); feature k owns
                                       columns [start_k, start_k + max_ids_k),
                                       its ids packed at the front of that slot
          or [b, C, 2]        uint32   64-bit ids as id words (lo, hi), when the
                                       example KJT's values are id words
                                       (manifest "ids_dtype": "uint32x2")
    lengths  [b, F]           int32    ids per sample and feature (<= max_ids_k)
    weights  [b, C]           float32  only for weighted collections

and inside the vmapped body each sample is a KJT of stride 1 with the static
capacities ``max_ids_per_sample``. This is ``capacity = b * max_ids[key]``
(the training data path's scheme, DESIGN section 1) with the batch factored
out, so every shape is either static or ``b``. The model must treat samples
independently (true of DLRM, DCN, DeepFM, towers at inference; not of
anything that mixes samples, e.g. batch norm in training mode, in-batch
negatives). ``max_ids_per_sample`` defaults to the example batch's
``ceil(capacity_k / B)``; the loader rejects a sample with more ids.

**Kernels.** Export forces ``implementation="xla"`` on every embedding
collection: the XLA path lowers to plain StableHLO ops that ``jax.export``
guarantees to load on later JAX versions and on any listed platform. The
Pallas Triton kernels lower to a ``stablehlo.custom_call
@__gpu$xla.gpu.triton`` carrying Triton IR bytecode, which ``jax.export``
refuses to serialize ("custom calls whose targets have no compatibility
guarantees"), and need static grids while the batch is symbolic here, so
``implementation="pallas"`` is refused. Bounds checking is set to ``IGNORE`` (the WARNING/FATAL
modes use a host callback, which cannot be serialized); the loader checks ids
against ``num_embeddings`` on the host instead.

**Managed collision (dynamic and MCH tables).** Export runs on a copy in eval
mode (``model.eval()``, and ``deterministic=True`` set on every managed-collision
module and wrapper): the artifact remaps ids through the index held in the
modules' ``MCState`` variables, which are weights like any other, and never
admits or evicts. The reset key of a managed-collision wrapper (a PRNG key leaf)
is passed as its key data and re-wrapped in the function. Features read through
managed collision take raw ids, so the loader checks them against the layout's
integer range (int32, or 64 bits for id words), not ``num_embeddings``
(manifest ``"raw_id_features"``).

One artifact serves every batch size, but XLA still compiles once per
concrete batch size at load time: callers pad to a few sizes (the loader
rounds up to powers of two by default).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..datasets import Batch
from ..embedding import EmbeddingCollectionInterface
from ..modules import (
    HashZchManagedCollisionModule,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    MCHManagedCollisionModule,
)
from ..sparse import KeyedJaggedTensor
from ..sparse.ids64 import is_wide
from ..xla.bounds import BoundsCheckMode
from .artifact import FORMAT, MANIFEST, MODULE, WEIGHTS, integrity_section
from .quant_modules import QuantStorage

TRITON_TARGET = "__gpu$xla.gpu.triton"
# The modules whose lookups export sets (implementation, bounds checks) and whose
# tables bound the ids: every collection with trainable tables (the contract) and
# the unsharded quantized ones (inference-only, outside the contract).
COLLECTIONS = (EmbeddingCollectionInterface, QuantStorage)
# The modules whose mode flag export sets to eval (``deterministic=True``).
MANAGED = (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    HashZchManagedCollisionModule,
    MCHManagedCollisionModule,
)


def export(
    model: nnx.Module,
    example_batch: Any,
    path: str | os.PathLike,
    *,
    max_ids_per_sample: Mapping[str, int] | int | None = None,
    apply_fn: Callable[[nnx.Module, jax.Array, KeyedJaggedTensor], jax.Array] | None = None,
    platforms: Sequence[str] = ("cpu",),
    implementation: Literal["xla", "pallas"] = "xla",
    output_name: str = "logits",
    overwrite: bool = False,
    verify: bool = True,
) -> dict:
    """Writes ``model``'s forward pass as a ``jax.export`` artifact directory.

    Args:
        model: an ``nnx.Module`` called as ``model(dense [B, N], kjt)``
            (unsharded; samples independent). A copy of it is exported in eval
            mode (``deterministic=True``: dropout off, managed-collision modules
            only remap, with the index they hold); ``model`` is not changed.
        example_batch: a ``Batch`` or ``(dense_features, sparse_features)``:
            gives feature names, the dense width and dtypes, weightedness, the
            id layout (int32 values, or ``uint32[C, 2]`` id words for 64-bit
            ids) and (by default) ``max_ids_per_sample``. Its values are not
            recorded.
        path: the artifact directory (created; must be empty unless
            ``overwrite``).
        max_ids_per_sample: ids one sample may have per feature (a mapping or
            one int); default ``ceil(capacity_k / B)`` of the example batch.
        apply_fn: ``apply_fn(model, dense [1, N], kjt) -> [1, ...]`` (default
            ``model(dense, kjt)``), e.g. to add a sigmoid.
        platforms: lowering platforms, e.g. ``("cpu", "cuda")``.
        implementation: ``"xla"`` (the only one: ``"pallas"`` raises, see above).
        output_name: a name for the output recorded in the manifest.
        overwrite: replace an existing artifact in ``path``.
        verify: run the deserialized module once (batch of 1, no ids) when this
            host's platform is exported, so that a module that cannot be
            specialised to a concrete batch fails here, not at load time.

    Returns:
        The manifest (also written to ``path/manifest.json``).

    Example:
        >>> export(model, batch, "/tmp/dlrm_artifact")
        >>> predict = jaxrec.inference.load("/tmp/dlrm_artifact")
        >>> predict(dense, {"f1": [[1, 2], []], "f2": [[3], [4]]}).shape
        (2, 1)
    """
    if implementation not in ("xla", "pallas"):
        raise ValueError(f"implementation must be 'xla' or 'pallas', got {implementation!r}")
    platforms = tuple(platforms)
    if implementation == "pallas":
        raise ValueError(
            "implementation='pallas' cannot be exported: an artifact's batch size is "
            "symbolic and the Triton kernels need a static grid ('dynamic grid bounds not "
            "supported in the Triton backend'); export with implementation='xla' (the "
            "default), which XLA compiles for GPUs too"
        )
    dense, kjt = _split_batch(example_batch)
    keys = tuple(kjt.keys())
    if not keys:
        raise ValueError("the example batch has no sparse features")
    max_ids = _max_ids(kjt, max_ids_per_sample)
    weighted = kjt.weights_or_none() is not None
    num_dense = int(dense.shape[1])
    dense_dtype = np.dtype(dense.dtype)
    wide = is_wide(kjt.values())
    if not wide and np.dtype(kjt.values().dtype) != np.int32:
        raise TypeError(
            "the example batch's KJT values must be int32 ids or uint32[C, 2] id words "
            f"(64-bit ids, jaxrec.sparse.ids64.to_id_words), got {kjt.values().dtype=} "
            f"{kjt.values().shape=}"
        )
    values_dtype = jnp.uint32 if wide else jnp.int32
    model = _inference_copy(model, implementation)
    tables = _feature_tables(model)
    raw = _raw_id_features(model)
    missing = [k for k in keys if k not in tables]
    if missing:
        raise ValueError(
            f"features {missing} of the example batch are read by no embedding collection of "
            f"the model (collections read {sorted(tables)})"
        )
    graphdef, state = nnx.split(model)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    leaves = [leaf for _, leaf in paths_leaves]
    # PRNG keys (a managed-collision wrapper's reset stream) travel as their uint32
    # key data and are re-wrapped inside the exported function: jax.export takes
    # no key-typed arguments.
    key_impls = [_key_impl(leaf) for leaf in leaves]
    leaves = [
        leaf if impl is None else jax.random.key_data(leaf)
        for leaf, impl in zip(leaves, key_impls, strict=True)
    ]
    paths_leaves = [(p, leaf) for (p, _), leaf in zip(paths_leaves, leaves, strict=True)]
    caps = tuple(max_ids[k] for k in keys)
    apply_fn = apply_fn or (lambda m, d, s: m(d, s))

    def forward(weights, dense, values, lengths, *maybe_weights):
        weights = [
            w if impl is None else jax.random.wrap_key_data(w, impl=impl)
            for w, impl in zip(weights, key_impls, strict=True)
        ]

        def one(d, v, n, *w):
            # built inside the vmap: an eval forward may still advance state (a managed-
            # collision wrapper draws its reset key on every call), which nnx allows only
            # at the trace level its variables were made at; the updates are dropped
            m = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, weights))
            sample = _sample_kjt(keys, caps, v, n, w[0] if w else None)
            return apply_fn(m, d[None, :], sample)[0]

        in_axes = (0, 0, 0) + ((0,) if maybe_weights else ())
        return jax.vmap(one, in_axes=in_axes)(dense, values, lengths, *maybe_weights)

    (b,) = jax.export.symbolic_shape("b")
    total = sum(caps)
    args = [
        [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves],
        jax.ShapeDtypeStruct((b, num_dense), dense_dtype),
        jax.ShapeDtypeStruct((b, total, 2) if wide else (b, total), values_dtype),
        jax.ShapeDtypeStruct((b, len(keys)), jnp.int32),
    ]
    if weighted:
        args.append(jax.ShapeDtypeStruct((b, total), jnp.float32))
    exported = jax.export.export(jax.jit(forward), platforms=platforms)(*args)
    if verify:
        _verify(exported, leaves, args)
    out = exported.out_avals[0]
    manifest = {
        "format": FORMAT,
        "features": list(keys),
        "max_ids_per_sample": {k: max_ids[k] for k in keys},
        "num_embeddings": {k: tables[k] for k in keys},
        "weighted": weighted,
        "num_dense": num_dense,
        "dense_dtype": dense_dtype.name,
        "ids_dtype": "uint32x2" if wide else "int32",
        "raw_id_features": [k for k in keys if k in raw],
        "output": {
            "name": output_name,
            "shape": ["batch", *(int(d) for d in out.shape[1:])],
            "dtype": np.dtype(out.dtype).name,
        },
        "platforms": list(platforms),
        "implementation": implementation,
        "portable": implementation == "xla",
        "jax_version": jax.__version__,
        "calling_convention_version": exported.calling_convention_version,
        "weights": [],
    }
    _write(Path(path), manifest, exported.serialize(), paths_leaves, key_impls, overwrite)
    return manifest


def _key_impl(leaf: Any) -> str | None:
    """The PRNG implementation's name of a key leaf (``None`` for other leaves)."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return None
    return str(jax.random.key_impl(leaf))


def _verify(exported, leaves, args) -> None:
    here = "cuda" if jax.default_backend() == "gpu" else jax.default_backend()
    if here not in exported.platforms:
        return
    module = jax.export.deserialize(exported.serialize())
    concrete = [np.zeros((1, *a.shape[1:]), a.dtype) for a in args[1:]]
    try:
        jax.block_until_ready(module.call(leaves, *concrete))
    except Exception as e:
        raise ValueError(
            "the exported module does not run at a concrete batch size (batch 1): "
            f"{str(e).splitlines()[0].rstrip('.')}. Some op in the model cannot be "
            "specialised from the symbolic batch (e.g. a bitcast_convert_type that "
            "changes the element width)"
        ) from e


def _split_batch(batch: Any) -> tuple[Any, KeyedJaggedTensor]:
    if isinstance(batch, Batch):
        dense, sparse = batch.dense_features, batch.sparse_features
    elif isinstance(batch, tuple | list) and len(batch) in (2, 3):
        dense, sparse = batch[0], batch[1]
    else:
        raise TypeError(
            "example_batch must be a jaxrec.datasets.Batch or (dense_features, "
            f"sparse_features[, labels]), got {type(batch).__name__}"
        )
    if not isinstance(sparse, KeyedJaggedTensor):
        raise TypeError(
            "example_batch's sparse features must be a KeyedJaggedTensor, got "
            f"{type(sparse).__name__}"
        )
    return dense, sparse


def _max_ids(kjt: KeyedJaggedTensor, given: Mapping[str, int] | int | None) -> dict[str, int]:
    keys, b = kjt.keys(), kjt.stride()
    if given is None:
        if b == 0:
            raise ValueError("the example batch is empty; pass max_ids_per_sample=")
        return {
            k: max(1, math.ceil(c / b)) for k, c in zip(keys, kjt.capacity_per_key(), strict=True)
        }
    if isinstance(given, int):
        given = dict.fromkeys(keys, given)
    unknown = sorted(set(given) - set(keys))
    missing = [k for k in keys if k not in given]
    if unknown or missing:
        raise ValueError(
            f"max_ids_per_sample must name exactly the features {list(keys)}; "
            f"unknown {unknown}, missing {missing}"
        )
    out = {k: int(given[k]) for k in keys}
    bad = {k: n for k, n in out.items() if n < 1}
    if bad:
        raise ValueError(f"max_ids_per_sample must be >= 1, got {bad}")
    return out


def _inference_copy(model: nnx.Module, implementation: Literal["xla"]) -> nnx.Module:
    """A copy in eval mode whose embedding collections use ``implementation`` and
    IGNORE bounds checks, and whose managed-collision modules only remap."""
    model = nnx.clone(model)
    model.eval()  # deterministic=True (dropout off, managed collision remaps only)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, COLLECTIONS):
            node.implementation = implementation
            node.bounds_check_mode = BoundsCheckMode.IGNORE
        if isinstance(node, MANAGED):  # explicit: their eval mode keeps the index fixed
            node.deterministic = True
        if isinstance(node, HashZchManagedCollisionModule):  # no C++ custom call
            node.layout = dataclasses.replace(node.layout, implementation="xla")
    return model


def _raw_id_features(model: nnx.Module) -> set[str]:
    """Features read through a managed-collision collection: raw ids, not rows."""
    return {
        f
        for _, node in nnx.iter_graph(model)
        if isinstance(node, ManagedCollisionCollection)
        for c in node.embedding_configs()
        for f in c.feature_names
    }


def _feature_tables(model: nnx.Module) -> dict[str, int]:
    """Feature name -> num_embeddings of the table reading it (smallest if several)."""
    out: dict[str, int] = {}
    for _, node in nnx.iter_graph(model):
        for t in node.table_configs if isinstance(node, COLLECTIONS) else ():
            for f in t.feature_names:
                out[f] = min(out.get(f, t.num_embeddings), int(t.num_embeddings))
    return out


def _sample_kjt(keys, caps, values, lengths, weights):
    """One sample as a stride-1 KeyedJaggedTensor with static capacities ``caps``
    (``values`` ``[C]`` int32 or ``[C, 2]`` uint32 id words)."""
    return KeyedJaggedTensor.from_parts(keys, values, lengths, weights, capacities=caps, stride=1)


def _write(
    path: Path, manifest: dict, module: bytearray, paths_leaves, key_impls, overwrite: bool
) -> None:
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"{path} is not empty; pass overwrite=True or a new path")
    path.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for i, ((p, leaf), impl) in enumerate(zip(paths_leaves, key_impls, strict=True)):
        arr = np.asarray(jax.device_get(leaf))
        name = f"w{i:04d}"
        entry = {
            "name": name,
            "path": jax.tree_util.keystr(p),
            "shape": list(arr.shape),
            "dtype": np.dtype(arr.dtype).name,
        }
        if impl is not None:  # key data, re-wrapped in the module with this impl
            entry["key_impl"] = impl
        manifest["weights"].append(entry)
        if arr.dtype.char not in np.typecodes["All"]:  # e.g. ml_dtypes' bfloat16
            arr = arr.view(f"u{arr.dtype.itemsize}")
        arrays[name] = arr
    np.savez(path / WEIGHTS, allow_pickle=False, **arrays)
    (path / MODULE).write_bytes(bytes(module))
    manifest["integrity"] = integrity_section(path, manifest)
    (path / MANIFEST).write_text(json.dumps(manifest, indent=1))
