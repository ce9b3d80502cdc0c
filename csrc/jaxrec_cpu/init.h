// Initial table values: Philox4x32-10 uniform draws, bit for bit those of
// jaxrec/xla/philox.py::uniform_rows_xla (its module docstring defines them).
// Part of jaxrec_cpu.cc (one translation unit: included once, in order).
//
// Element (row, col) of stream s is word col % 4 of Philox4x32-10 of the
// counter (row, 0, col / 4, s) under the key (k0, k1); its float is
// u = bitcast((w >> 9) | 0x3f800000) - 1, then half * (u * 2 - 1) + mid in
// float32 (two roundings, no FMA: built with -ffp-contract=off), then cast to
// the buffer's dtype (round to nearest even).
//
// Speed: counters are drawn in blocks of kInitBlock, which run across the rows
// of a piece (a 16-wide row is only 4 counters), in 64-bit vector lanes whose
// low halves hold the 32-bit words: one vpmuludq per multiply gives both the
// high and the low word, the high halves of the lanes are ignored until the
// words are stored. On a 2-core Xeon VM (AVX-512), per core: ~6 GB/s of float32
// values into a cached or streamed buffer, ~3 GB/s into a fresh XLA buffer
// (its page faults: huge pages asked for, 1.2 GB/s without); AVX2 builds ~2/3
// of that, SSE2 ~40%.
#pragma once

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int kPhiloxBytes = 64;
#elif defined(__AVX2__)
constexpr int kPhiloxBytes = 32;
#else
constexpr int kPhiloxBytes = 16;
#endif
typedef uint64_t VQ __attribute__((vector_size(kPhiloxBytes)));
constexpr int kQL = kPhiloxBytes / 8;      // counters per vector
constexpr int kPhiloxVecs = 4;              // vectors in flight (hides the multiply latency)
constexpr int kPhiloxStep = kQL * kPhiloxVecs;
constexpr int kInitBlock = 256;             // counters per block (a multiple of kPhiloxStep)
static_assert(kInitBlock % kPhiloxStep == 0, "a block is whole steps");

constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;  // round multipliers
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;  // key increments

// The 64-bit products of the low 32 bits of each lane of a and b.
inline VQ MulLow32(VQ a, VQ b) {
#if defined(__AVX512F__)
  // (masked forms here: GCC 12 warns of the unmasked ones' undefined pass-through)
  return reinterpret_cast<VQ>(_mm512_maskz_mul_epu32(static_cast<__mmask8>(0xff),
                                                     reinterpret_cast<__m512i>(a),
                                                     reinterpret_cast<__m512i>(b)));
#elif defined(__AVX2__)
  return reinterpret_cast<VQ>(_mm256_mul_epu32(reinterpret_cast<__m256i>(a),
                                               reinterpret_cast<__m256i>(b)));
#elif defined(__SSE2__)
  return reinterpret_cast<VQ>(_mm_mul_epu32(reinterpret_cast<__m128i>(a),
                                            reinterpret_cast<__m128i>(b)));
#else
  return (a & 0xffffffffull) * (b & 0xffffffffull);
#endif
}

// The high words of the 64-bit lanes of p, in their low halves (a dword swap:
// the shuffle port, where a shift would compete with the multiplies).
inline VQ High32(VQ p) {
#if defined(__AVX512F__)
  return reinterpret_cast<VQ>(_mm512_maskz_shuffle_epi32(static_cast<__mmask16>(0xffff),
                                                         reinterpret_cast<__m512i>(p),
                                                         _MM_PERM_CDAB));
#elif defined(__AVX2__)
  return reinterpret_cast<VQ>(_mm256_shuffle_epi32(reinterpret_cast<__m256i>(p), 0xB1));
#elif defined(__SSE2__)
  return reinterpret_cast<VQ>(_mm_shuffle_epi32(reinterpret_cast<__m128i>(p), 0xB1));
#else
  return p >> 32;
#endif
}

