// The per-id passes of jaxrec.cache's slot maps (see jaxrec/cache/slots.py): which of a
// batch's rows are cached, and its ids rewritten as slots. One pass each, no sorting.
#pragma once

#include <cstdint>

namespace {

// For each id: a cached row's slot is marked seen[slot] = epoch (distinct hits counted); an
// uncached row is appended to miss[] once (marked -2 in slot_of_row; the caller resets the
// marks to -1). Returns the new distinct hits; *n_miss grows. Ids must be in [0, rows).
inline int64_t CacheScan(const int32_t* ids, int64_t n, int32_t* slot_of_row, int64_t* seen,
                         int64_t epoch, int64_t* miss, int64_t* n_miss) {
  int64_t hits = 0, m = *n_miss;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t r = ids[i];
    const int32_t s = slot_of_row[r];
    if (s >= 0) {
      if (seen[s] != epoch) {
        seen[s] = epoch;
        ++hits;
      }
    } else if (s == -1) {
      slot_of_row[r] = -2;
      miss[m++] = r;
    }
  }
  *n_miss = m;
  return hits;
}

// out[i] = base + slot of ids[i] (every id's row is cached); stamps the slot with `clock`
// and, with counts, counts the row's ids (saturating).
inline void CacheTouch(const int32_t* ids, int64_t n, const int32_t* slot_of_row,
                       int64_t* last_used, uint32_t* counts, int64_t clock, int64_t base,
                       int32_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    const int32_t r = ids[i];
    const int32_t s = slot_of_row[r];
    last_used[s] = clock;
    if (counts && counts[r] != UINT32_MAX) ++counts[r];
    out[i] = static_cast<int32_t>(base + s);
  }
}

// Copies whole rows of `row_bytes` bytes: dst[i] = src[rows[i]] (gather) or
// dst[rows[i]] = src[i] (scatter), split over threads, rows prefetched a few ahead.
void CacheRows(const char* src, char* dst, const int64_t* rows, int64_t n, int64_t row_bytes,
               bool scatter) {
  const int threads = ThreadsFor(n * row_bytes);
  ParallelFor(threads, [&](int t, int nt) {
    const int64_t i0 = n * t / nt, i1 = n * (t + 1) / nt;
    constexpr int64_t kAhead = 8;
    for (int64_t i = i0; i < i1; ++i) {
      if (i + kAhead < i1) {
        const int64_t r = rows[i + kAhead];
        if (scatter) {
          __builtin_prefetch(dst + r * row_bytes, 1, 0);
        } else {
          __builtin_prefetch(src + r * row_bytes, 0, 0);
        }
      }
      if (scatter) {
        std::memcpy(dst + rows[i] * row_bytes, src + i * row_bytes, row_bytes);
      } else {
        std::memcpy(dst + i * row_bytes, src + rows[i] * row_bytes, row_bytes);
      }
    }
  });
}

}  // namespace
