// The fused backward + optimizer updates (from per-id arrays, and from a KJT).
// Part of jaxrec_cpu.cc (one translation unit: included once, in order).
#pragma once

namespace {

// ----- fused backward + optimizer update -----
enum class Opt { kSgd, kRowwiseAdagrad, kAdagrad };
enum WdMode { kNone = 0, kL2 = 1, kDecouple = 2 };

struct Hyper {
  float lr, eps, wd;
  int mode;
};

// A fused update runs in three parallel phases over a per-row mark array:
// 1. count each row's ids (threads own contiguous row ranges);
// 2. rows read once (most rows of a large table) are updated right away, in
//    id order (threads own id ranges): an id's output-gradient row is then
//    shared with its bag's neighbours, in cache;
// 3. rows read several times are grouped (a counting sort, in row order) and
//    their gradients summed in id order before one update (row ranges again).
// uniq[u] is such a row; its ids are occ[start[u] .. start[u + 1]). Buffers
// are reused across calls.
struct Groups {
  std::vector<int32_t> multi, uniq, start, occ;
};

// A zeroed int32 array on huge pages (random accesses to it then rarely miss
// the TLB; with 4 KiB pages its misses stall each id of a large table).
struct MarkArray {
  int32_t* data = nullptr;
  size_t bytes = 0;
  ~MarkArray() {
    if (data) munmap(data, bytes);
  }
  bool Reserve(int64_t n) {
    const size_t need = ((static_cast<size_t>(n) * 4 + (2u << 20) - 1) >> 21) << 21;
    if (need <= bytes) return true;
    if (data) munmap(data, bytes);
    void* p = mmap(nullptr, need, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      data = nullptr;
      bytes = 0;
      return false;
    }
#if defined(MADV_HUGEPAGE)
    madvise(p, need, MADV_HUGEPAGE);
#endif
    data = static_cast<int32_t*>(p);
    bytes = need;
    return true;
  }
};

struct UpdateScratch {
  MarkArray mark;  // per row: 0 when untouched (restored after each call)
  std::vector<Groups> groups;
};

// Scratch of the calling (XLA) thread: concurrent calls from other threads
// (devices of one process) get their own.
UpdateScratch* Scratch(int64_t r, int nt) {
  thread_local UpdateScratch s;
  if (!s.mark.Reserve(r)) return nullptr;
  if (static_cast<int>(s.groups.size()) < nt) s.groups.resize(nt);
  return &s;
}

constexpr int kMarkAhead = 16;

// Phase 1: mark[row] = number of ids of row, for rows in [lo, hi).
// Rows reaching a second id are listed in `multi` (phase 3 then visits them
// only, not every row of the range).
void CountRows(const int32_t* rows, int64_t c_total, int64_t lo, int64_t hi, int32_t* mark,
               std::vector<int32_t>& multi) {
  multi.clear();
  for (int64_t c = 0; c < c_total; ++c) {
    if (c + kMarkAhead < c_total) {
      const int32_t ahead = rows[c + kMarkAhead];
      if (ahead >= lo && ahead < hi) __builtin_prefetch(&mark[ahead], 1, 3);
    }
    const int32_t row = rows[c];
    if (row >= lo && row < hi && ++mark[row] == 2) multi.push_back(row);
  }
}

// Phase 3 set-up: groups the ids of rows in [lo, hi) read more than once;
// their marks become -(1 + the row's next slot in occ) (0 again after the update).
void GroupRows(const int32_t* rows, int64_t c_total, int64_t lo, int64_t hi, int32_t* mark,
               Groups& g) {
  g.uniq.clear();
  g.start.clear();
  int32_t total = 0;
  for (const int32_t row : g.multi) {
    const int32_t n = mark[row];
    g.uniq.push_back(row);
    g.start.push_back(total);
    mark[row] = -(total + 1);
    total += n;
  }
  g.start.push_back(total);
  g.occ.resize(total);
  if (total == 0) return;
  for (int64_t c = 0; c < c_total; ++c) {
    if (c + kMarkAhead < c_total) {
      const int32_t ahead = rows[c + kMarkAhead];
      if (ahead >= lo && ahead < hi) __builtin_prefetch(&mark[ahead], 0, 3);
    }
    const int32_t row = rows[c];
    if (row >= lo && row < hi && mark[row] < 0) g.occ[-(mark[row]--) - 1] = static_cast<int32_t>(c);
  }
}

// One optimizer step on one row: w (d elements, table dtype), its state,
// gradient gr (float32); wr is scratch.
template <Opt kOpt, typename T>
inline void ApplyRow(T* __restrict__ row, float* __restrict__ m, int64_t d,
                     const float* __restrict__ gr, float* __restrict__ wr, const Hyper& h) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(wr, row, d * sizeof(float));
  } else {
    for (int64_t j = 0; j < d; ++j) wr[j] = ToF32(row[j]);
  }
  const float lr = h.lr, wd = h.wd;
  const bool l2 = h.mode == kL2, decouple = h.mode == kDecouple;
  if constexpr (kOpt == Opt::kSgd) {
    int64_t j = 0;
    if (!l2 && !decouple) {
      for (; j + kVL <= d; j += kVL) StoreV(wr + j, LoadV(wr + j) - LoadV(gr + j) * lr);
    }
    for (; j < d; ++j) {
      float gj = l2 ? gr[j] + wd * wr[j] : gr[j];
      float wj = decouple ? wr[j] - (lr * wd) * wr[j] : wr[j];
      wr[j] = wj - lr * gj;
    }
  } else if constexpr (kOpt == Opt::kAdagrad) {  // m: the row's [d] accumulators
    for (int64_t j = 0; j < d; ++j) {
      float gj = l2 ? gr[j] + wd * wr[j] : gr[j];
      float mj = m[j] + gj * gj;
      m[j] = mj;
      float wj = decouple ? wr[j] - (lr * wd) * wr[j] : wr[j];
      wr[j] = wj - (lr * gj) / (std::sqrt(mj) + h.eps);
    }
  } else {  // row-wise Adagrad; m: the row's accumulator
    // sum of squares in native-width partial sums (XLA's reduction order is not
    // sequential either: it agrees to rounding)
    VF acc = VF{};
    int64_t j = 0;
    for (; j + kVL <= d; j += kVL) {
      VF g = LoadV(gr + j);
      if (l2) g = g + LoadV(wr + j) * wd;
      VF sq = g * g;
      acc += sq;
    }
    float sum = 0.0f;
    for (int i = 0; i < kVL; ++i) sum += acc[i];
    for (; j < d; ++j) {
      float gj = l2 ? gr[j] + wd * wr[j] : gr[j];
      float sq = gj * gj;
      sum += sq;
    }
    const float mnew = *m + sum / static_cast<float>(d);
    *m = mnew;
    const float mult = lr / (std::sqrt(mnew) + h.eps);
    const float corr = l2 ? 1.0f - mult * wd : decouple ? 1.0f - lr * wd : 1.0f;
    int64_t k = 0;
    for (; k + kVL <= d; k += kVL) {
      VF a = LoadV(wr + k) * corr;
      VF b = LoadV(gr + k) * mult;
      StoreV(wr + k, a - b);
    }
    for (; k < d; ++k) {
      float a = corr * wr[k];
      float b = mult * gr[k];
      wr[k] = a - b;
    }
  }
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(row, wr, d * sizeof(float));
  } else {
    for (int64_t j = 0; j < d; ++j) FromF32(wr[j], row + j);
  }
}

