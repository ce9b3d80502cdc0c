// The machine's ceilings for the pooled lookup's access pattern, measured by
// bench/compare_torchrec.py beside the kernels: a sequential read of a buffer
// and a gather of rows by id, each summed in registers (nothing written but
// one row of sums per thread), or summed per bag into written rows (the
// forward's own traffic). Not used by the FFI targets.
// Part of jaxrec_cpu.cc (one translation unit: included once, in order).
#pragma once

namespace {

using Clock = std::chrono::steady_clock;

// Sum of the floats of [p, p + n), in kVL lanes (order: lane-wise, then lanes).
VF ReadSumRange(const float* p, int64_t n) {
  constexpr int kU = 8;  // independent accumulators: loads, not adds, bound the loop
  VF acc[kU];
  for (int u = 0; u < kU; ++u) acc[u] = VF{};
  int64_t i = 0;
  for (; i + kU * kVL <= n; i += kU * kVL) {
    for (int u = 0; u < kU; ++u) acc[u] += LoadV(p + i + u * kVL);
  }
  for (; i + kVL <= n; i += kVL) acc[0] += LoadV(p + i);
  for (int u = 1; u < kU; ++u) acc[0] += acc[u];
  for (; i < n; ++i) acc[0][0] += p[i];
  return acc[0];
}

// Reads floats [0, n) of p with `threads` threads (contiguous parts); returns
// the seconds taken and, in *sum, the sum of every float (a checksum).
double ReadBandwidth(const float* p, int64_t n, int threads, double* sum) {
  std::vector<VF> part(threads);
  const auto t0 = Clock::now();
  ParallelFor(threads, [&](int t, int nt) {
    const int64_t lo = n * t / nt / kVL * kVL, hi = t + 1 == nt ? n : n * (t + 1) / nt / kVL * kVL;
    part[t] = ReadSumRange(p + lo, hi - lo);
  });
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  double total = 0;
  for (const VF& v : part) {
    for (int l = 0; l < kVL; ++l) total += v[l];
  }
  *sum = total;
  return s;
}

// acc[0, NV) += rows ids[c] for c in [c0, c1), prefetching row ids[c + ahead]
// (every cache line, into L1) before each row is read.
template <int NV>
void GatherBlock(const float* w, int64_t d, const int32_t* ids, int64_t c0, int64_t c1,
                 int64_t ahead, int64_t j0, float* out) {
  VF acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = VF{};
  const int64_t row_bytes = d * 4;
  for (int64_t c = c0; c < c1; ++c) {
    if (ahead > 0 && c + ahead < c1) {
      const char* q = reinterpret_cast<const char*>(w + ids[c + ahead] * d);
      for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(q + o, 0, 3);
    }
    const float* p = w + ids[c] * d + j0;
    for (int v = 0; v < NV; ++v) acc[v] += LoadV(p + v * kVL);
  }
  for (int v = 0; v < NV; ++v) {
    VF o = LoadV(out + j0 + v * kVL) + acc[v];
    StoreV(out + j0 + v * kVL, o);
  }
}

template <int NV>
void GatherBlockN(int nv, const float* w, int64_t d, const int32_t* ids, int64_t c0, int64_t c1,
                  int64_t ahead, int64_t j0, float* out) {
  if constexpr (NV > 0) {
    if (nv == NV) return GatherBlock<NV>(w, d, ids, c0, c1, ahead, j0, out);
    return GatherBlockN<NV - 1>(nv, w, d, ids, c0, c1, ahead, j0, out);
  }
}

// Sums rows ids[0, n) of the float32 [R, d] buffer w with `threads` threads
// (contiguous parts of ids), `ahead` rows prefetched ahead (0: none). Returns
// the seconds taken; sums[0, d) gets the column sums. Ids are not checked.
double GatherRows(const float* w, int64_t d, const int32_t* ids, int64_t n, int threads,
                  int64_t ahead, float* sums) {
  constexpr int kMaxNV = 16;
  const int64_t dv = d / kVL * kVL;
  std::vector<float> part(static_cast<size_t>(threads) * d, 0.0f);
  const auto t0 = Clock::now();
  ParallelFor(threads, [&](int t, int nt) {
    const int64_t c0 = n * t / nt, c1 = n * (t + 1) / nt;
    float* out = part.data() + t * d;
    int64_t j0 = 0;
    for (; j0 + kMaxNV * kVL <= dv; j0 += kMaxNV * kVL) {
      GatherBlock<kMaxNV>(w, d, ids, c0, c1, j0 == 0 ? ahead : 0, j0, out);
    }
    if (j0 < dv) {
      GatherBlockN<kMaxNV - 1>(static_cast<int>((dv - j0) / kVL), w, d, ids, c0, c1,
                               j0 == 0 ? ahead : 0, j0, out);
    }
    for (int64_t j = dv; j < d; ++j) {
      for (int64_t c = c0; c < c1; ++c) out[j] += w[ids[c] * d + j];
    }
  });
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  for (int64_t j = 0; j < d; ++j) {
    float x = 0.0f;
    for (int t = 0; t < threads; ++t) x += part[t * d + j];
    sums[j] = x;
  }
  return s;
}

// out[g][j0, j0 + NV * kVL) = the sum of rows ids[g * per, (g + 1) * per),
// in registers, for g in [g0, g1); rows prefetched `ahead` ids on (0: none).
template <int NV>
void GatherPoolBlock(const float* w, int64_t d, const int32_t* ids, int64_t g0, int64_t g1,
                     int64_t per, int64_t ahead, int64_t j0, float* out) {
  const int64_t row_bytes = d * 4, c_end = g1 * per;
  int64_t c = g0 * per;
  for (int64_t g = g0; g < g1; ++g) {
    VF acc[NV];
    for (int v = 0; v < NV; ++v) acc[v] = VF{};
    for (const int64_t e = c + per; c < e; ++c) {
      if (ahead > 0 && c + ahead < c_end) {
        const char* q = reinterpret_cast<const char*>(w + ids[c + ahead] * d);
        for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(q + o, 0, 3);
      }
      const float* p = w + ids[c] * d + j0;
      for (int v = 0; v < NV; ++v) acc[v] += LoadV(p + v * kVL);
    }
    for (int v = 0; v < NV; ++v) StoreV(out + g * d + j0 + v * kVL, acc[v]);
  }
}

template <int NV>
void GatherPoolBlockN(int nv, const float* w, int64_t d, const int32_t* ids, int64_t g0,
                      int64_t g1, int64_t per, int64_t ahead, int64_t j0, float* out) {
  if constexpr (NV > 0) {
    if (nv == NV) return GatherPoolBlock<NV>(w, d, ids, g0, g1, per, ahead, j0, out);
    return GatherPoolBlockN<NV - 1>(nv, w, d, ids, g0, g1, per, ahead, j0, out);
  }
}

// The forward's minimal traffic: rows ids[0, n) read, each run of `per`
// consecutive ids summed into one row of out ([n / per, d], written once, in
// order), `threads` threads over whole runs, `ahead` rows prefetched. At one
// id per bag a pooled lookup writes as much as it reads; GatherRows, which
// writes nothing, then understates its ceiling. Returns the seconds taken.
double GatherPoolRows(const float* w, int64_t d, const int32_t* ids, int64_t n, int64_t per,
                      int threads, int64_t ahead, float* out) {
  constexpr int kMaxNV = 16;
  const int64_t groups = per > 0 ? n / per : 0, dv = d / kVL * kVL;
  const auto t0 = Clock::now();
  ParallelFor(threads, [&](int t, int nt) {
    const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
    int64_t j0 = 0;
    for (; j0 + kMaxNV * kVL <= dv; j0 += kMaxNV * kVL) {
      GatherPoolBlock<kMaxNV>(w, d, ids, g0, g1, per, j0 == 0 ? ahead : 0, j0, out);
    }
    if (j0 < dv) {
      GatherPoolBlockN<kMaxNV - 1>(static_cast<int>((dv - j0) / kVL), w, d, ids, g0, g1, per,
                                   j0 == 0 ? ahead : 0, j0, out);
    }
    for (int64_t j = dv; j < d; ++j) {  // tail columns
      for (int64_t g = g0; g < g1; ++g) {
        float x = 0.0f;
        for (int64_t c = g * per; c < (g + 1) * per; ++c) x += w[ids[c] * d + j];
        out[g * d + j] = x;
      }
    }
  });
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace
