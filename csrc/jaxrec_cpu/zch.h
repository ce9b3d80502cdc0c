// jaxrec_zch_train_step / jaxrec_zch_remap: jaxrec.modules.zch_index.train_step and remap
// on the host, bit for bit (the same state, rows, evicted rows and counts), the state
// updated in place (its buffers aliased to the results: a donated state is not copied).
//
// Pass 1 hashes each valid id (fmix64, jaxrec.sparse.ids64.hash64_words) to its bucket and
// scans the bucket's ways; hits are stamped (last_seen = now, counts += 1 per occurrence),
// misses listed. The misses are sorted by (bucket, hi, lo): each run of one id is a
// distinct miss, its occurrences counted, and its place in that order is train_step's
// sorted position (where its evicted row goes when max_evictions >= C). Admission sees
// every distinct miss's sketch increments first (as the XLA scatter-adds), then each
// bucket's admitted ids, in order, take the bucket's ways ranked once per bucket on the
// state after the hits (class: free, evictable, taken; then the policy's keys; then the
// way): the r-th admitted id the r-th way, unless r >= ways or that way is taken.
// Work per call: O(C log C + C * ways). Include after sets.h (FastDiv32).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int32_t kZchFill = INT32_MAX;  // jaxrec.modules.zch_index.FILL
constexpr uint64_t kZchGolden = 0x9E3779B97F4A7C15ull;
enum ZchClass : uint32_t { kZchFree = 0, kZchEvictable = 1, kZchTaken = 2 };
enum ZchPolicy : int64_t { kZchLru = 0, kZchLfu = 1, kZchTtl = 2 };
enum ZchAdmission : int64_t { kZchAdmitAll = 0, kZchFrequency = 1, kZchProbability = 2 };

// fmix64 of id ^ seeded(seed): jaxrec.sparse.ids64.hash64_words.
inline uint64_t ZchHash(uint32_t lo, uint32_t hi, uint64_t seeded) {
  uint64_t k = ((static_cast<uint64_t>(hi) << 32) | lo) ^ seeded;
  k ^= k >> 33;
  k *= 0xFF51AFD7ED558CCDull;
  k ^= k >> 33;
  k *= 0xC4CEB9FE1A85EC53ull;
  return k ^ (k >> 33);
}

struct ZchKernelLayout {
  int64_t slots, ways, total_buckets, bucket_offset, row_offset;
  uint64_t seeded;  // seed * golden + golden (mod 2**64)
  int64_t policy, ttl, admission, threshold, cutoff;
  int64_t buckets() const { return slots / ways; }
};

inline int32_t ZchRow(const ZchKernelLayout& L, int64_t slot) {  // int32 wrap, as XLA's add
  return static_cast<int32_t>(static_cast<uint32_t>(L.row_offset) + static_cast<uint32_t>(slot));
}

// The id's local bucket, or -1 when it is not one of this index's buckets.
struct ZchBucketer {
  FastDiv32 by_total;
  int64_t offset, buckets;
  uint64_t seeded;
  explicit ZchBucketer(const ZchKernelLayout& L)
      : by_total(static_cast<uint32_t>(L.total_buckets)), offset(L.bucket_offset),
        buckets(L.buckets()), seeded(L.seeded) {}
  int64_t operator()(uint32_t lo, uint32_t hi, uint32_t* h_lo) const {
    const uint64_t h = ZchHash(lo, hi, seeded);
    *h_lo = static_cast<uint32_t>(h);
    const int64_t b = static_cast<int64_t>(by_total.Mod(static_cast<uint32_t>(h >> 32))) - offset;
    return b >= 0 && b < buckets ? b : -1;
  }
};

// The first way of bucket `b` holding the id (XLA's argmax of the match), or -1.
inline int64_t ZchFind(const ZchKernelLayout& L, const uint32_t* id_lo, const uint32_t* id_hi,
                       const int32_t* last_seen, int64_t b, uint32_t lo, uint32_t hi) {
  const int64_t base = b * L.ways;
  for (int64_t w = 0; w < L.ways; ++w) {
    const int64_t s = base + w;
    if (id_lo[s] == lo && id_hi[s] == hi && last_seen[s] >= 0) return w;
  }
  return -1;
}

struct ZchMiss {  // one missed occurrence; sorted by key = (bucket, hi), then lo
  uint64_t key;
  uint32_t lo, i;
};

