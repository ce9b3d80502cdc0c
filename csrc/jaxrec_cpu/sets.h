// jaxrec_cache_plan_sets: jaxrec.cache.sets.plan_sets on the host, bit for bit (the same
// state, slots, packed moves and counts), in place on the (aliased, donated) slot map.
//
// Pass 1 over the ids finds each row's set and scans its ways: hits are stamped now
// (the old stamps journaled), misses listed by set. The misses are grouped by set (a
// counting sort, or a sort when the sets far outnumber them) and each set's distinct
// rows, in row order, take the set's unstamped slots in the policy's order (LRU: stamp,
// slot; LFU: the held row's count or -1, stamp, slot), the k-th row the k-th slot. Only
// then are rows and stamps written; a set with more rows than free slots is an overflow:
// the outputs are those of plan_sets' sort (a row past the free ones takes the ranked
// slot at min(rank, ways - 1)) and the journal restores the state.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

inline uint32_t SetHash(uint32_t x) {  // jaxrec.cache.sets.set_hash
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// a / d and a % d for 32-bit a by a fixed d >= 1 (Lemire, Kaser and Kurz: one multiply).
struct FastDiv32 {
  uint64_t m;
  uint32_t d;
  explicit FastDiv32(uint32_t d_) : m(~uint64_t{0} / d_ + 1), d(d_) {}
  uint32_t Div(uint32_t a) const {
    return d == 1 ? a : static_cast<uint32_t>((static_cast<__uint128_t>(m) * a) >> 64);
  }
  uint32_t Mod(uint32_t a) const {
    return static_cast<uint32_t>((static_cast<__uint128_t>(m * a) * d) >> 64);
  }
};

// Bit k set where set[k] == x, k < 32 (reads 32 ints: the caller keeps them in the array).
inline uint32_t Match32(const int32_t* set, int32_t x) {
#if defined(__AVX2__)
  const __m256i v = _mm256_set1_epi32(x);
  uint32_t m = 0;
  for (int k = 0; k < 4; ++k) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(set + 8 * k));
    m |= static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a, v))))
         << (8 * k);
  }
  return m;
#else
  uint32_t m = 0;
  for (int k = 0; k < 32; ++k) m |= static_cast<uint32_t>(set[k] == x) << k;
  return m;
#endif
}

struct SetsLayout {
  int64_t rows, shard_rows, shards, slots, sets;
  bool lfu;
  int64_t total() const { return shards * slots; }
  int64_t ways() const { return (slots + sets - 1) / sets; }
};

struct SetsPlanOut {  // the outputs of one plan (N-long arrays)
  int32_t *slots, *fill_slots, *fill_rows, *evict_slots, *evict_rows;
  int32_t n_fill, n_evict, n_ids, n_rows;
  bool overflow;
};

// Reused between calls (one per thread that runs plans).
struct SetsScratch {
  std::vector<std::pair<int32_t, int32_t>> journal;  // (slot, old stamp)
  std::vector<uint64_t> miss;    // (set << 32 | i) or, grouped, (local << 32 | i)
  std::vector<uint64_t> sorted;  // misses grouped by set
  std::vector<int32_t> starts;   // counting sort: each set's first miss
  std::vector<std::pair<int32_t, int32_t>> v_slot;  // each distinct miss's (slot, local row)
};

inline uint32_t Biased(int32_t x) { return static_cast<uint32_t>(x) ^ 0x80000000u; }

// The victim key of slot `s` (ascending = evicted first; ties: the lower way).
inline uint64_t VictimKey(const SetsLayout& L, const int32_t* rows, const int32_t* stamps,
                          const int32_t* counts, int64_t s) {
  if (!L.lfu) return Biased(stamps[s]);
  const int32_t held = rows[s];
  int32_t c = -1;
  if (held >= 0) {
    const int64_t g = std::clamp<int64_t>((s / L.slots) * L.shard_rows + held, 0, L.rows - 1);
    c = counts[g];
  }
  return (uint64_t{Biased(c)} << 32) | Biased(stamps[s]);
}

// The free way (a bit of `free`, not 0) of the least key, the lowest of equals; the other
// ways' keys are all ones.
template <int kLanes>
inline int64_t MinWay(const uint64_t* key, uint64_t free) {
  uint64_t least = ~uint64_t{0};
  for (int way = 0; way < kLanes; ++way) least = std::min(least, key[way]);
  uint64_t at = 0;
  for (int way = 0; way < kLanes; ++way) at |= static_cast<uint64_t>(key[way] == least) << way;
  return __builtin_ctzll(at & free);
}