// Philox4x32-10 of the counters (row + rel[i], 0, q + qrel[i], stream), i in
// [0, n) (n a multiple of kPhiloxStep), under (k0, k1): words 4 i .. 4 i + 3 of w.
void PhiloxWords(const uint32_t* __restrict rel, const uint32_t* __restrict qrel, uint32_t row,
                 uint32_t q, uint32_t stream, uint32_t k0, uint32_t k1, int n,
                 uint32_t* __restrict w) {
  const VQ m0 = VQ{} + kPhiloxM0, m1 = VQ{} + kPhiloxM1, low = VQ{} + 0xffffffffull;
  VQ ka[10], kb[10];  // the round keys
  for (int r = 0; r < 10; ++r) {
    ka[r] = VQ{} + static_cast<uint32_t>(k0 + r * kPhiloxW0);
    kb[r] = VQ{} + static_cast<uint32_t>(k1 + r * kPhiloxW1);
  }
  for (int i = 0; i < n; i += kPhiloxStep) {
    VQ c0[kPhiloxVecs], c1[kPhiloxVecs], c2[kPhiloxVecs], c3[kPhiloxVecs];
    for (int v = 0; v < kPhiloxVecs; ++v) {
      c0[v] = c2[v] = VQ{};
      for (int l = 0; l < kQL; ++l) {
        c0[v][l] = static_cast<uint32_t>(row + rel[i + v * kQL + l]);
        c2[v][l] = static_cast<uint32_t>(q + qrel[i + v * kQL + l]);
      }
      c1[v] = VQ{};
      c3[v] = VQ{} + stream;
    }
#pragma GCC unroll 10
    for (int r = 0; r < 10; ++r) {
      for (int v = 0; v < kPhiloxVecs; ++v) {
        const VQ p0 = MulLow32(c0[v], m0), p1 = MulLow32(c2[v], m1);
        const VQ n0 = High32(p1) ^ c1[v] ^ ka[r];
        const VQ n2 = High32(p0) ^ c3[v] ^ kb[r];
        c1[v] = p1;  // the low word (the high half of the lane is ignored)
        c3[v] = p0;
        c0[v] = n0;
        c2[v] = n2;
      }
    }
    for (int v = 0; v < kPhiloxVecs; ++v) {
      // Words 0, 1 and 2, 3 of each counter as 64-bit pairs, in memory order.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
      const VQ x = (c1[v] & low) | (c0[v] << 32);
      const VQ y = (c3[v] & low) | (c2[v] << 32);
#else
      const VQ x = (c0[v] & low) | (c1[v] << 32);
      const VQ y = (c2[v] & low) | (c3[v] << 32);
#endif
      uint64_t out[2 * kQL];
      for (int l = 0; l < kQL; ++l) {
        out[2 * l] = x[l];
        out[2 * l + 1] = y[l];
      }
      std::memcpy(w + 4 * (i + v * kQL), out, sizeof(out));
    }
  }
}

enum class InitOut { kF32, kBF16, kF16 };

template <InitOut K>
struct InitOutType {
  using type = uint16_t;
};
template <>
struct InitOutType<InitOut::kF32> {
  using type = float;
};

// The value of word w in [mid - half, mid + half), as the XLA reference rounds it:
// there u = f - 1 for f = bitcast((w >> 9) | 0x3f800000) in [1, 2), and 2 u - 1 is
// exact; so is 2 f - 3, the same number, one operation fewer (2 f: exponent + 1).
// The value is float32(mid + half * (2 u - 1)) with the sum taken in float64, where
// the product (24 x 23 bits) is exact: one definition whether or not a compiler
// contracts the multiply-add (XLA does under jit). With mid == 0 (TorchRec's
// symmetric default) that is the float32 product, one rounding: the fast path.
template <bool kMid>
inline float InitValueT(uint32_t w, float mid, float half) {
  const uint32_t bits = (w >> 9) | 0x40000000u;
  float f2;
  std::memcpy(&f2, &bits, 4);
  const float x = f2 - 3.0f;  // exact: 2 u - 1 in [-1, 1)
  if constexpr (kMid) {
    return static_cast<float>(static_cast<double>(half) * x + static_cast<double>(mid));
  } else {
    return half * x + mid;  // mid == +-0: the product's one rounding (-0 + 0 = +0)
  }
}

inline float InitValue(uint32_t w, float mid, float half) {
  return mid == 0.0f ? InitValueT<false>(w, mid, half) : InitValueT<true>(w, mid, half);
}