struct ZchScratch {
  std::vector<int64_t> bucket;   // [C] local bucket, -1 invalid
  std::vector<int32_t> hit;      // [C] hit slot, -1 none (stamped after every lookup)
  std::vector<ZchMiss> miss;
  std::vector<uint32_t> starts;  // each distinct miss's first position in `miss`, + end
  std::vector<uint8_t> admit;    // per distinct miss
  std::vector<unsigned __int128> cand;  // a bucket's ways: class, keys, way
};

struct ZchState {
  uint32_t *id_lo, *id_hi;
  int32_t *last_seen, *counts, *sketch, *current_iter, *occupancy;
};

struct ZchOut {
  int32_t* rows;     // [C]
  int32_t* evicted;  // [E]
  int64_t n_evicted_out;
  int32_t admitted, evicted_ids, rejected;
};

inline uint64_t ZchBiased(int32_t x) { return static_cast<uint32_t>(x) ^ 0x80000000u; }

// The sketch cells of an id (jaxrec.modules.zch_index._sketch_cells).
inline void ZchSketchCells(const ZchKernelLayout& L, int64_t b, uint32_t h_lo, int64_t* c1,
                           int64_t* c2) {
  const uint32_t w = static_cast<uint32_t>(L.ways);
  const uint32_t first = h_lo % w;
  const uint32_t step = 1u + (h_lo >> 16) % std::max<uint32_t>(w - 1, 1);
  const uint32_t second = L.ways > 1 ? (first + step) % w : first;
  *c1 = b * L.ways + first;
  *c2 = b * L.ways + second;
}

