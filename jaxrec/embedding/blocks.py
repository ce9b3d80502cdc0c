"""Where each table's rows sit in a collection's buffers: the map checkpoints read and write.

A collection stacks its tables into buffers (weights and optimizer state), and a
sharded one splits tables into row and column pieces placed at padded offsets.
:class:`TableBlocks` describes that placement as rectangles, so that checkpoints
can move any table's rows between a buffer (of any plan) and the logical
``[num_embeddings, dim]`` layout a slice at a time, without a whole copy.
"""

from __future__ import annotations

from typing import NamedTuple


class Block(NamedTuple):
    """Rows ``[start, start + rows)``, columns ``[0, cols)`` of a buffer hold rows
    ``[row, row + rows)``, columns ``[col, col + cols)`` of table ``table``.

    For a row-wise optimizer field (one value per row) only the rows apply; the
    column pieces of one table hold equal copies of it.
    """

    table: str
    row: int
    rows: int
    col: int
    cols: int
    start: int


class TableBlocks(NamedTuple):
    """A collection's buffers in terms of its tables.

    Attributes:
        weights: ``{buffer name: blocks}``, the buffers of the collection's
            ``weights`` (``nnx.Dict`` of ``EmbeddingTable``).
        states: ``{state key: blocks}``, the sparse optimizer states
            (``CombinedOptState.sparse``) with the rows of their fields; the
            tables of one state share its step ``count``.
    """

    weights: dict[str, tuple[Block, ...]]
    states: dict[str, tuple[Block, ...]]