// dst[j] (+)= src[j] * s: the rounded product, then the sum (as XLA).
template <bool kFirst>
inline void AddScaled(float* __restrict__ dst, const float* __restrict__ src, float s, int64_t d) {
  int64_t j = 0;
  for (; j + kVL <= d; j += kVL) {
    VF x = LoadV(src + j) * s;
    StoreV(dst + j, (kFirst ? VF{} : LoadV(dst + j)) + x);
  }
  for (; j < d; ++j) {
    float x = src[j] * s;
    dst[j] = (kFirst ? 0.0f : dst[j]) + x;
  }
}

template <Opt kOpt>
inline float* StateOf(float* m, int64_t row, int64_t d) {
  if constexpr (kOpt == Opt::kSgd) return nullptr;
  if constexpr (kOpt == Opt::kRowwiseAdagrad) return m + row;
  return m + row * d;
}

struct UpdateArgs {
  int64_t r, d, n_out;
  const float* out_grad;
  const int32_t* seg;
  const float* scale;
  const int32_t* rows;
  float* m;
  Hyper h;
  const int64_t* goff = nullptr;  // if set: id c's gradient row is out_grad + goff[c]
};

template <Opt kOpt, typename T>
inline void PrefetchState(const UpdateArgs& a, T* w, int64_t row) {
  PrefetchRow(w + row * a.d, a.d * static_cast<int64_t>(sizeof(T)));
  if constexpr (kOpt == Opt::kRowwiseAdagrad) __builtin_prefetch(a.m + row, 1, 2);
  if constexpr (kOpt == Opt::kAdagrad) PrefetchRow(a.m + row * a.d, a.d * 4);
}