// f32 -> bf16, round to nearest even; NaN stays a quiet NaN (branch-free, so it vectorizes).
inline uint16_t Bf16Rne(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

#if defined(__F16C__)
constexpr bool kInitF16 = true;
inline uint16_t F16Rne(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#elif defined(__FLT16_MAX__)
constexpr bool kInitF16 = true;
inline uint16_t F16Rne(float f) {
  const _Float16 h = static_cast<_Float16>(f);  // the current rounding mode: nearest even
  uint16_t out;
  std::memcpy(&out, &h, 2);
  return out;
}
#else
constexpr bool kInitF16 = false;
inline uint16_t F16Rne(float) { return 0; }  // not called: the handler refuses float16
#endif

// out[k] = the value of word w[k], k in [0, n).
template <InitOut K, bool kMid>
inline void InitConvertT(typename InitOutType<K>::type* __restrict out,
                         const uint32_t* __restrict w, int64_t n, float mid, float half) {
  int64_t k = 0;
#if defined(__F16C__)
  if constexpr (K == InitOut::kF16) {  // 8 at a time (compilers leave the cast scalar)
    for (; k + 8 <= n; k += 8) {
      float v[8];
      for (int j = 0; j < 8; ++j) v[j] = InitValueT<kMid>(w[k + j], mid, half);
      const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(v), _MM_FROUND_TO_NEAREST_INT);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), h);
    }
  }
#endif
  for (; k < n; ++k) {
    const float v = InitValueT<kMid>(w[k], mid, half);
    if constexpr (K == InitOut::kF32) {
      out[k] = v;
    } else if constexpr (K == InitOut::kBF16) {
      out[k] = Bf16Rne(v);
    } else {
      out[k] = F16Rne(v);
    }
  }
}

template <InitOut K>
inline void InitConvert(typename InitOutType<K>::type* __restrict out,
                        const uint32_t* __restrict w, int64_t n, float mid, float half) {
  if (mid == 0.0f) {
    InitConvertT<K, false>(out, w, n, mid, half);
  } else {
    InitConvertT<K, true>(out, w, n, mid, half);
  }
}

// InitConvert with non-temporal stores where out is aligned (a large buffer:
// the lines are not read before they are written, nor kept in the caches).
template <InitOut K>
inline void InitConvertNt(typename InitOutType<K>::type* __restrict out,
                          const uint32_t* __restrict w, int64_t n, float mid, float half) {
  using O = typename InitOutType<K>::type;
#if defined(__SSE2__)
  constexpr int kPer = kVecBytes / sizeof(O);
  const uintptr_t at = reinterpret_cast<uintptr_t>(out);
  const int64_t head = static_cast<int64_t>((kVecBytes - at % kVecBytes) % kVecBytes / sizeof(O));
  if (at % sizeof(O) == 0 && head + kPer <= n) {
    InitConvert<K>(out, w, head, mid, half);
    out += head;
    w += head;
    n -= head;
    int64_t k = 0;
    for (; k + kPer <= n; k += kPer) {
      alignas(kVecBytes) O v[kPer];
      InitConvert<K>(v, w + k, kPer, mid, half);
#if defined(__AVX512F__)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(out + k), _mm512_load_si512(v));
#elif defined(__AVX__)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(out + k),
                          _mm256_load_si256(reinterpret_cast<const __m256i*>(v)));
#else
      _mm_stream_si128(reinterpret_cast<__m128i*>(out + k),
                       _mm_load_si128(reinterpret_cast<const __m128i*>(v)));
#endif
    }
    out += k;
    w += k;
    n -= k;
  }
#endif
  InitConvert<K>(out, w, n, mid, half);
}

constexpr int64_t kInitNtBytes = 32 << 20;  // outputs past the caches: streamed

// One piece's effective rows: buffer rows [begin, end), which hold rows
// row0 + (r - offset) of `stream`, columns [col0, col0 + width) in [0, width).
struct InitPiece {
  int64_t begin, end, offset;
  uint32_t row0, stream;
  int32_t col0;
  int64_t width;  // clamped to [0, cols]
  float mid, half;
};

struct InitScratch {
  alignas(64) uint32_t rel[kInitBlock];   // a block's counters: rows row + rel[i],
  alignas(64) uint32_t qrel[kInitBlock];  // columns of words q + qrel[i]
  alignas(64) uint32_t w[4 * kInitBlock];
};

