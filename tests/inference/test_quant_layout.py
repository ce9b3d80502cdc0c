"""Row-wise quantization: FBGEMM's TBE inference row layout, error bounds, validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from quant_cases import DTYPES, random_table

from jaxrec.configs import DataType
from jaxrec.inference import dequantize_rows, quantize_rows, row_bytes
from jaxrec.xla.quantize import canonical_dtype, row_error_bound, scale_bias


def test_torchrec_tutorial_shape():
    """TorchRec's tutorial: a 4096 x 64 float32 table becomes 4096 x 80 uint8 in INT8."""
    q = quantize_rows(jnp.zeros((4096, 64)), "int8")
    assert q.shape == (4096, 80) and q.dtype == jnp.uint8
    assert row_bytes(64, "int4") == 48 and row_bytes(64, "fp16") == 128
    assert row_bytes(64, "int8", row_alignment=1) == 68  # FBGEMM's CPU TBE without padding
    assert row_bytes(10, "bf16") == 32


@pytest.mark.parametrize("dtype", DTYPES)
def test_roundtrip_within_bound(dtype):
    w = random_table(0, 50, 12, scale=3.0)
    q = quantize_rows(w, dtype)
    back = dequantize_rows(q, 12, dtype)
    err = jnp.abs(back - w)
    bound = row_error_bound(w, q, dtype)
    assert bool(jnp.all(err <= bound[:, None])), float(jnp.max(err - bound[:, None]))
    if dtype in ("int8", "int4"):
        scale, bias = scale_bias(q)
        levels = 255 if dtype == "int8" else 15
        np.testing.assert_allclose(bound, scale / 2 * (1 + 1e-6) + 1e-7, rtol=0.2)  # ~ scale/2
        assert float(scale[1]) == 1.0 and float(bias[1]) == 0.25  # constant row
        assert float(jnp.max(err[1])) == 0.0
        np.testing.assert_allclose(scale[2], 8 / levels, rtol=1e-3)
    if dtype == "fp32":
        assert float(jnp.max(err)) == 0.0


def test_gathered_rows_and_leading_dims():
    w = random_table(1, 20, 8)
    q = quantize_rows(w, "int4")
    idx = jnp.asarray([[3, 3], [0, 19]])
    np.testing.assert_array_equal(
        dequantize_rows(q[idx], 8, "int4"), dequantize_rows(q, 8, "int4")[idx]
    )


def test_int4_packs_even_column_low_nibble():
    w = jnp.asarray([[0.0, 15.0, 1.0, 2.0]])  # bias 0, scale 1
    q = np.asarray(quantize_rows(w, "int4"))
    assert q[0, 4] == 0xF0 and q[0, 5] == 0x21


def test_dtype_names():
    assert canonical_dtype(DataType.FP16) == "fp16"
    assert canonical_dtype(jnp.bfloat16) == "bf16"
    assert canonical_dtype("INT8") == "int8" and canonical_dtype("float32") == "fp32"


def test_bad_arguments():
    with pytest.raises(TypeError, match="unsupported quantized table dtype"):
        quantize_rows(jnp.zeros((2, 4)), "int2")
    with pytest.raises(TypeError, match="unsupported"):
        row_bytes(4, jnp.int32)
    with pytest.raises(ValueError, match="must be even"):
        quantize_rows(jnp.zeros((2, 5)), "int4")
    with pytest.raises(ValueError, match=r"\[rows, dim\]"):
        quantize_rows(jnp.zeros((2, 4, 1)), "int8")
    with pytest.raises(TypeError, match="float array"):
        quantize_rows(jnp.zeros((2, 4), jnp.int32), "int8")
    with pytest.raises(TypeError, match="uint8"):
        dequantize_rows(jnp.zeros((2, 16), jnp.float32), 4, "int8")
    with pytest.raises(ValueError, match="need at least"):
        dequantize_rows(jnp.zeros((2, 6), jnp.uint8), 4, "int8")
    with pytest.raises(ValueError, match="row_alignment"):
        row_bytes(4, "int8", row_alignment=0)


@pytest.mark.parametrize("dtype,bits", [("int8", 8), ("int4", 4)])
def test_matches_fbgemm_bytes(dtype, bits):
    """Byte-identical to FBGEMM's quantizer (what TorchRec's quantize_state_dict calls),
    with the scale/bias moved to the front of the row as the TBE inference buffer holds it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("fbgemm_gpu")
    w = np.asarray(random_table(2, 33, 16, scale=2.0))
    ref = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(torch.tensor(w), bits)
    ref = ref.numpy()
    n = 16 * bits // 8
    ours = np.asarray(quantize_rows(w, dtype))
    np.testing.assert_array_equal(ours[:, :4], ref[:, n:])  # fp16 scale, fp16 bias
    np.testing.assert_array_equal(ours[:, 4 : 4 + n], ref[:, :n])
    assert not ours[:, 4 + n :].any()  # padding
    deq = torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(torch.tensor(ref), bits)
    np.testing.assert_array_equal(dequantize_rows(ours, 16, dtype), deq.numpy())


@pytest.mark.parametrize("dtype", ["int8", "int4", "fp16"])
def test_matches_fbgemm_tbe_inference_forward(dtype):
    """Our rows loaded into FBGEMM's IntNBit TBE (row_alignment=16) pool like our lookup."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("fbgemm_gpu")
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        IntNBitTableBatchedEmbeddingBagsCodegen,
    )

    from jaxrec.inference import quant_embedding_bag

    rows_n, dim = 24, 16
    st = {"int8": SparseType.INT8, "int4": SparseType.INT4, "fp16": SparseType.FP16}[dtype]
    tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
        [("t", rows_n, dim, st, EmbeddingLocation.HOST)],
        device="cpu",
        row_alignment=16,
        output_dtype=SparseType.FP32,
    )
    tbe.fill_random_weights()
    assert tbe.weights_host.numel() >= rows_n * row_bytes(dim, dtype)
    q = np.asarray(quantize_rows(random_table(3, rows_n, dim), dtype))
    view = tbe.weights_host[: rows_n * q.shape[1]].view(rows_n, q.shape[1])
    view.copy_(torch.tensor(q))
    ids = np.asarray([1, 2, 2, 5, 23, 0, 7], np.int64)
    offsets = np.asarray([0, 3, 3, 7], np.int64)  # bags of 3, 0 and 4 ids
    want = tbe(torch.tensor(ids, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int32))
    seg = np.repeat(np.arange(3), np.diff(offsets))
    got = quant_embedding_bag(
        jnp.asarray(q),
        jnp.asarray(ids, jnp.int32),
        jnp.asarray(seg, jnp.int32),
        3,
        dim=dim,
        dtype=dtype,
    )
    np.testing.assert_allclose(got, want.float().numpy(), rtol=1e-5, atol=1e-5)


def test_jittable():
    f = jax.jit(quantize_rows, static_argnames=("dtype",))
    assert f(jnp.ones((3, 4)), dtype="int8").shape == (3, 16)