inline const float* GradRow(const UpdateArgs& a, int64_t c) {
  if (a.goff) return a.out_grad + a.goff[c];
  return a.out_grad + std::min<int64_t>(std::max<int64_t>(a.seg[c], 0), a.n_out - 1) * a.d;
}

// Phase 2: ids [c0, c1) whose row is read once: update it right away.
template <Opt kOpt, typename T>
void UpdateSingles(const UpdateArgs& a, T* w, int32_t* mark, int64_t c0, int64_t c1) {
  thread_local std::vector<float> gbuf, wbuf;
  gbuf.resize(a.d);
  wbuf.resize(a.d);
  const int ahead = 2 * PrefetchAhead(a.d * static_cast<int64_t>(sizeof(T)));
  for (int64_t c = c0; c < c1; ++c) {
    if (c + ahead < c1) {
      const int32_t row = a.rows[c + ahead];
      if (row >= 0 && row < a.r) {
        PrefetchState<kOpt>(a, w, row);
        __builtin_prefetch(&mark[row], 1, 2);
      }
      // One-id bags (one-hot features) read a new, strided gradient row per id.
      if (a.goff && a.goff[c + ahead] != a.goff[c + ahead - 1]) {
        PrefetchRow(a.out_grad + a.goff[c + ahead], a.d * 4);
      }
    }
    const int32_t row = a.rows[c];
    if (row < 0 || row >= a.r || mark[row] != 1) continue;
    mark[row] = 0;
    AddScaled<true>(gbuf.data(), GradRow(a, c), a.scale[c], a.d);
    ApplyRow<kOpt>(w + row * a.d, StateOf<kOpt>(a.m, row, a.d), a.d, gbuf.data(), wbuf.data(),
                   a.h);
  }
}

