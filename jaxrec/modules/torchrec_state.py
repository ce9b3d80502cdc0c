"""Weight import from (and export to) TorchRec ``state_dict`` s.

jaxrec's modules keep TorchRec's attribute names, so a parameter's TorchRec
key is its path in the nnx module tree, with a few framework differences
translated:

==========================================  ====================================
nnx (jaxrec)                                TorchRec / torch ``state_dict``
==========================================  ====================================
``nnx.Linear`` ``kernel`` ``[in, out]``     ``Linear.weight`` ``[out, in]`` (transposed)
``nnx.Linear`` ``bias``                     ``Linear.bias``
``nnx.LayerNorm`` ``scale`` / ``bias``      ``LayerNorm.weight`` / ``bias``
``nnx.Embed`` ``embedding``                 ``Embedding.weight``
``nnx.Sequential`` ``layers.<i>``           ``Sequential.<i>``
``nnx.List`` / ``nnx.Dict`` items           ``ModuleList`` / ``ParameterList`` /
                                            ``ModuleDict`` / ``ParameterDict`` items
embedding collection tables                 ``embedding_bags.<table>.weight`` /
                                            ``embeddings.<table>.weight``
==========================================  ====================================

So ``DLRM``'s ``dense_arch.model._mlp.layers[0]._linear.kernel`` is TorchRec's
``dense_arch.model._mlp.0._linear.weight``. Only ``nnx.Param`` s and embedding
tables are imported; other variables (RNG counters, batch statistics) are not
part of the mapping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..embedding.tables import TableStorage

_RENAMES: dict[type, dict[str, str]] = {
    nnx.Linear: {"kernel": "weight"},
    nnx.LayerNorm: {"scale": "weight"},
    nnx.Embed: {"embedding": "weight"},
}


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One TorchRec tensor and where it lives in the jaxrec model."""

    shape: tuple[int, ...]  # torch shape
    get: Callable[[], jax.Array]  # -> torch-layout array
    variable: nnx.Variable | None = None  # a parameter, or None for a table
    transpose: bool = False
    table: tuple[TableStorage, str] | None = None  # (collection, its own state_dict key)


def torchrec_keys(model: nnx.Module) -> dict[str, tuple[int, ...]]:
    """``{TorchRec key: torch shape}`` of every parameter and table in ``model``."""
    return {k: e.shape for k, e in _entries(model).items()}


