import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from jaxrec.sparse import MonotoneCapacities, bucket_capacity


def test_buckets_are_few_and_tight():
    buckets = {bucket_capacity(n) for n in range(0, 10_001)}
    assert len(buckets) <= 2 * 14 + 1  # two per octave
    for n in range(1, 10_001):
        cap = bucket_capacity(n)
        assert n <= cap and (cap == 8 or (cap - n) / cap < 1 / 3)  # padding < a third
    with pytest.raises(ValueError):
        bucket_capacity(-1)


def test_monotone_capacities_only_grow():
    caps = MonotoneCapacities()
    assert caps({"a": 5, "b": 20}) == {"a": 8, "b": 24}
    assert caps({"a": 3, "b": 30}) == {"a": 8, "b": 32}
    assert caps({"a": 1, "b": 1}) == {"a": 8, "b": 32}


def test_recompile_guard_same_bucket_traces_once():
    """A stream of random batches whose capacities come from MonotoneCapacities
    compiles once per capacity tuple, and batches inside one bucket trace once."""
    keys = ["f0", "f1", "f2"]
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=50, feature_names=[k])
            for i, k in enumerate(keys)
        ],
        rngs=nnx.Rngs(0),
    )
    graphdef, state = nnx.split(ebc)

    @jax.jit
    @chex.assert_max_traces(n=1)  # raises on a second trace
    def forward(state, kjt):
        return nnx.merge(graphdef, state)(kjt).values()

    rng = np.random.default_rng(0)
    caps = MonotoneCapacities(minimum=64)
    shapes = set()
    for _ in range(30):
        lengths = rng.integers(0, 5, size=len(keys) * 8)
        values = rng.integers(0, 50, size=int(lengths.sum()))
        per_key = dict(zip(keys, lengths.reshape(3, 8).sum(1).tolist(), strict=True))
        kjt = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, capacities=caps(per_key))
        shapes.add(kjt.capacity_per_key())
        forward(state, kjt).block_until_ready()
    assert len(shapes) == 1  # at most 32 ids per key: one bucket of 64

    # Independent per-key bucketing, by contrast, would have retraced.
    jnp.zeros(())  # keep the stream's arrays alive until here