// Phase 3: the grouped rows (read several times), gradients summed in id order
// in register accumulators (Pool), the group's gradient rows prefetched ahead.
template <Opt kOpt, typename T>
void UpdateGroups(const UpdateArgs& a, T* w, int32_t* mark, const Groups& g) {
  thread_local std::vector<float> gbuf, wbuf;
  gbuf.resize(a.d);
  wbuf.resize(a.d);
  float* gr = gbuf.data();
  const int64_t u_total = static_cast<int64_t>(g.uniq.size());
  const int64_t grad_bytes = a.d * 4;
  const int ahead = 2 * PrefetchAhead(a.d * static_cast<int64_t>(sizeof(T)));
  const int grad_ahead = PrefetchAhead(grad_bytes);
  auto prefetch = [&](int64_t u) {  // the row, its state, its first gradient rows
    PrefetchState<kOpt>(a, w, g.uniq[u]);
    const int32_t end = std::min(g.start[u + 1], g.start[u] + 2);
    for (int32_t k = g.start[u]; k < end; ++k) PrefetchRow(GradRow(a, g.occ[k]), grad_bytes);
  };
  auto grad_of = [&](int64_t k) -> const float* { return GradRow(a, g.occ[k]); };
  auto scale_of = [&](int64_t k) { return a.scale[g.occ[k]]; };
  for (int64_t u = 0; u < std::min<int64_t>(ahead, u_total); ++u) prefetch(u);
  for (int64_t u = 0; u < u_total; ++u) {
    if (u + ahead < u_total) prefetch(u + ahead);
    const int32_t range[2] = {g.start[u], g.start[u + 1]};
    Prefetcher<float, decltype(grad_of)> pf{range, 1, grad_of, grad_bytes};
    pf.Init(grad_ahead);
    Pool<float, true, true>(a.d, range[0], range[1], grad_of, scale_of, gr, &pf);
    const int64_t row = g.uniq[u];
    ApplyRow<kOpt>(w + row * a.d, StateOf<kOpt>(a.m, row, a.d), a.d, gr, wbuf.data(), a.h);
    mark[row] = 0;
  }
}

template <Opt kOpt, typename T>
bool FusedUpdate(const UpdateArgs& a, T* w, int64_t c_total, double* times) {
  const int nt = ThreadsFor(c_total * a.d * 8);
  UpdateScratch* sp = Scratch(a.r, nt);
  if (!sp) return false;
  UpdateScratch& scratch = *sp;
  int32_t* mark = scratch.mark.data;
  auto t0 = std::chrono::steady_clock::now();
  ParallelFor(nt, [&](int t, int n) {
    CountRows(a.rows, c_total, a.r * t / n, a.r * (t + 1) / n, mark, scratch.groups[t].multi);
  });
  auto t1 = std::chrono::steady_clock::now();
  ParallelFor(nt, [&](int t, int n) {
    UpdateSingles<kOpt>(a, w, mark, c_total * t / n, c_total * (t + 1) / n);
  });
  auto t2 = std::chrono::steady_clock::now();
  ParallelFor(nt, [&](int t, int n) {
    Groups& g = scratch.groups[t];
    GroupRows(a.rows, c_total, a.r * t / n, a.r * (t + 1) / n, mark, g);
    UpdateGroups<kOpt>(a, w, mark, g);
  });
  auto t3 = std::chrono::steady_clock::now();
  times[0] = std::chrono::duration<double, std::milli>(t1 - t0).count();
  times[1] = std::chrono::duration<double, std::milli>(t2 - t1).count();
  times[2] = std::chrono::duration<double, std::milli>(t3 - t2).count();
  return true;
}

