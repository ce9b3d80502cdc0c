"""TorchRec-style string forms of the sparse types (host-side, small inputs)."""

from __future__ import annotations

import numpy as np


def _num(x: np.ndarray) -> list:
    return np.asarray(x).tolist()


def bags_str(values: np.ndarray, lengths: np.ndarray) -> str:
    """``[[5], [7, 1]]``: the first sum(lengths) values split into bags."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return str([_num(values[offsets[i] : offsets[i + 1]]) for i in range(len(lengths))])


def weighted_lines(values, lengths, weights, indent: str) -> str:
    """The ``"values": ..., "weights": ...`` lines of a weighted feature."""
    return (
        f'{indent}"values": {bags_str(values, lengths)},\n'
        f'{indent}"weights": {bags_str(weights, lengths)}'
    )


def jagged_repr(values, lengths, weights) -> str:
    if weights is None:
        body = "    " + bags_str(values, lengths)
    else:
        body = weighted_lines(values, lengths, weights, "    ")
    return "JaggedTensor({\n" + body + "\n})\n"


def keyed_jagged_repr(items) -> str:
    """``items``: (key, values, lengths, weights | None) per key, host arrays."""
    if not items:
        return "KeyedJaggedTensor()\n"
    parts = []
    for key, values, lengths, weights in items:
        if weights is None:
            parts.append(f'    "{key}": {bags_str(values, lengths)}')
        else:
            lines = weighted_lines(values, lengths, weights, "        ")
            parts.append(f'    "{key}": {{\n{lines}\n    }}')
    return "KeyedJaggedTensor({\n" + ",\n".join(parts) + "\n})\n"