// Fetches the counts of set g's rows into the cache (LFU's victim keys read them).
inline void PrefetchCounts(const SetsLayout& L, const int32_t* rows, const int32_t* counts,
                           int64_t g) {
  const int64_t q = L.slots / L.sets, r = L.slots % L.sets;
  const int64_t shard = g / L.sets, h = g % L.sets;
  const int64_t start = shard * L.slots + h * q + std::min(h, r);
  const int64_t base = shard * L.shard_rows;
  for (int64_t way = 0, size = q + (h < r); way < size; ++way) {
    const int32_t held = rows[start + way];
    if (held >= 0 && base + held < L.rows) __builtin_prefetch(counts + base + held, 0, 1);
  }
}

// Plans one batch in place on rows / stamps / counts / *clock (left as given on overflow).
inline void PlanSets(const SetsLayout& L, int32_t* rows, int32_t* stamps, int32_t* counts,
                     int32_t* clock_io, const int32_t* ids, const bool* valid, int64_t n,
                     SetsPlanOut* o, SetsScratch* sc) {
  const int64_t total = L.total(), w = L.ways();
  const int64_t q = L.slots / L.sets, r = L.slots % L.sets;
  const int32_t clock = static_cast<int32_t>(static_cast<uint32_t>(*clock_io) + 1u);
  auto& journal = sc->journal;
  auto& miss = sc->miss;
  if (static_cast<int64_t>(journal.size()) < 2 * n + 1) journal.resize(2 * n + 1);
  int64_t n_journal = 0;  // hits and (on overflow) fills: at most 2 n
  miss.clear();
  int32_t n_ids = 0;
  const FastDiv32 by_shard(static_cast<uint32_t>(L.shard_rows)), by_sets(static_cast<uint32_t>(L.sets));
  // pass 1: hits stamped, misses listed
  for (int64_t i = 0; i < n; ++i) {
    const int32_t x = ids[i];
    if (!valid[i]) {
      o->slots[i] = x;
      continue;
    }
    if (x < 0 || x >= L.rows) {
      o->slots[i] = x < 0 ? -1 : static_cast<int32_t>(total);
      continue;
    }
    ++n_ids;
    const int64_t shard = by_shard.Div(static_cast<uint32_t>(x));
    const int32_t local = static_cast<int32_t>(x - shard * L.shard_rows);
    const int64_t h = by_sets.Mod(SetHash(static_cast<uint32_t>(local)));
    const int64_t start = shard * L.slots + h * q + std::min(h, r);
    const int64_t size = q + (h < r);
    const int32_t* set = rows + start;
    int64_t way = -1;
    if (size <= 32 && start + 32 <= total) {
      const uint32_t hit = Match32(set, local) & static_cast<uint32_t>((uint64_t{1} << size) - 1);
      if (hit) way = __builtin_ctz(hit);
    } else {
      for (int64_t k = 0; k < size; ++k) {
        if (set[k] == local) {
          way = k;
          break;
        }
      }
    }
    if (way >= 0) {
      const int64_t s = start + way;
      o->slots[i] = static_cast<int32_t>(s);
      const int32_t was = stamps[s];  // journaled when it changes (no branch: hits mix)
      journal[n_journal] = {static_cast<int32_t>(s), was};
      n_journal += was != clock;
      stamps[s] = clock;
    } else {
      miss.push_back((static_cast<uint64_t>(shard * L.sets + h) << 32) | static_cast<uint64_t>(i));
    }
  }
  const int64_t m = static_cast<int64_t>(miss.size());
  const int64_t groups = L.shards * L.sets;
  // the misses grouped by set, each group's entries as (local << 32 | i)
  auto& sorted = sc->sorted;
  auto& starts = sc->starts;
  sorted.resize(m);
  auto local_of = [&](uint64_t e) {
    const int32_t x = ids[static_cast<uint32_t>(e)];
    return static_cast<uint64_t>(x - (x / L.shard_rows) * L.shard_rows);
  };
  auto& v_slot = sc->v_slot;
  v_slot.clear();
  bool overflow = false;
  int32_t n_fill = 0, n_evict = 0;
  // the distinct rows of set g (entries sorted[lo, hi), as (local << 32 | i)) take slots
  auto fill_set = [&](int64_t g, int64_t lo, int64_t hi) {
    uint64_t key[64];
    int32_t order[64];
    const int64_t shard = g / L.sets, h = g % L.sets;
    const int64_t start = shard * L.slots + h * q + std::min(h, r);
    const int64_t size = q + (h < r);
    if (hi - lo <= 24) {  // insertion sort: most sets miss a few rows
      for (int64_t a = lo + 1; a < hi; ++a) {
        const uint64_t v = sorted[a];
        int64_t b = a;
        for (; b > lo && sorted[b - 1] > v; --b) sorted[b] = sorted[b - 1];
        sorted[b] = v;
      }
    } else {
      std::sort(sorted.begin() + lo, sorted.begin() + hi);
    }
    int64_t k = 0;  // distinct rows
    for (int64_t a = lo; a < hi; ++a) k += a == lo || (sorted[a] >> 32) != (sorted[a - 1] >> 32);
    uint64_t free_ways = 0;
    for (int64_t way = 0; way < 64; ++way) key[way] = ~uint64_t{0};
    for (int64_t way = 0; way < size; ++way) {
      if (stamps[start + way] != clock) {
        free_ways |= uint64_t{1} << way;
        key[way] = VictimKey(L, rows, stamps, counts, start + way);
      }
    }
    const bool full = k > __builtin_popcountll(free_ways);
    if (full) {  // plan_sets' ranking over every way (the taken ones last), as its sort
      overflow = true;
      uint64_t taken[64];
      for (int64_t way = 0; way < w; ++way) {
        const int64_t s = std::min(start + way, total - 1);
        key[way] = VictimKey(L, rows, stamps, counts, s);
        taken[way] = way >= size || stamps[s] == clock;
        order[way] = static_cast<int32_t>(way);
      }
      std::sort(order, order + w, [&](int32_t a, int32_t b) {
        if (taken[a] != taken[b]) return taken[a] < taken[b];
        if (key[a] != key[b]) return key[a] < key[b];
        return a < b;
      });
    }
    const int32_t base = static_cast<int32_t>(shard * L.shard_rows);
    int64_t rank = 0;
    for (int64_t a = lo; a < hi; ++rank) {
      const int32_t local = static_cast<int32_t>(sorted[a] >> 32);
      int64_t s;
      if (full) {
        s = start + order[std::min<int64_t>(rank, w - 1)];
      } else {
        const int64_t best = size <= 32 ? MinWay<32>(key, free_ways) : MinWay<64>(key, free_ways);
        free_ways &= ~(uint64_t{1} << best);
        key[best] = ~uint64_t{0};
        s = start + best;
      }
      v_slot.emplace_back(static_cast<int32_t>(s), local);
      o->fill_slots[n_fill] = static_cast<int32_t>(s);
      o->fill_rows[n_fill++] = base + local;
      if (rows[s] >= 0) {
        o->evict_slots[n_evict] = static_cast<int32_t>(s);
        o->evict_rows[n_evict++] = base + rows[s];
      }
      for (; a < hi && static_cast<int32_t>(sorted[a] >> 32) == local; ++a) {
        o->slots[static_cast<uint32_t>(sorted[a])] = static_cast<int32_t>(s);
      }
    }
  };
  if (groups <= 8 * m + 65536) {  // a counting sort by set
    starts.assign(groups + 1, 0);
    for (uint64_t e : miss) ++starts[(e >> 32) + 1];
    for (int64_t g = 0; g < groups; ++g) starts[g + 1] += starts[g];
    for (uint64_t e : miss) sorted[starts[e >> 32]++] = (local_of(e) << 32) | (e & 0xFFFFFFFFu);
    // starts[g]: group g's end; LFU: the counts of the next set's rows are fetched early
    int64_t ahead = 0;
    for (int64_t g = 0, lo = 0; g < groups; lo = starts[g++]) {
      if (starts[g] == lo) continue;
      if (L.lfu) {
        for (ahead = std::max(ahead, g + 1); ahead < groups && starts[ahead] == starts[g];) ++ahead;
        if (ahead < groups) PrefetchCounts(L, rows, counts, ahead);
      }
      fill_set(g, lo, starts[g]);
    }
  } else {  // far more sets than misses: a sort
    std::sort(miss.begin(), miss.end());
    for (int64_t lo = 0, hi; lo < m; lo = hi) {
      const uint64_t g = miss[lo] >> 32;
      for (hi = lo; hi < m && (miss[hi] >> 32) == g; ++hi) {
        sorted[hi] = (local_of(miss[hi]) << 32) | (miss[hi] & 0xFFFFFFFFu);
      }
      fill_set(static_cast<int64_t>(g), lo, hi);
    }
  }
  for (int64_t j = n_fill; j < n; ++j) o->fill_slots[j] = o->fill_rows[j] = -1;
  for (int64_t j = n_evict; j < n; ++j) o->evict_slots[j] = o->evict_rows[j] = -1;
  // only now the fills are written (on overflow, stamps only, journaled: for n_rows)
  for (const auto& [s, local] : v_slot) {
    if (!overflow) {
      rows[s] = local;
    } else {
      journal[n_journal] = {s, stamps[s]};
      n_journal += stamps[s] != clock;
    }
    stamps[s] = clock;
  }
  int32_t stamped = 0;  // plan_sets' n_rows: the slots stamped now
  for (int64_t s = 0; s < total; ++s) stamped += stamps[s] == clock;
  if (overflow) {
    for (int64_t j = n_journal - 1; j >= 0; --j) stamps[journal[j].first] = journal[j].second;
  } else {
    if (L.lfu) {
      constexpr int64_t kAhead = 16;
      for (int64_t i = 0; i < n; ++i) {
        if (i + kAhead < n) {
          const int32_t y = ids[i + kAhead];
          if (y >= 0 && y < L.rows) __builtin_prefetch(counts + y, 1, 1);
        }
        const int32_t x = ids[i];
        if (valid[i] && x >= 0 && x < L.rows && counts[x] != INT32_MAX) ++counts[x];
      }
    }
    *clock_io = clock;
  }
  o->n_fill = n_fill;
  o->n_evict = n_evict;
  o->n_ids = n_ids;
  o->n_rows = stamped;
  o->overflow = overflow;
}