template <Opt kOpt>
ffi::Error BackwardUpdate(ffi::Result<ffi::AnyBuffer> table, float* m, ffi::Buffer<ffi::F32> og,
                          ffi::Buffer<ffi::S32> seg, ffi::Buffer<ffi::F32> scale,
                          ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> lr, float eps,
                          float wd, int32_t mode) {
  auto td = table->dimensions();
  if (td.size() != 2) return ffi::Error::InvalidArgument("jaxrec_backward_update: table [R, D]");
  const int64_t r = td[0], d = td[1];
  auto gd = og.dimensions();
  if (gd.size() != 2 || gd[1] != d) {
    return ffi::Error::InvalidArgument("jaxrec_backward_update: out_grad must be [N, D]");
  }
  const int64_t c = static_cast<int64_t>(rows.element_count());
  if (static_cast<int64_t>(seg.element_count()) != c ||
      static_cast<int64_t>(scale.element_count()) != c) {
    return ffi::Error::InvalidArgument("jaxrec_backward_update: rows, seg, scale differ in size");
  }
  const bool is_f32 = table->element_type() == ffi::F32;
  if (!is_f32 && table->element_type() != ffi::BF16) {
    return ffi::Error::InvalidArgument("jaxrec_backward_update: table must be f32 or bf16");
  }
  if (c == 0 || r == 0 || gd[0] == 0) return ffi::Error::Success();
  AdviseHugePages(table->untyped_data(), r * d * (is_f32 ? 4 : 2));
  if (m) AdviseHugePages(m, (kOpt == Opt::kAdagrad ? r * d : r) * 4);
  const UpdateArgs a{r,
                     d,
                     gd[0],
                     og.typed_data(),
                     seg.typed_data(),
                     scale.typed_data(),
                     rows.typed_data(),
                     m,
                     Hyper{lr.typed_data()[0], eps, wd, mode}};
  double times[3];
  const bool ok = is_f32 ? FusedUpdate<kOpt>(a, static_cast<float*>(table->untyped_data()), c, times)
                         : FusedUpdate<kOpt>(a, static_cast<bf16_t*>(table->untyped_data()), c, times);
  if (!ok) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "jaxrec_backward_update: no memory for the per-row scratch");
  }
  if (std::getenv("JAXREC_CPU_TIMING")) {
    std::fprintf(stderr, "update: count %.2f ms, single rows %.2f ms, grouped rows %.2f ms\n",
                 times[0], times[1], times[2]);
  }
  return ffi::Error::Success();
}


// ----- fused backward + update straight from a KeyedJaggedTensor -----
// slots[s] = (key, row_offset, num_embeddings, is_mean, col): bag b of slot s
// has output gradient g[b, col : col + D] (g is the [B, W] gradient of the
// collection's pooled output, every group's columns side by side). Each id of
// the slot's key becomes (row, gradient offset, scale) in slot order, as
// jaxrec.ops.backward.pooled_grad_sources lists them (out-of-range ids are
// skipped, as BoundsCheckMode.IGNORE; invalid bags are empty, by BagOffsets,
// and non-finite weights count as zero); then the fused update above runs. No
// per-id arrays cross into XLA, and the [B, W] gradient is read in place.
struct KjtIds {
  std::vector<int32_t> rows;
  std::vector<int64_t> goff;
  std::vector<float> scale;
};

int64_t KjtIdList(const int32_t* values, const int32_t* lengths, const float* pvw,
                  const int32_t* slots, int64_t n_slots, const int32_t* starts, int64_t b,
                  int64_t w_cols, int64_t r, KjtIds& out) {
  int64_t total = 0;
  for (int64_t s = 0; s < n_slots; ++s) {
    const int32_t k = slots[5 * s];
    total += starts[k + 1] - starts[k];
  }
  out.rows.resize(total);
  out.goff.resize(total);
  out.scale.resize(total);
  int64_t n = 0;
  std::vector<int32_t> o(b + 1);
  for (int64_t s = 0; s < n_slots; ++s) {
    const int32_t* sl = slots + 5 * s;
    const int64_t k = sl[0], row_offset = sl[1], num = sl[2], col = sl[4];
    const bool mean = sl[3] != 0;
    BagOffsets(lengths + k * b, b, starts[k], starts[k + 1], o.data());  // invalid bags: empty
    for (int64_t i = 0; i < b; ++i) {
      const float inv = mean ? 1.0f / static_cast<float>(std::max(o[i + 1] - o[i], 1)) : 1.0f;
      const int64_t go = i * w_cols + col;
      for (int64_t c = o[i]; c < o[i + 1]; ++c) {
        const int64_t id = values[c];
        const bool ok = id >= 0 && id < num;
        out.rows[n] = ok ? static_cast<int32_t>(id + row_offset) : static_cast<int32_t>(r);
        out.goff[n] = go;
        float sc = ok ? 1.0f : 0.0f;
        if (pvw) sc = sc * FiniteOrZero(pvw[c]);
        out.scale[n] = mean ? sc * inv : sc;
        ++n;
      }
    }
  }
  return n;
}

