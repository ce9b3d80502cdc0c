"""Decoding of prediction requests: JSON bytes in, a validated batch out.

Used by the HTTP server and the JSONL batch mode of
:mod:`jaxrec.inference.serving`. A request body is::

    {"instances": [{"dense": [0.1, 0.2, ...],             # num_dense numbers
                    "sparse": {"f1": [3, 17], "f2": []},   # every feature, ids
                    "weights": {"f1": [0.5, 1.0], ...}},   # weighted models only
                   ...]}

Every rule is checked here, in plain Python, before the model sees the batch,
so that a bad request is a :class:`RequestError` (HTTP 400) or
:class:`RequestTooLarge` (413) naming the instance and field, never another
exception: the body must be UTF-8 JSON nested at most ``max_depth`` deep, with
no ``NaN``/``Infinity`` literals; the object has exactly the key
``instances``; each instance exactly ``dense``, ``sparse`` (and ``weights``
for a weighted model); dense values and weights are JSON numbers (not
booleans) finite in the model's dense dtype; ids are JSON integers in
``[0, num_embeddings)``, at most ``max_ids_per_sample`` per feature. A feature
read through managed collision (a dynamic or MCH table) takes raw ids instead,
not bounded by its table: any int32 (``"ids_dtype": "int32"`` artifacts), or
any 64-bit integer, signed or unsigned (``"uint32x2"`` artifacts, whose ids
travel as id words).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from .artifact import ExportedModel, InputError, id_range_error, pack_ids

MAX_JSON_DEPTH = 32  # a valid request nests 5 deep
# A JSON string (escapes included): removed before counting brackets.
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_STEP = np.zeros(256, np.int8)  # byte -> nesting step
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1


class RequestError(InputError):
    """A malformed prediction request; ``status`` is its HTTP status (400)."""

    status = 400


class RequestTooLarge(RequestError):
    """Too many instances or too large a body (HTTP 413)."""

    status = 413


class DecodedBatch(NamedTuple):
    """A validated request: what :class:`~jaxrec.inference.ExportedModel` takes.

    Attributes:
        dense: ``[B, num_dense]`` in the model's dense dtype, all finite.
        sparse: ``{feature: [ids of sample 0, ids of sample 1, ...]}`` (Python ints).
        weights: like ``sparse`` with float weights, or ``None`` (unweighted model).
    """

    dense: np.ndarray
    sparse: dict[str, list[list[int]]]
    weights: dict[str, list[list[float]]] | None


def _reject_constant(name: str) -> None:
    raise RequestError(f"the body has a {name} literal; JSON numbers must be finite")


def json_depth(raw: bytes) -> int:
    """How deeply ``raw`` nests arrays and objects (exact for valid JSON)."""
    if b'"' in raw:
        raw = _STRING.sub(b"", raw)
    steps = _STEP[np.frombuffer(raw, np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def parse_json(body: bytes | str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Strict JSON: UTF-8, finite numbers, at most ``max_depth`` nested levels.

    Raises:
        RequestError: the body is not such JSON (the message says why).
    """
    raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else bytes(body)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"the body is not UTF-8: {e}") from None
    depth = json_depth(raw)
    if depth > max_depth:
        raise RequestError(f"the body nests {depth} levels deep; at most {max_depth} allowed")
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
    except ValueError as e:  # e.g. an integer literal over Python's 4300-digit limit
        raise RequestError(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError("the body nests too deeply") from None


def decode_request(
    model: ExportedModel,
    body: bytes | str,
    *,
    max_instances: int | None = None,
    max_depth: int = MAX_JSON_DEPTH,
) -> DecodedBatch:
    """A request body (``{"instances": [...]}``) as a validated batch.

    Args:
        model: an :class:`~jaxrec.inference.ExportedModel` (its ``features``,
            ``num_dense``, ``dense_dtype``, ``max_ids``, ``num_embeddings``,
            ``weighted`` and, if it has them, ``id_bounds``, ``raw_ids`` and
            ``wide_ids`` are read).
        body: the raw body.
        max_instances: instances allowed (more: :class:`RequestTooLarge`).
        max_depth: nesting allowed.

    Raises:
        RequestError: anything malformed (:class:`RequestTooLarge` for too many
            instances); never another exception for any ``body``.
    """
    payload = parse_json(body, max_depth=max_depth)
    if not isinstance(payload, dict) or "instances" not in payload:
        raise RequestError('the body must be a JSON object {"instances": [...]}')
    extra = sorted(set(payload) - {"instances"})
    if extra:
        raise RequestError(f"unknown top-level key(s) {extra}; the body holds only 'instances'")
    return decode_instances(model, payload["instances"], max_instances=max_instances)


def decode_instances(
    model: ExportedModel, instances: Any, *, max_instances: int | None = None
) -> DecodedBatch:
    """Parsed JSON ``instances`` (a list of objects) as a validated batch.

    Raises:
        RequestError: a malformed instance (the message names it and the field).
        RequestTooLarge: more than ``max_instances`` instances.
    """
    if not isinstance(instances, list):
        raise RequestError(f"'instances' must be a list, got {_kind(instances)}")
    if not instances:
        raise RequestError("'instances' is empty")
    if max_instances is not None and len(instances) > max_instances:
        raise RequestTooLarge(
            f"{len(instances)} instances in one request; at most {max_instances} allowed"
        )
    fields = {"dense", "sparse"} | ({"weights"} if model.weighted else set())
    dense_rows: list[list[float]] = []
    sparse: dict[str, list[list[int]]] = {k: [] for k in model.features}
    weights = {k: [] for k in model.features} if model.weighted else None
    for i, inst in enumerate(instances):
        where = f"instance {i}"
        if not isinstance(inst, dict):
            raise RequestError(f"{where} must be an object, got {_kind(inst)}")
        extra = sorted(set(inst) - fields)
        if extra:
            raise RequestError(f"{where}: unknown field(s) {extra}; use {sorted(fields)}")
        d = inst.get("dense", [] if model.num_dense == 0 else None)
        dense_rows.append(_numbers(d, f"{where}: 'dense'", model.num_dense))
        ids = _per_feature(model, inst.get("sparse"), f"{where}: 'sparse'")
        for k, key in enumerate(model.features):
            sparse[key].append(_ids(model, k, ids[key], f"{where}: feature {key!r}"))
        if weights is not None:
            w = _per_feature(model, inst.get("weights"), f"{where}: 'weights'")
            for key in model.features:
                n = len(sparse[key][-1])
                weights[key].append(_numbers(w[key], f"{where}: weights of {key!r}", n))
    dense = _finite(dense_rows, model.dense_dtype, "'dense'")
    dense = dense.reshape(len(instances), model.num_dense)
    if weights is not None:
        for key, rows in weights.items():
            weights[key] = _finite(rows, np.float32, f"weights of {key!r}", ragged=True)
    return DecodedBatch(dense, sparse, weights)


def _kind(x: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(x), "null" if x is None else "a number"
    )


def _per_feature(model: ExportedModel, x: Any, where: str) -> Mapping:
    if not isinstance(x, dict):
        raise RequestError(f"{where} must be an object {{feature: [...]}}, got {_kind(x)}")
    unknown = [k for k in x if k not in model.features]
    if unknown:
        raise RequestError(
            f"{where}: unknown feature(s) {unknown}; this model's features are "
            f"{list(model.features)}"
        )
    missing = [k for k in model.features if k not in x]
    if missing:
        raise RequestError(
            f"{where}: missing feature(s) {missing}: give every feature (an empty list for none)"
        )
    return x


def _numbers(x: Any, where: str, n: int) -> list[float]:
    """``x``, a list of ``n`` JSON numbers, as floats (inf beyond float64)."""
    if not isinstance(x, list):
        raise RequestError(f"{where} must be a list of {n} numbers, got {_kind(x)}")
    if len(x) != n:
        raise RequestError(f"{where} has {len(x)} values; the model takes {n}")
    for j, v in enumerate(x):
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise RequestError(f"{where}[{j}] must be a number, got {_kind(v)}")
    try:
        return [float(v) for v in x]
    except OverflowError:  # an integer beyond float64: reported by _finite
        return [float(v) if abs(v) < 1e308 else math.inf for v in x]


def _finite(
    rows: list[list[float]], dtype: npt.DTypeLike, what: str, ragged: bool = False
) -> Any:  # np.ndarray, or list[list[float]] if ragged
    """``rows`` (one per instance) as ``dtype`` (a ``[B, n]`` array, or lists of
    rounded floats if ``ragged``); a value not finite in ``dtype`` is a RequestError."""
    lens = [len(r) for r in rows]
    flat = np.fromiter((v for r in rows for v in r), np.float64, sum(lens))
    with np.errstate(over="ignore"):  # overflow to inf is reported below
        arr = flat.astype(dtype)
    bad = np.flatnonzero(~np.isfinite(arr.astype(np.float32)))
    if bad.size:
        i = int(np.searchsorted(np.cumsum(lens), bad[0], side="right"))
        j = int(bad[0]) - sum(lens[:i])
        raise RequestError(
            f"instance {i}: {what}[{j}] = {float(flat[bad[0]])!r} is not finite as "
            f"{np.dtype(dtype).name}; inputs must be finite numbers"
        )
    if not ragged:
        return arr
    out, start = [], 0
    for n in lens:
        out.append(arr[start : start + n].tolist())
        start += n
    return out


def _bounds(model: ExportedModel, k: int) -> tuple[int, int]:
    """Feature ``k``'s ids ``[lo, hi)``: its table's rows, or raw ids (managed collision)."""
    bounds = getattr(model, "id_bounds", None)  # a stub model may give only num_embeddings
    return (0, model.num_embeddings[k]) if bounds is None else bounds[k]


def _ids(model: ExportedModel, k: int, x: Any, where: str) -> list[int]:
    if not isinstance(x, list):
        raise RequestError(f"{where}: ids must be a list of integers, got {_kind(x)}")
    limit, (lo, hi) = model.max_ids[k], _bounds(model, k)
    if len(x) > limit:
        raise RequestError(
            f"{where} has {len(x)} ids; this artifact allows at most {limit} "
            f"(max_ids_per_sample[{model.features[k]!r}] = {limit})"
        )
    for v in x:
        if isinstance(v, bool) or not isinstance(v, int):
            raise RequestError(f"{where}: ids must be integers, got {_kind(v)} {v!r:.40}")
        if not lo <= v < hi:
            raw = getattr(model, "raw_ids", None)
            why = (
                id_range_error(model, k, v)
                if raw and raw[k]
                else f"id {v} is outside [0, {hi}) (num_embeddings of its table)"
            )
            raise RequestError(f"{where}: {why}")
    return list(x)


def batch_arrays(model: ExportedModel, batch: DecodedBatch) -> tuple:
    """``(dense, values, lengths[, weights])`` for ``ExportedModel.run``: the
    per-sample layout, built without re-checking what the decoder checked."""
    b, wide = batch.dense.shape[0], bool(getattr(model, "wide_ids", False))
    c = int(model.starts[-1])
    values = np.zeros((b, c, 2), np.uint32) if wide else np.zeros((b, c), np.int32)
    lengths = np.zeros((b, len(model.features)), np.int32)
    wts = np.zeros((b, c), np.float32) if batch.weights is not None else None
    for k, key in enumerate(model.features):
        lens = np.fromiter(map(len, batch.sparse[key]), np.int64, b)
        n = int(lens.sum())
        if not n:
            continue
        row = np.repeat(np.arange(b), lens)
        col = np.arange(n) - np.repeat(np.cumsum(lens) - lens, lens) + int(model.starts[k])
        flat = [v for ids in batch.sparse[key] for v in ids]
        if wide:  # raw 64-bit ids, possibly past int64 (uint64): packed as id words
            values[row, col] = pack_ids(np.array(flat, dtype=object), wide=True)
        else:
            values[row, col] = np.fromiter(flat, np.int64, n)
        lengths[:, k] = lens
        if wts is not None and batch.weights is not None:
            flat = (v for w in batch.weights[key] for v in w)
            wts[row, col] = np.fromiter(flat, np.float32, n)
    return (batch.dense, values, lengths) + ((wts,) if wts is not None else ())


def check_finite_output(out: np.ndarray) -> None:
    """Raises :class:`NonFiniteOutput` when a prediction is NaN or infinite."""
    bad = ~np.isfinite(np.asarray(out, np.float32)).reshape(out.shape[0], -1).all(axis=1)
    if bad.any():
        rows = np.flatnonzero(bad).tolist()
        raise NonFiniteOutput(
            f"the model produced NaN/infinite predictions for instance(s) {rows[:10]}"
            f"{' ...' if len(rows) > 10 else ''}; not sent (JSON has no NaN). Check the "
            "inputs' ranges and the model's weights"
        )


class NonFiniteOutput(RuntimeError):
    """The model's output holds NaN or infinity (HTTP 500, never sent as ``NaN``)."""
