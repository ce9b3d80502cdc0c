// Pooled lookups: over segment ids, and straight from a KeyedJaggedTensor.
// Part of jaxrec_cpu.cc (one translation unit: included once, in order).
#pragma once

namespace {

// ----- embedding bag over segment ids -----
template <typename T>
void EmbeddingBagTyped(const T* w, int64_t r, int64_t d, const int32_t* rows, const int32_t* seg,
                       const float* scale, int64_t c_total, float* out, int64_t s_total) {
  AdviseHugePages(w, r * d * static_cast<int64_t>(sizeof(T)));
  int n = ThreadsFor(c_total * d * static_cast<int64_t>(sizeof(T)));
  n = static_cast<int>(std::min<int64_t>(n, std::max<int64_t>(s_total, 1)));
  ParallelFor(n, [&](int t, int nt) {
    const int64_t lo = s_total * t / nt, hi = s_total * (t + 1) / nt;
    std::memset(out + lo * d, 0, sizeof(float) * (hi - lo) * d);
    if (r == 0) return;
    // This thread's runs of equal segment ids it owns: [start, end) pairs.
    std::vector<int32_t> runs;
    for (int64_t c = 0; c < c_total;) {
      const int32_t sg = seg[c];
      int64_t e = c + 1;
      while (e < c_total && seg[e] == sg) ++e;
      if (sg >= lo && sg < hi) {
        runs.push_back(static_cast<int32_t>(c));
        runs.push_back(static_cast<int32_t>(e));
      }
      c = e;
    }
    auto row_of = [&](int64_t c) {
      return w + std::min<int64_t>(std::max<int64_t>(rows[c], 0), r - 1) * d;
    };
    auto scale_of = [&](int64_t c) { return scale[c]; };
    Prefetcher<T, decltype(row_of)> pf{runs.data(), runs.size() / 2, row_of,
                                       d * static_cast<int64_t>(sizeof(T))};
    pf.Init(PrefetchAhead(d * static_cast<int64_t>(sizeof(T))));
    for (size_t i = 0; i < runs.size(); i += 2) {
      Pool<T, true, false>(d, runs[i], runs[i + 1], row_of, scale_of, out + seg[runs[i]] * d,
                           &pf);
    }
  });
}

ffi::Error EmbeddingBagImpl(ffi::AnyBuffer weights, ffi::Buffer<ffi::S32> rows,
                            ffi::Buffer<ffi::S32> seg, ffi::Buffer<ffi::F32> scale,
                            ffi::ResultBuffer<ffi::F32> out) {
  auto wd = weights.dimensions();
  auto od = out->dimensions();
  if (wd.size() != 2 || od.size() != 2 || od[1] != wd[1]) {
    return ffi::Error::InvalidArgument("jaxrec_embedding_bag: weights [R, D] and out [S, D]");
  }
  const int64_t c = static_cast<int64_t>(rows.element_count());
  if (static_cast<int64_t>(seg.element_count()) != c ||
      static_cast<int64_t>(scale.element_count()) != c) {
    return ffi::Error::InvalidArgument("jaxrec_embedding_bag: rows, seg, scale differ in size");
  }
  const int64_t r = wd[0], d = wd[1], s = od[0];
  float* o = out->typed_data();
  if (weights.element_type() == ffi::F32) {
    EmbeddingBagTyped(static_cast<const float*>(weights.untyped_data()), r, d, rows.typed_data(),
                      seg.typed_data(), scale.typed_data(), c, o, s);
  } else if (weights.element_type() == ffi::BF16) {
    EmbeddingBagTyped(static_cast<const bf16_t*>(weights.untyped_data()), r, d,
                      rows.typed_data(), seg.typed_data(), scale.typed_data(), c, o, s);
  } else {
    return ffi::Error::InvalidArgument("jaxrec_embedding_bag: weights must be f32 or bf16");
  }
  return ffi::Error::Success();
}

// ----- table-batched pooled lookup straight from a KeyedJaggedTensor -----
// One slot's bags [lo, hi), read by one thread.
struct KjtSlot {
  const int32_t* values;  // the KJT's ids
  const float* pvw;       // per-sample weights, or nullptr
  const int32_t* o;       // bag i's ids are [o[i], o[i + 1]), contiguous across bags
  bool mean;              // MEAN: sums divided by the bag's length
  bool count_weights;     // count non-finite weights (the first slot reading its key)
  int64_t lo, hi, row_offset, num, ahead;
  float* out;  // bag lo's output; bag i's is out + (i - lo) * out_stride
  int64_t out_stride;
  int64_t bad_base;  // slot * values count: orders bad ids as the XLA path reports them
};

// What a thread found wrong: out-of-range ids (ordered by bad_base + position)
// and non-finite weights (by position).
struct KjtBad {
  int64_t ids = 0, first_id = INT64_MAX, weights = 0, first_weight = INT64_MAX;
  void Id(int64_t at) {
    ++ids;
    first_id = std::min(first_id, at);
  }
  void Weight(int64_t at) {
    ++weights;
    first_weight = std::min(first_weight, at);
  }
};

// KjtSlot's bags when D = NV native vectors (the common dims): the row `ahead`
// ids on in this slot is prefetched (every line, into L1) from one load of its
// id, with no range bookkeeping; a bag's sums stay in NV registers and are
// stored once (MEAN: multiplied by 1 / length first, as the XLA path rounds),
// into lines prefetched for writing kOutAhead bags before.
// kDrop: ids outside [0, num) add nothing and are counted (their prefetch is
// of some address outside the table: prefetches do not fault); else rows are
// clamped to [0, r). Non-finite weights count as zero. The same float order
// as Pool: products rounded, then the sums in id order.
constexpr int64_t kOutAhead = 4;

template <typename T, int NV, bool kDrop, bool kScaled>
void KjtSlotVec(const T* w, int64_t r, const KjtSlot& a, KjtBad* bad) {
  constexpr int64_t d = NV * kVL;
  constexpr int64_t kRowBytes = d * sizeof(T);
  const int32_t* values = a.values;
  const int64_t c_last = a.o[a.hi] - 1, ahead = a.ahead, row_offset = a.row_offset;
  const uintptr_t base = reinterpret_cast<uintptr_t>(w);
  int64_t c = a.o[a.lo];
  float* out = a.out;
  for (int64_t i = a.lo; i < a.hi; ++i, out += a.out_stride) {
    VF acc[NV];
    for (int v = 0; v < NV; ++v) acc[v] = VF{};
    if (i + kOutAhead < a.hi) {  // bag outputs are S * D floats apart: no hardware prefetch
      const char* q = reinterpret_cast<const char*>(out + kOutAhead * a.out_stride);
      for (int64_t b = 0; b < d * 4; b += 64) __builtin_prefetch(q + b, 1, 3);
    }
    for (const int64_t e = a.o[i + 1]; c < e; ++c) {
      if (ahead > 0) {
        int64_t next = values[std::min(c + ahead, c_last)] + row_offset;
        if constexpr (!kDrop) next = std::min<int64_t>(std::max<int64_t>(next, 0), r - 1);
        const char* q = reinterpret_cast<const char*>(base + static_cast<uintptr_t>(next * kRowBytes));
        for (int64_t b = 0; b < kRowBytes; b += 64) __builtin_prefetch(q + b, 0, 3);
      }
      float sc = 1.0f;
      if constexpr (kScaled) {
        sc = a.pvw[c];
        if (!std::isfinite(sc)) {
          sc = 0.0f;
          if (a.count_weights) bad->Weight(c);
        }
      }
      int64_t row = values[c];
      if constexpr (kDrop) {
        if (static_cast<uint64_t>(row) >= static_cast<uint64_t>(a.num)) {
          bad->Id(a.bad_base + c);
          continue;
        }
        row += row_offset;
      } else {
        row = std::min<int64_t>(std::max<int64_t>(row + row_offset, 0), r - 1);
      }
      const T* p = w + row * d;
      if constexpr (kScaled) {
        for (int v = 0; v < NV; ++v) {
          VF x = LoadV(p + v * kVL) * sc;
          acc[v] += x;
        }
      } else {
        for (int v = 0; v < NV; ++v) acc[v] += LoadV(p + v * kVL);
      }
    }
    if (a.mean) {
      const float inv = 1.0f / static_cast<float>(std::max(a.o[i + 1] - a.o[i], 1));
      for (int v = 0; v < NV; ++v) acc[v] = acc[v] * inv;
    }
    for (int v = 0; v < NV; ++v) StoreV(out + v * kVL, acc[v]);
  }
}

// KjtSlotVec for nv = D / kVL in [1, NV]; false (nothing done) for other nv.
template <typename T, int NV, bool kDrop, bool kScaled>
bool KjtSlotVecN(int nv, const T* w, int64_t r, const KjtSlot& a, KjtBad* bad) {
  if constexpr (NV > 0) {
    if (nv == NV) {
      KjtSlotVec<T, NV, kDrop, kScaled>(w, r, a, bad);
      return true;
    }
    return KjtSlotVecN<T, NV - 1, kDrop, kScaled>(nv, w, r, a, bad);
  }
  return false;
}

// Any D: Pool over each bag, with the general prefetcher.
template <typename T>
void KjtSlotAny(const T* w, int64_t r, int64_t d, bool drop, const KjtSlot& a, KjtBad* bad) {
  const int32_t* values = a.values;
  auto row_of = [&](int64_t c) -> const T* {
    const int64_t id = values[c];
    if (drop) {
      if (id < 0 || id >= a.num) return nullptr;
      return w + (id + a.row_offset) * d;
    }
    return w + std::min<int64_t>(std::max<int64_t>(id + a.row_offset, 0), r - 1) * d;
  };
  auto scale_of = [&](int64_t c) { return FiniteOrZero(a.pvw[c]); };
  for (int64_t c = a.o[a.lo]; c < a.o[a.hi]; ++c) {
    const int64_t id = values[c];
    if (drop && (id < 0 || id >= a.num)) bad->Id(a.bad_base + c);
    if (a.pvw && a.count_weights && !std::isfinite(a.pvw[c])) bad->Weight(c);
  }
  const int32_t range[2] = {a.o[a.lo], a.o[a.hi]};
  Prefetcher<T, decltype(row_of)> pf{range, 1, row_of, d * static_cast<int64_t>(sizeof(T))};
  pf.Init(static_cast<int>(a.ahead));
  float* dst = a.out;
  for (int64_t i = a.lo; i < a.hi; ++i, dst += a.out_stride) {
    if (a.pvw) {
      Pool<T, true, true>(d, a.o[i], a.o[i + 1], row_of, scale_of, dst, &pf);
    } else {
      Pool<T, false, true>(d, a.o[i], a.o[i + 1], row_of, scale_of, dst, &pf);
    }
    if (a.mean) {
      const float inv = 1.0f / static_cast<float>(std::max(a.o[i + 1] - a.o[i], 1));
      for (int64_t j = 0; j < d; ++j) dst[j] = dst[j] * inv;
    }
  }
}

// slots[s] = (key, row_offset, num_embeddings, is_mean). Output [B, S, D]:
// out[b, s] pools key `key`'s bag b (its ids id -> row row_offset + id).
// Bags follow jaxrec.sparse.bags' rule (BagOffsets: invalid bags are empty)
// and weights count as zero where not finite. drop != 0: ids outside
// [0, num_embeddings) contribute nothing; drop == 0: rows are clamped to the
// buffer (the XLA path's BoundsCheckMode.NONE). bad = [out-of-range ids, the
// first one, invalid bags of the keys read, the first slot whose key has one,
// non-finite weights of valid bags' ids, the first one's position]; each key
// counted once however many slots read it. Threads split the bags.
template <typename T>
void KjtBagTyped(const T* w, int64_t r, int64_t d, const int32_t* values, const int32_t* lengths,
                 const float* pvw, const int32_t* slots, int64_t n_slots, const int32_t* starts,
                 int64_t n_keys, int64_t b, int64_t v_total, bool drop, float* out,
                 int32_t* bad) {
  AdviseHugePages(w, r * d * static_cast<int64_t>(sizeof(T)));
  // Bag offsets of every key a slot reads: the layout rule in the same walk.
  // Kept across calls (no zeroing per call); workers read it through `offsets`:
  // a thread_local named in the lambda would be each worker's own, empty one.
  thread_local std::vector<int32_t> off;
  if (off.size() < static_cast<size_t>(n_keys * (b + 1))) off.resize(n_keys * (b + 1));
  const int32_t* offsets = off.data();
  std::vector<int64_t> bad_bags(n_keys, -1);  // -1: key not read (yet)
  std::vector<char> first_reader(n_slots, 0);
  int64_t bags = 0, first_slot = -1, ids = 0;
  for (int64_t s = 0; s < n_slots; ++s) {
    const int64_t k = slots[4 * s];
    if (bad_bags[k] >= 0) continue;
    int32_t* o = off.data() + k * (b + 1);
    bad_bags[k] = BagOffsets(lengths + k * b, b, starts[k], starts[k + 1], o);
    first_reader[s] = 1;
    bags += bad_bags[k];
    if (bad_bags[k] > 0 && first_slot < 0) first_slot = s;
  }
  for (int64_t s = 0; s < n_slots; ++s) {
    const int32_t* o = offsets + slots[4 * s] * (b + 1);
    ids += o[b] - o[0];
  }
  int n = ThreadsFor(ids * d * static_cast<int64_t>(sizeof(T)));
  n = static_cast<int>(std::min<int64_t>(n, std::max<int64_t>(b, 1)));
  std::vector<KjtBad> found(n);
  ParallelFor(n, [&](int t, int nt) {
    const int64_t lo = b * t / nt, hi = b * (t + 1) / nt;
    if (r == 0) {
      std::memset(out + lo * n_slots * d, 0, sizeof(float) * (hi - lo) * n_slots * d);
      return;
    }
    KjtBad mine;
    const int nv = d % kVL == 0 ? static_cast<int>(d / kVL) : 0;
    for (int64_t s = 0; s < n_slots; ++s) {
      const int32_t* sl = slots + 4 * s;
      const KjtSlot a{values,
                      pvw,
                      offsets + sl[0] * (b + 1),
                      sl[3] != 0,
                      first_reader[s] != 0,
                      lo,
                      hi,
                      sl[1],
                      sl[2],
                      PrefetchAhead(d * static_cast<int64_t>(sizeof(T))),
                      out + (lo * n_slots + s) * d,
                      n_slots * d,
                      s * v_total};
      bool done;
      if (drop) {
        done = pvw ? KjtSlotVecN<T, 16, true, true>(nv, w, r, a, &mine)
                   : KjtSlotVecN<T, 16, true, false>(nv, w, r, a, &mine);
      } else {
        done = pvw ? KjtSlotVecN<T, 16, false, true>(nv, w, r, a, &mine)
                   : KjtSlotVecN<T, 16, false, false>(nv, w, r, a, &mine);
      }
      if (!done) KjtSlotAny(w, r, d, drop, a, &mine);
    }
    found[t] = mine;
  });
  KjtBad all;
  for (const KjtBad& f : found) {
    all.ids += f.ids;
    all.first_id = std::min(all.first_id, f.first_id);
    all.weights += f.weights;
    all.first_weight = std::min(all.first_weight, f.first_weight);
  }
  auto clip = [](int64_t x) { return static_cast<int32_t>(std::min<int64_t>(x, INT32_MAX)); };
  bad[0] = clip(all.ids);
  bad[1] = all.ids ? values[all.first_id % v_total] : 0;
  bad[2] = clip(bags);
  bad[3] = static_cast<int32_t>(std::max<int64_t>(first_slot, 0));
  bad[4] = clip(all.weights);
  bad[5] = all.weights ? static_cast<int32_t>(all.first_weight) : 0;
}

ffi::Error KjtBagImpl(ffi::AnyBuffer weights, ffi::Buffer<ffi::S32> values,
                      ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::F32> pvw,
                      ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> starts,
                      ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::S32> bad,
                      int32_t drop) {
  auto wd = weights.dimensions();
  auto od = out->dimensions();
  auto sd = slots.dimensions();
  const int64_t n_keys = static_cast<int64_t>(starts.element_count()) - 1;
  if (wd.size() != 2 || od.size() != 3 || od[2] != wd[1] || sd.size() != 2 || sd[1] != 4 ||
      od[1] != sd[0] || n_keys < 0 ||
      static_cast<int64_t>(lengths.element_count()) != n_keys * od[0] ||
      bad->element_count() != 6) {
    return ffi::Error::InvalidArgument(
        "jaxrec_kjt_embedding_bag: weights [R, D], lengths [F * B], slots [S, 4], "
        "starts [F + 1], out [B, S, D], bad [6]");
  }
  const int64_t v = static_cast<int64_t>(values.element_count());
  const int32_t* st = starts.typed_data();
  for (int64_t k = 0; k < n_keys; ++k) {
    if (st[0] < 0 || st[k] > st[k + 1] || st[n_keys] > v) {
      return ffi::Error::InvalidArgument("jaxrec_kjt_embedding_bag: starts");
    }
  }
  const int64_t n_slots = sd[0];
  for (int64_t s = 0; s < n_slots; ++s) {
    const int32_t* sl = slots.typed_data() + 4 * s;
    if (sl[0] < 0 || sl[0] >= n_keys) {
      return ffi::Error::InvalidArgument("jaxrec_kjt_embedding_bag: slot key out of range");
    }
  }
  const float* pv = static_cast<int64_t>(pvw.element_count()) == v && v > 0 ? pvw.typed_data()
                                                                            : nullptr;
  const int64_t r = wd[0], d = wd[1], b = od[0];
  if (weights.element_type() == ffi::F32) {
    KjtBagTyped(static_cast<const float*>(weights.untyped_data()), r, d, values.typed_data(),
                lengths.typed_data(), pv, slots.typed_data(), n_slots, st, n_keys, b, v, drop != 0,
                out->typed_data(), bad->typed_data());
  } else if (weights.element_type() == ffi::BF16) {
    KjtBagTyped(static_cast<const bf16_t*>(weights.untyped_data()), r, d, values.typed_data(),
                lengths.typed_data(), pv, slots.typed_data(), n_slots, st, n_keys, b, v, drop != 0,
                out->typed_data(), bad->typed_data());
  } else {
    return ffi::Error::InvalidArgument("jaxrec_kjt_embedding_bag: weights must be f32 or bf16");
  }
  return ffi::Error::Success();
}

}  // namespace