// Buffer rows [r0, r1) of piece p (inside its effective rows), every column.
template <InitOut K>
void InitPieceRows(typename InitOutType<K>::type* buf, int64_t cols, const InitPiece& p,
                   int64_t r0, int64_t r1, uint32_t k0, uint32_t k1, bool nt, InitScratch* s) {
  using O = typename InitOutType<K>::type;
  const int64_t width = p.width;
  if (width == 0) {
    std::memset(buf + r0 * cols, 0, (r1 - r0) * cols * sizeof(O));
    return;
  }
  const int64_t shift = p.col0 & 3;
  const uint32_t q0 = static_cast<uint32_t>(p.col0 >> 2);
  const int64_t tn = (shift + width + 3) / 4;  // counters per row
  const int64_t i1 = r1 - p.offset;             // rows [i, i1) of the piece to draw
  int64_t i = r0 - p.offset;
  O* out = buf + r0 * cols;
  if (tn <= kInitBlock) {  // whole rows per block: narrow rows stay vectorized
    const int64_t per = kInitBlock / tn;
    for (int64_t k = 0, r = 0, t = 0; k < per * tn; ++k) {
      s->rel[k] = static_cast<uint32_t>(r);
      s->qrel[k] = static_cast<uint32_t>(t);
      if (++t == tn) {
        t = 0;
        ++r;
      }
    }
    // Whole rows map to contiguous words: one conversion per block.
    const bool dense = shift == 0 && width == cols && cols % 4 == 0;
    for (; i < i1; i += per) {
      const int64_t nr = std::min(per, i1 - i);
      const int n = static_cast<int>(nr * tn);
      const int padded = (n + kPhiloxStep - 1) / kPhiloxStep * kPhiloxStep;
      PhiloxWords(s->rel, s->qrel, p.row0 + static_cast<uint32_t>(i), q0, p.stream, k0, k1,
                  padded, s->w);
      if (dense) {
        if (nt) {
          InitConvertNt<K>(out, s->w, nr * cols, p.mid, p.half);
        } else {
          InitConvert<K>(out, s->w, nr * cols, p.mid, p.half);
        }
        out += nr * cols;
        continue;
      }
      for (int64_t k = 0; k < nr; ++k, out += cols) {
        InitConvert<K>(out, s->w + 4 * tn * k + shift, width, p.mid, p.half);
        if (width < cols) std::memset(out + width, 0, (cols - width) * sizeof(O));
      }
    }
    return;
  }
  for (int64_t k = 0; k < kInitBlock; ++k) {  // wide rows: blocks of counters of one row
    s->rel[k] = 0;
    s->qrel[k] = static_cast<uint32_t>(k);
  }
  for (; i < i1; ++i, out += cols) {
    for (int64_t t = 0; t < tn; t += kInitBlock) {
      const int64_t m = std::min<int64_t>(kInitBlock, tn - t);
      const int padded = static_cast<int>((m + kPhiloxStep - 1) / kPhiloxStep * kPhiloxStep);
      PhiloxWords(s->rel, s->qrel, p.row0 + static_cast<uint32_t>(i),
                  q0 + static_cast<uint32_t>(t), p.stream, k0, k1, padded, s->w);
      const int64_t jlo = std::max<int64_t>(0, 4 * t - shift);
      const int64_t jhi = std::min<int64_t>(width, 4 * (t + m) - shift);
      InitConvert<K>(out + jlo, s->w + (jlo + shift - 4 * t), jhi - jlo, p.mid, p.half);
    }
    if (width < cols) std::memset(out + width, 0, (cols - width) * sizeof(O));
  }
}