inline void ZchTrainStep(const ZchKernelLayout& L, const ZchState& st, const uint32_t* lo,
                         const uint32_t* hi, const bool* valid, int64_t c, ZchOut* o,
                         ZchScratch* sc) {
  const int32_t now = static_cast<int32_t>(static_cast<uint32_t>(*st.current_iter) + 1u);
  const int64_t W = L.ways;
  const ZchBucketer bucket_of(L);
  auto& bucket = sc->bucket;
  auto& hit = sc->hit;
  auto& miss = sc->miss;
  bucket.resize(c);
  hit.resize(c);
  miss.clear();
  uint32_t h_lo;
  for (int64_t i = 0; i < c; ++i) bucket[i] = valid[i] ? bucket_of(lo[i], hi[i], &h_lo) : -1;
  // lookups on the state as given (a stamp of now < 0 would hide a slot: stamp after)
  const bool stamp_now = now >= 0;
  constexpr int64_t kAhead = 8;
  for (int64_t i = 0; i < c; ++i) {
    if (i + kAhead < c && bucket[i + kAhead] >= 0) {
      const int64_t s = bucket[i + kAhead] * W;
      __builtin_prefetch(st.id_lo + s, 0, 1);
      __builtin_prefetch(st.id_hi + s, 0, 1);
      __builtin_prefetch(st.last_seen + s, 0, 1);
    }
    hit[i] = -1;
    o->rows[i] = kZchFill;
    const int64_t b = bucket[i];
    if (b < 0) continue;
    const int64_t w = ZchFind(L, st.id_lo, st.id_hi, st.last_seen, b, lo[i], hi[i]);
    if (w >= 0) {
      const int64_t s = b * W + w;
      hit[i] = static_cast<int32_t>(s);
      o->rows[i] = ZchRow(L, s);
      if (stamp_now) {
        st.last_seen[s] = now;
        st.counts[s] = static_cast<int32_t>(static_cast<uint32_t>(st.counts[s]) + 1u);
      }
    } else {
      miss.push_back({(static_cast<uint64_t>(b) << 32) | hi[i], lo[i], static_cast<uint32_t>(i)});
    }
  }
  if (!stamp_now) {
    for (int64_t i = 0; i < c; ++i) {
      if (hit[i] < 0) continue;
      st.last_seen[hit[i]] = now;
      st.counts[hit[i]] = static_cast<int32_t>(static_cast<uint32_t>(st.counts[hit[i]]) + 1u);
    }
  }
  // the distinct misses in (bucket, hi, lo) order
  std::sort(miss.begin(), miss.end(), [](const ZchMiss& a, const ZchMiss& b) {
    return a.key != b.key ? a.key < b.key : a.lo < b.lo;
  });
  const int64_t m = static_cast<int64_t>(miss.size());
  auto& starts = sc->starts;
  starts.clear();
  for (int64_t k = 0; k < m; ++k) {
    if (k == 0 || miss[k].key != miss[k - 1].key || miss[k].lo != miss[k - 1].lo) {
      starts.push_back(static_cast<uint32_t>(k));
    }
  }
  const int64_t d = static_cast<int64_t>(starts.size());
  starts.push_back(static_cast<uint32_t>(m));
  auto bucket_at = [&](int64_t g) { return static_cast<int64_t>(miss[starts[g]].key >> 32); };
  auto hi_at = [&](int64_t g) { return static_cast<uint32_t>(miss[starts[g]].key); };
  auto hash_lo = [&](int64_t g) {
    return static_cast<uint32_t>(ZchHash(miss[starts[g]].lo, hi_at(g), L.seeded));
  };
  // admission: every distinct miss's sightings are added before any is judged
  auto& admit = sc->admit;
  admit.assign(d, 1);
  if (L.admission == kZchFrequency) {
    uint32_t* sketch = reinterpret_cast<uint32_t*>(st.sketch);
    for (int64_t g = 0; g < d; ++g) {
      int64_t c1, c2;
      ZchSketchCells(L, bucket_at(g), hash_lo(g), &c1, &c2);
      const uint32_t occ = starts[g + 1] - starts[g];
      sketch[c1] += occ;
      if (c2 != c1) sketch[c2] += occ;
    }
    for (int64_t g = 0; g < d; ++g) {
      int64_t c1, c2;
      ZchSketchCells(L, bucket_at(g), hash_lo(g), &c1, &c2);
      admit[g] = std::min(st.sketch[c1], st.sketch[c2]) >= L.threshold;
    }
  } else if (L.admission == kZchProbability && L.cutoff < (int64_t{1} << 32)) {
    for (int64_t g = 0; g < d; ++g) admit[g] = hash_lo(g) < static_cast<uint64_t>(L.cutoff);
  }
  // each bucket's admitted ids take its ranked ways
  const int64_t e = o->n_evicted_out;
  const bool in_place = e >= c;  // evicted rows at their ids' sorted positions
  for (int64_t k = 0; k < e; ++k) o->evicted[k] = kZchFill;
  auto& cand = sc->cand;
  cand.resize(W);
  int32_t admitted = 0, n_ev = 0, rejected = 0, filled = 0;
  for (int64_t g0 = 0, g1; g0 < d; g0 = g1) {
    const int64_t b = bucket_at(g0);
    int64_t wanted = 0;
    for (g1 = g0; g1 < d && bucket_at(g1) == b; ++g1) wanted += admit[g1];
    const int64_t base = b * W;
    const int64_t ranked = std::min(wanted, W);
    if (ranked > 0) {
      for (int64_t w = 0; w < W; ++w) {
        const int32_t seen = st.last_seen[base + w];
        uint32_t cls;
        if (seen < 0) {
          cls = kZchFree;
        } else if (L.policy == kZchTtl) {
          const int32_t age = static_cast<int32_t>(static_cast<uint32_t>(now) -
                                                   static_cast<uint32_t>(seen));
          cls = age > L.ttl && seen != now ? kZchEvictable : kZchTaken;
        } else {
          cls = seen == now ? kZchTaken : kZchEvictable;
        }
        const int32_t k1 = L.policy == kZchLfu ? st.counts[base + w] : seen;
        cand[w] = (static_cast<unsigned __int128>(cls) << 96) |
                  (static_cast<unsigned __int128>(ZchBiased(k1)) << 64) |
                  (static_cast<unsigned __int128>(ZchBiased(seen)) << 32) |
                  static_cast<uint64_t>(w);
      }
      if (ranked == 1) {
        std::iter_swap(cand.begin(), std::min_element(cand.begin(), cand.end()));
      } else {
        std::partial_sort(cand.begin(), cand.begin() + ranked, cand.end());
      }
    }
    int64_t rank = 0;
    for (int64_t g = g0; g < g1; ++g) {
      const uint32_t first = starts[g], end = starts[g + 1];
      if (!admit[g]) {
        ++rejected;
        continue;
      }
      const int64_t r = rank++;
      const uint32_t cls = r < W ? static_cast<uint32_t>(cand[r] >> 96) : kZchTaken;
      if (cls == kZchTaken) {
        ++rejected;
        continue;
      }
      const int64_t s = base + static_cast<int64_t>(static_cast<uint32_t>(cand[r]));
      ++admitted;
      if (cls == kZchEvictable) {
        if (in_place) {
          o->evicted[first] = ZchRow(L, s);
        } else if (n_ev < e) {
          o->evicted[n_ev] = ZchRow(L, s);
        }
        ++n_ev;
      } else {
        ++filled;
      }
      st.id_lo[s] = miss[first].lo;
      st.id_hi[s] = hi_at(g);
      st.last_seen[s] = now;
      st.counts[s] = static_cast<int32_t>(end - first);
      const int32_t row = ZchRow(L, s);
      for (uint32_t k = first; k < end; ++k) o->rows[miss[k].i] = row;
    }
  }
  *st.current_iter = now;
  *st.occupancy = static_cast<int32_t>(static_cast<uint32_t>(*st.occupancy) +
                                       static_cast<uint32_t>(filled));
  o->admitted = admitted;
  o->evicted_ids = n_ev;
  o->rejected = rejected;
}