// The FFI handler: state in (aliased to the first four results), ids, valid; the plan out.
ffi::Error PlanSetsImpl(ffi::Buffer<ffi::S32> rows_in, ffi::Buffer<ffi::S32> stamps_in,
                        ffi::Buffer<ffi::S32> counts_in, ffi::Buffer<ffi::S32> clock_in,
                        ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::PRED> valid,
                        ffi::ResultBuffer<ffi::S32> rows, ffi::ResultBuffer<ffi::S32> stamps,
                        ffi::ResultBuffer<ffi::S32> counts, ffi::ResultBuffer<ffi::S32> clock,
                        ffi::ResultBuffer<ffi::S32> slots, ffi::ResultBuffer<ffi::S32> fill_slots,
                        ffi::ResultBuffer<ffi::S32> fill_rows,
                        ffi::ResultBuffer<ffi::S32> evict_slots,
                        ffi::ResultBuffer<ffi::S32> evict_rows, ffi::ResultBuffer<ffi::S32> n_fill,
                        ffi::ResultBuffer<ffi::S32> n_evict, ffi::ResultBuffer<ffi::S32> n_ids,
                        ffi::ResultBuffer<ffi::S32> n_rows, ffi::ResultBuffer<ffi::PRED> overflow,
                        int64_t n_rows_attr, int64_t shard_rows, int64_t shards, int64_t n_slots,
                        int64_t sets, int64_t lfu) {
  const SetsLayout L{n_rows_attr, shard_rows, shards, n_slots, sets, lfu != 0};
  const int64_t n = static_cast<int64_t>(ids.element_count());
  if (L.rows < 1 || L.shard_rows < 1 || L.shards < 1 || L.slots < 1 || L.sets < 1 ||
      L.sets > L.slots || L.shards * L.shard_rows < L.rows || L.total() > INT32_MAX) {
    return ffi::Error::InvalidArgument("jaxrec_cache_plan_sets: a bad layout");
  }
  if (L.ways() > 64) {
    return ffi::Error::InvalidArgument("jaxrec_cache_plan_sets: sets of over 64 slots");
  }
  const int64_t nc = L.lfu ? L.rows : 0;
  if (static_cast<int64_t>(rows_in.element_count()) != L.total() ||
      static_cast<int64_t>(stamps_in.element_count()) != L.total() ||
      static_cast<int64_t>(counts_in.element_count()) != nc ||
      clock_in.element_count() != 1 || static_cast<int64_t>(valid.element_count()) != n ||
      static_cast<int64_t>(slots->element_count()) != n ||
      static_cast<int64_t>(fill_slots->element_count()) != n || n >= INT32_MAX) {
    return ffi::Error::InvalidArgument("jaxrec_cache_plan_sets: arrays of the wrong sizes");
  }
  // the state is updated in place: the results alias the inputs (else start from a copy)
  auto take = [](ffi::Buffer<ffi::S32>& in, ffi::ResultBuffer<ffi::S32>& out) {
    if (in.typed_data() != out->typed_data() && in.element_count()) {
      std::memcpy(out->typed_data(), in.typed_data(), in.size_bytes());
    }
    return out->typed_data();
  };
  int32_t* r = take(rows_in, rows);
  int32_t* st = take(stamps_in, stamps);
  int32_t* c = take(counts_in, counts);
  int32_t* ck = take(clock_in, clock);
  thread_local SetsScratch scratch;
  SetsPlanOut o{slots->typed_data(), fill_slots->typed_data(), fill_rows->typed_data(),
                evict_slots->typed_data(), evict_rows->typed_data(), 0, 0, 0, 0, false};
  PlanSets(L, r, st, c, ck, ids.typed_data(), valid.typed_data(), n, &o, &scratch);
  *n_fill->typed_data() = o.n_fill;
  *n_evict->typed_data() = o.n_evict;
  *n_ids->typed_data() = o.n_ids;
  *n_rows->typed_data() = o.n_rows;
  *overflow->typed_data() = o.overflow;
  return ffi::Error::Success();
}

}  // namespace