template <Opt kOpt>
ffi::Error KjtBackwardUpdate(ffi::Result<ffi::AnyBuffer> table, float* m, ffi::Buffer<ffi::F32> g,
                             ffi::Buffer<ffi::S32> values, ffi::Buffer<ffi::S32> lengths,
                             ffi::Buffer<ffi::F32> pvw, ffi::Buffer<ffi::S32> slots,
                             ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::F32> lr, float eps,
                             float wd, int32_t mode) {
  auto td = table->dimensions();
  auto gd = g.dimensions();
  auto sd = slots.dimensions();
  const int64_t n_keys = static_cast<int64_t>(starts.element_count()) - 1;
  if (td.size() != 2 || gd.size() != 2 || sd.size() != 2 || sd[1] != 5 || n_keys < 0 ||
      static_cast<int64_t>(lengths.element_count()) != n_keys * gd[0]) {
    return ffi::Error::InvalidArgument(
        "jaxrec_kjt_backward_update: table [R, D], g [B, W], lengths [F * B], slots [S, 5], "
        "starts [F + 1]");
  }
  const int64_t r = td[0], d = td[1], b = gd[0], w_cols = gd[1], n_slots = sd[0];
  const int64_t v = static_cast<int64_t>(values.element_count());
  const int32_t* st = starts.typed_data();
  for (int64_t k = 0; k < n_keys; ++k) {
    if (st[0] < 0 || st[k] > st[k + 1] || st[n_keys] > v) {
      return ffi::Error::InvalidArgument("jaxrec_kjt_backward_update: starts");
    }
  }
  for (int64_t s = 0; s < n_slots; ++s) {
    const int32_t* sl = slots.typed_data() + 5 * s;
    if (sl[0] < 0 || sl[0] >= n_keys || sl[4] < 0 || sl[4] + d > w_cols) {
      return ffi::Error::InvalidArgument("jaxrec_kjt_backward_update: slot key or column");
    }
  }
  const bool is_f32 = table->element_type() == ffi::F32;
  if (!is_f32 && table->element_type() != ffi::BF16) {
    return ffi::Error::InvalidArgument("jaxrec_kjt_backward_update: table must be f32 or bf16");
  }
  if (r == 0 || b == 0) return ffi::Error::Success();
  const float* pv = static_cast<int64_t>(pvw.element_count()) == v && v > 0 ? pvw.typed_data()
                                                                            : nullptr;
  thread_local KjtIds ids;
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t c = KjtIdList(values.typed_data(), lengths.typed_data(), pv, slots.typed_data(),
                              n_slots, st, b, w_cols, r, ids);
  if (c == 0) return ffi::Error::Success();
  AdviseHugePages(table->untyped_data(), r * d * (is_f32 ? 4 : 2));
  if (m) AdviseHugePages(m, (kOpt == Opt::kAdagrad ? r * d : r) * 4);
  UpdateArgs a{r, d, b, g.typed_data(), nullptr, ids.scale.data(), ids.rows.data(), m,
               Hyper{lr.typed_data()[0], eps, wd, mode}};
  a.goff = ids.goff.data();
  double times[3];
  const bool ok = is_f32 ? FusedUpdate<kOpt>(a, static_cast<float*>(table->untyped_data()), c, times)
                         : FusedUpdate<kOpt>(a, static_cast<bf16_t*>(table->untyped_data()), c, times);
  if (!ok) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "jaxrec_kjt_backward_update: no memory for the per-row scratch");
  }
  if (std::getenv("JAXREC_CPU_TIMING")) {
    const double list_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() -
        times[0] - times[1] - times[2];
    std::fprintf(stderr, "kjt update: ids %.2f ms, count %.2f ms, single rows %.2f ms, "
                 "grouped rows %.2f ms\n", list_ms, times[0], times[1], times[2]);
  }
  return ffi::Error::Success();
}