// The layout from the FFI attributes, or an error message.
inline const char* ZchCheckLayout(const ZchKernelLayout& L) {
  if (L.ways < 1 || L.slots < L.ways || L.slots % L.ways || L.slots > INT32_MAX) {
    return "slots must be a positive multiple of ways, below 2**31";
  }
  if (L.total_buckets < 1 || L.total_buckets > UINT32_MAX || L.bucket_offset < 0 ||
      L.bucket_offset + L.buckets() > L.total_buckets) {
    return "a bad bucket range";
  }
  if (L.policy < kZchLru || L.policy > kZchTtl || L.admission < kZchAdmitAll ||
      L.admission > kZchProbability || L.ttl < INT32_MIN || L.ttl > INT32_MAX) {
    return "a bad policy";
  }
  return nullptr;
}

inline ZchKernelLayout ZchLayoutOf(int64_t slots, int64_t ways, int64_t total_buckets,
                                   int64_t bucket_offset, int64_t row_offset, int64_t seed,
                                   int64_t policy, int64_t ttl, int64_t admission,
                                   int64_t threshold, int64_t cutoff) {
  const uint64_t seeded = static_cast<uint64_t>(seed) * kZchGolden + kZchGolden;
  return {slots, ways, total_buckets, bucket_offset, row_offset, seeded,
          policy, ttl, admission, threshold, cutoff};
}

// The FFI handler: the state in (aliased to the first seven results), ids, valid; rows,
// evicted rows and [admitted, evicted, rejected] out.
ffi::Error ZchTrainStepImpl(
    ffi::Buffer<ffi::U32> id_lo_in, ffi::Buffer<ffi::U32> id_hi_in,
    ffi::Buffer<ffi::S32> last_seen_in, ffi::Buffer<ffi::S32> counts_in,
    ffi::Buffer<ffi::S32> sketch_in, ffi::Buffer<ffi::S32> iter_in,
    ffi::Buffer<ffi::S32> occupancy_in, ffi::Buffer<ffi::U32> lo, ffi::Buffer<ffi::U32> hi,
    ffi::Buffer<ffi::PRED> valid, ffi::ResultBuffer<ffi::U32> id_lo,
    ffi::ResultBuffer<ffi::U32> id_hi, ffi::ResultBuffer<ffi::S32> last_seen,
    ffi::ResultBuffer<ffi::S32> counts, ffi::ResultBuffer<ffi::S32> sketch,
    ffi::ResultBuffer<ffi::S32> iter, ffi::ResultBuffer<ffi::S32> occupancy,
    ffi::ResultBuffer<ffi::S32> rows, ffi::ResultBuffer<ffi::S32> evicted,
    ffi::ResultBuffer<ffi::S32> tally, int64_t slots, int64_t ways, int64_t total_buckets,
    int64_t bucket_offset, int64_t row_offset, int64_t seed, int64_t policy, int64_t ttl,
    int64_t admission, int64_t threshold, int64_t cutoff) {
  const ZchKernelLayout L = ZchLayoutOf(slots, ways, total_buckets, bucket_offset, row_offset,
                                        seed, policy, ttl, admission, threshold, cutoff);
  if (const char* why = ZchCheckLayout(L)) {
    return ffi::Error::InvalidArgument(std::string("jaxrec_zch_train_step: ") + why);
  }
  const int64_t c = static_cast<int64_t>(lo.element_count());
  const int64_t s = L.slots;
  const int64_t ns = L.admission == kZchFrequency ? s : static_cast<int64_t>(sketch_in.element_count());
  if (static_cast<int64_t>(id_lo_in.element_count()) != s ||
      static_cast<int64_t>(id_hi_in.element_count()) != s ||
      static_cast<int64_t>(last_seen_in.element_count()) != s ||
      static_cast<int64_t>(counts_in.element_count()) != s ||
      static_cast<int64_t>(sketch_in.element_count()) != ns || iter_in.element_count() != 1 ||
      occupancy_in.element_count() != 1 || static_cast<int64_t>(hi.element_count()) != c ||
      static_cast<int64_t>(valid.element_count()) != c ||
      static_cast<int64_t>(rows->element_count()) != c || tally->element_count() != 3 ||
      c >= INT32_MAX) {
    return ffi::Error::InvalidArgument("jaxrec_zch_train_step: arrays of the wrong sizes");
  }
  // the state is updated in place: the results alias the inputs (else start from a copy)
  auto take = [](auto& in, auto& out) {
    if (in.untyped_data() != out->untyped_data() && in.element_count()) {
      std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
    }
    return out->typed_data();
  };
  const ZchState st{take(id_lo_in, id_lo),   take(id_hi_in, id_hi),   take(last_seen_in, last_seen),
                    take(counts_in, counts), take(sketch_in, sketch), take(iter_in, iter),
                    take(occupancy_in, occupancy)};
  thread_local ZchScratch scratch;
  ZchOut o{rows->typed_data(), evicted->typed_data(),
           static_cast<int64_t>(evicted->element_count()), 0, 0, 0};
  ZchTrainStep(L, st, lo.typed_data(), hi.typed_data(), valid.typed_data(), c, &o, &scratch);
  int32_t* t = tally->typed_data();
  t[0] = o.admitted;
  t[1] = o.evicted_ids;
  t[2] = o.rejected;
  return ffi::Error::Success();
}