// Asks for transparent huge pages under a large output not yet touched: XLA
// allocates it afresh each call, and its first touch, here, then takes one page
// fault per 2 MiB instead of per 4 KiB (each thread faults in its own rows). A
// hint: JAXREC_CPU_HUGEPAGES=0 turns it off, as for the tables.
void AdviseFreshHugePages(void* data, int64_t bytes) {
#if defined(MADV_HUGEPAGE)
  constexpr int64_t kHuge = 2 << 20;
  static const bool enabled = [] {
    const char* env = std::getenv("JAXREC_CPU_HUGEPAGES");
    return !(env && env[0] == '0');
  }();
  if (!enabled || bytes < 8 * kHuge) return;
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~uintptr_t(kHuge - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(data) + bytes) & ~uintptr_t(kHuge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#endif
}

// Buffer rows [r0, r1): each piece's rows drawn, the rest zero.
template <InitOut K>
void InitRows(typename InitOutType<K>::type* buf, int64_t cols,
              const std::vector<InitPiece>& pieces, int64_t r0, int64_t r1, uint32_t k0,
              uint32_t k1, bool nt) {
  using O = typename InitOutType<K>::type;
  InitScratch s;
  std::memset(&s, 0, sizeof(s));
  int64_t at = r0;  // rows [r0, at) written
  for (const InitPiece& p : pieces) {
    const int64_t b = std::max(p.begin, r0), e = std::min(p.end, r1);
    if (b >= e) continue;
    if (b > at) std::memset(buf + at * cols, 0, (b - at) * cols * sizeof(O));
    InitPieceRows<K>(buf, cols, p, b, e, k0, k1, nt, &s);
    at = e;
  }
  if (r1 > at) std::memset(buf + at * cols, 0, (r1 - at) * cols * sizeof(O));
#if defined(__SSE2__)
  if (nt) _mm_sfence();  // the streamed lines reach memory before the call returns
#endif
}

// jaxrec_uniform_rows: key uint32[2], ints int32[P, 6] (offset, nrows, stream,
// row0, col0, width), floats float32[P, 2] (mid, half), sorted by offset ->
// a [rows, cols] float32 / bfloat16 / float16 buffer. As the reference, buffer
// row r belongs to the last piece whose offset is at or before r, if r is
// among its nrows; a width past cols is cols. Offsets out of order are an error.
ffi::Error UniformRowsImpl(ffi::Buffer<ffi::U32> key, ffi::Buffer<ffi::S32> ints,
                           ffi::Buffer<ffi::F32> floats, ffi::Result<ffi::AnyBuffer> out) {
  const auto dims = out->dimensions();
  if (dims.size() != 2) {
    return ffi::Error::InvalidArgument("jaxrec_uniform_rows: the output must be [rows, cols]");
  }
  const int64_t rows = dims[0], cols = dims[1];
  const auto idims = ints.dimensions(), fdims = floats.dimensions();
  if (key.element_count() != 2 || idims.size() != 2 || idims[1] != 6 || fdims.size() != 2 ||
      fdims[1] != 2 || fdims[0] != idims[0]) {
    return ffi::Error::InvalidArgument(
        "jaxrec_uniform_rows: expected key uint32[2], ints int32[P, 6], floats float32[P, 2]");
  }
  const ffi::DataType type = out->element_type();
  if (type != ffi::F32 && type != ffi::BF16 && !(kInitF16 && type == ffi::F16)) {
    return ffi::Error::InvalidArgument(
        "jaxrec_uniform_rows: the output must be float32 or bfloat16" +
        std::string(kInitF16 ? " or float16" : " (float16 is not built)"));
  }
  const int64_t np = idims[0];
  const int32_t* in = ints.typed_data();
  const float* fl = floats.typed_data();
  std::vector<InitPiece> pieces;
  pieces.reserve(np);
  for (int64_t i = 0; i < np; ++i) {
    const int32_t* f = in + 6 * i;
    const int64_t offset = f[0], nrows = f[1];
    if (i + 1 < np && f[6] < offset) {
      return ffi::Error::InvalidArgument(
          "jaxrec_uniform_rows: pieces must be sorted by offset; piece " + std::to_string(i + 1) +
          " (offset " + std::to_string(f[6]) + ") comes after offset " + std::to_string(offset));
    }
    const int64_t next = i + 1 < np ? f[6] : rows;  // a later piece takes its rows
    InitPiece p;
    p.begin = std::clamp<int64_t>(offset, 0, rows);
    p.end = std::clamp<int64_t>(std::min(offset + nrows, next), p.begin, rows);
    p.offset = offset;
    p.stream = static_cast<uint32_t>(f[2]);
    p.row0 = static_cast<uint32_t>(f[3]);
    p.col0 = f[4];
    p.width = std::clamp<int64_t>(f[5], 0, cols);
    p.mid = fl[2 * i];
    p.half = fl[2 * i + 1];
    if (p.end > p.begin) pieces.push_back(p);
  }
  if (rows == 0 || cols == 0) return ffi::Error::Success();
  const uint32_t k0 = key.typed_data()[0], k1 = key.typed_data()[1];
  void* data = out->untyped_data();
  const int64_t bytes = static_cast<int64_t>(out->size_bytes());
  AdviseFreshHugePages(data, bytes);
  const bool nt = bytes >= kInitNtBytes;
  const int n = ThreadsFor(bytes);
  ParallelFor(n, [&](int t, int parts) {
    const int64_t r0 = rows * t / parts, r1 = rows * (t + 1) / parts;
    if (type == ffi::F32) {
      InitRows<InitOut::kF32>(static_cast<float*>(data), cols, pieces, r0, r1, k0, k1, nt);
    } else if (type == ffi::BF16) {
      InitRows<InitOut::kBF16>(static_cast<uint16_t*>(data), cols, pieces, r0, r1, k0, k1,
                               nt);
    } else {
      InitRows<InitOut::kF16>(static_cast<uint16_t*>(data), cols, pieces, r0, r1, k0, k1,
                              nt);
    }
  });
  return ffi::Error::Success();
}

}  // namespace