def torchrec_state_dict(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's parameters and tables under TorchRec's keys and layouts (numpy).

    The inverse of :func:`load_torchrec_state_dict`: a TorchRec model with the
    same structure loads it with ``load_state_dict({k: torch.from_numpy(v) ...})``.
    """
    return {k: np.asarray(e.get()) for k, e in _entries(model).items()}


def load_torchrec_state_dict(
    model: nnx.Module, state_dict: Mapping[str, Any], strict: bool = True
) -> None:
    """Sets ``model``'s parameters and tables from a TorchRec model's ``state_dict()``.

    Values may be torch tensors (CPU or not, any float dtype), numpy or JAX
    arrays; they are cast to each parameter's dtype. ``Linear`` weights are
    transposed into ``nnx.Linear`` kernels.

    Args:
        model: a jaxrec module (a model from ``jaxrec.models``, or any nnx
            module built from jaxrec modules and ``nnx.Linear`` / ``Sequential``).
        state_dict: TorchRec keys, e.g.
            ``sparse_arch.embedding_bag_collection.embedding_bags.t1.weight`` or
            ``dense_arch.model._mlp.0._linear.weight``.
        strict: every model tensor must be given and no unknown key is allowed.
            Shapes are always checked.

    The model may be abstract (``nnx.eval_shape(lambda: Model(...))``): with
    ``strict`` every tensor is then set from ``state_dict`` and nothing is
    initialised only to be overwritten.

    Raises:
        ValueError: listing unknown keys, missing keys and shape mismatches.

    Example:
        >>> load_torchrec_state_dict(jax_dlrm, torch_dlrm.state_dict())
    """
    entries = _entries(model)
    arrays = {k: _to_numpy(v) for k, v in state_dict.items()}
    unknown = sorted(set(arrays) - set(entries))
    missing = sorted(set(entries) - set(arrays))
    bad_shape = [
        f"{k}: model {entries[k].shape}, state_dict {tuple(arrays[k].shape)}"
        for k in arrays
        if k in entries and tuple(arrays[k].shape) != entries[k].shape
    ]
    if bad_shape or (strict and (unknown or missing)):
        lines = [f"cannot load the TorchRec state_dict into {type(model).__name__}:"]
        if unknown:
            lines.append(f"  unknown keys (not in the model): {unknown}")
        if missing:
            lines.append(f"  missing keys (model tensors not given): {missing}")
        if bad_shape:
            lines.append(f"  shape mismatches: {bad_shape}")
        lines.append(f"  the model expects: {sorted(entries)}")
        raise ValueError("\n".join(lines))
    tables: dict[int, tuple[TableStorage, dict[str, np.ndarray]]] = {}
    for key, value in arrays.items():
        if key not in entries:
            continue
        e = entries[key]
        if e.table is not None:
            owner, local = e.table
            tables.setdefault(id(owner), (owner, {}))[1][local] = value
            continue
        assert e.variable is not None  # an entry holds a table or a variable
        current = e.variable.get_value()
        e.variable.set_value(jnp.asarray(value.T if e.transpose else value, current.dtype))
    for owner, sd in tables.values():  # one concatenation per table group
        owner.load_state_dict(sd, strict=False)


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor: numpy has no bfloat16, so go via float32
        value = value.detach().cpu()
        if value.is_floating_point() and value.dtype.itemsize < 4:
            value = value.float()  # cast back to the parameter's dtype on load
        return value.numpy()
    return np.asarray(value)


def _entries(model: nnx.Module) -> dict[str, _Entry]:
    modules = dict(nnx.iter_modules(model))
    out: dict[str, _Entry] = {}
    for path, module in modules.items():
        if isinstance(module, TableStorage):
            prefix = _torch_path(path, modules)
            for t in module.table_configs:  # shapes from configs: abstract models work too
                local = f"{module.prefix}.{t.name}.weight"
                out[".".join([*prefix, local])] = _Entry(
                    (t.num_embeddings, t.embedding_dim),
                    _table_getter(module, local),
                    table=(module, local),
                )
    for path, var in _params(model):
        parent = modules.get(path[:-1])
        name = str(path[-1])
        renames = next((r for t, r in _RENAMES.items() if isinstance(parent, t)), {})
        transpose = isinstance(parent, nnx.Linear) and name == "kernel"
        key = ".".join([*_torch_path(path[:-1], modules), renames.get(name, name)])
        value = var.get_value()
        shape = tuple(value.shape[::-1]) if transpose else tuple(value.shape)
        if key in out:
            raise ValueError(f"two parameters of the model map to the TorchRec key {key!r}")
        out[key] = _Entry(shape, _param_getter(var, transpose), variable=var, transpose=transpose)
    return out


def _params(model: nnx.Module) -> Iterator[tuple[tuple, nnx.Variable]]:
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            yield path, var


def _torch_path(path: tuple, modules: Mapping[tuple, nnx.Module]) -> list[str]:
    """Module path -> torch module path: ``Sequential.layers.<i>`` becomes ``<i>``."""
    out = []
    for i, part in enumerate(path):
        if part == "layers" and isinstance(modules.get(path[:i]), nnx.Sequential):
            continue
        out.append(str(part))
    return out


def _param_getter(var: nnx.Variable, transpose: bool) -> Callable[[], jax.Array]:
    return lambda: var.get_value().T if transpose else var.get_value()


def _table_getter(module: TableStorage, local: str) -> Callable[[], jax.Array]:
    return lambda: module.state_dict()[local]