// Eval: each id's row, FILL for ids not held; the state is only read.
ffi::Error ZchRemapImpl(ffi::Buffer<ffi::U32> id_lo, ffi::Buffer<ffi::U32> id_hi,
                        ffi::Buffer<ffi::S32> last_seen, ffi::Buffer<ffi::U32> lo,
                        ffi::Buffer<ffi::U32> hi, ffi::Buffer<ffi::PRED> valid,
                        ffi::ResultBuffer<ffi::S32> rows, int64_t slots, int64_t ways,
                        int64_t total_buckets, int64_t bucket_offset, int64_t row_offset,
                        int64_t seed) {
  const ZchKernelLayout L = ZchLayoutOf(slots, ways, total_buckets, bucket_offset, row_offset,
                                        seed, kZchLru, 0, kZchAdmitAll, 0, 0);
  if (const char* why = ZchCheckLayout(L)) {
    return ffi::Error::InvalidArgument(std::string("jaxrec_zch_remap: ") + why);
  }
  const int64_t c = static_cast<int64_t>(lo.element_count());
  if (static_cast<int64_t>(id_lo.element_count()) != L.slots ||
      static_cast<int64_t>(id_hi.element_count()) != L.slots ||
      static_cast<int64_t>(last_seen.element_count()) != L.slots ||
      static_cast<int64_t>(hi.element_count()) != c ||
      static_cast<int64_t>(valid.element_count()) != c ||
      static_cast<int64_t>(rows->element_count()) != c) {
    return ffi::Error::InvalidArgument("jaxrec_zch_remap: arrays of the wrong sizes");
  }
  const ZchBucketer bucket_of(L);
  const uint32_t *l = lo.typed_data(), *h = hi.typed_data();
  const uint32_t *il = id_lo.typed_data(), *ih = id_hi.typed_data();
  const int32_t* seen = last_seen.typed_data();
  const bool* v = valid.typed_data();
  int32_t* out = rows->typed_data();
  uint32_t h_lo;
  std::vector<int64_t> bucket(c);  // hashes first, then probes with the lines prefetched
  for (int64_t i = 0; i < c; ++i) bucket[i] = v[i] ? bucket_of(l[i], h[i], &h_lo) : -1;
  constexpr int64_t kAhead = 8;
  for (int64_t i = 0; i < c; ++i) {
    if (i + kAhead < c && bucket[i + kAhead] >= 0) {
      const int64_t s = bucket[i + kAhead] * L.ways;
      __builtin_prefetch(il + s, 0, 1);
      __builtin_prefetch(ih + s, 0, 1);
      __builtin_prefetch(seen + s, 0, 1);
    }
    const int64_t b = bucket[i];
    const int64_t w = b < 0 ? -1 : ZchFind(L, il, ih, seen, b, l[i], h[i]);
    out[i] = w < 0 ? kZchFill : ZchRow(L, b * L.ways + w);
  }
  return ffi::Error::Success();
}

}  // namespace