// Operands: table, [state,] g, values, lengths, weights, slots, starts, lr, dep
// (dep: the loss, only so that XLA orders the forward's reads before this write).
ffi::Error KjtSgdImpl(ffi::AnyBuffer, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::S32> values,
                      ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::F32> pvw,
                      ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> starts,
                      ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::F32>,
                      ffi::Result<ffi::AnyBuffer> table, float eps, float wd, int32_t mode) {
  return KjtBackwardUpdate<Opt::kSgd>(table, nullptr, g, values, lengths, pvw, slots, starts, lr,
                                      eps, wd, mode);
}

template <Opt kOpt>
ffi::Error KjtStatefulImpl(ffi::AnyBuffer, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32> g,
                           ffi::Buffer<ffi::S32> values, ffi::Buffer<ffi::S32> lengths,
                           ffi::Buffer<ffi::F32> pvw, ffi::Buffer<ffi::S32> slots,
                           ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::F32> lr,
                           ffi::Buffer<ffi::F32>, ffi::Result<ffi::AnyBuffer> table,
                           ffi::ResultBuffer<ffi::F32> m, float eps, float wd, int32_t mode) {
  const size_t want = kOpt == Opt::kAdagrad ? table->element_count()
                                            : static_cast<size_t>(table->dimensions()[0]);
  if (m->element_count() != want) {
    return ffi::Error::InvalidArgument("jaxrec_kjt_backward_update: state shape");
  }
  return KjtBackwardUpdate<kOpt>(table, m->typed_data(), g, values, lengths, pvw, slots, starts,
                                 lr, eps, wd, mode);
}

// Inputs after the aliased table (and state) buffers; the results alias them.
ffi::Error SgdImpl(ffi::AnyBuffer, ffi::Buffer<ffi::F32> og, ffi::Buffer<ffi::S32> seg,
                   ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> rows,
                   ffi::Buffer<ffi::F32> lr, ffi::Result<ffi::AnyBuffer> table, float eps,
                   float wd, int32_t mode) {
  return BackwardUpdate<Opt::kSgd>(table, nullptr, og, seg, scale, rows, lr, eps, wd, mode);
}

ffi::Error RowwiseAdagradImpl(ffi::AnyBuffer, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32> og,
                              ffi::Buffer<ffi::S32> seg, ffi::Buffer<ffi::F32> scale,
                              ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> lr,
                              ffi::Result<ffi::AnyBuffer> table,
                              ffi::ResultBuffer<ffi::F32> m, float eps, float wd, int32_t mode) {
  if (m->element_count() != static_cast<size_t>(table->dimensions()[0])) {
    return ffi::Error::InvalidArgument("jaxrec_backward_update: row-wise state must be [R]");
  }
  return BackwardUpdate<Opt::kRowwiseAdagrad>(table, m->typed_data(), og, seg, scale, rows, lr,
                                              eps, wd, mode);
}

ffi::Error AdagradImpl(ffi::AnyBuffer, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32> og,
                       ffi::Buffer<ffi::S32> seg, ffi::Buffer<ffi::F32> scale,
                       ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> lr,
                       ffi::Result<ffi::AnyBuffer> table, ffi::ResultBuffer<ffi::F32> m,
                       float eps, float wd, int32_t mode) {
  if (m->element_count() != table->element_count()) {
    return ffi::Error::InvalidArgument("jaxrec_backward_update: Adagrad state must be [R, D]");
  }
  return BackwardUpdate<Opt::kAdagrad>(table, m->typed_data(), og, seg, scale, rows, lr, eps,
                                       wd, mode);
}

}  // namespace
