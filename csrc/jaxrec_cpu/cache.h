// The per-id passes of jaxrec.cache's slot maps (see jaxrec/cache/slots.py): which of a
// batch's rows are cached, the victims, and its ids rewritten as slots. One pass each over
// the batch (a victim order is sorted only when it is rebuilt).
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

// A bitmap of slots (bit s of word s / 64): a batch's slots, ascending when read back.
inline void MarkSlot(uint64_t* marks, int64_t s) { marks[s >> 6] |= uint64_t{1} << (s & 63); }
inline bool Marked(const uint64_t* marks, int64_t s) { return (marks[s >> 6] >> (s & 63)) & 1; }

// f(s) for each marked slot, ascending; the marks are cleared.
template <typename F>
inline void TakeMarks(uint64_t* marks, int64_t words, const F& f) {
  for (int64_t w = 0; w < words; ++w) {
    uint64_t x = marks[w];
    if (!x) continue;
    marks[w] = 0;
    for (; x; x &= x - 1) f(w * 64 + __builtin_ctzll(x));
  }
}

// For each id: a cached row's slot is marked in `marks` (distinct hits counted) and, with
// `out`, out[i] = base + slot (-1 for a miss, set by CacheFix once it has a slot); an uncached
// row is appended to miss[] once (marked -2 in slot_of_row; the caller resets the marks to -1).
// Returns the new distinct hits; *n_miss grows. Ids must be in [0, rows). The marks (a bit per
// slot, L1-sized) are the batch's record: a per-slot epoch array would add a dependent random
// load per id.
inline int64_t CacheScan(const int32_t* ids, int64_t n, int32_t* slot_of_row, int64_t* miss,
                         int64_t* n_miss, int32_t* out, int64_t base, uint64_t* marks) {
  int64_t hits = 0, m = *n_miss;
  constexpr int64_t kAhead = 16;  // the map is larger than L2: its lines are fetched early
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) __builtin_prefetch(slot_of_row + ids[i + kAhead], 1, 1);
    const int32_t r = ids[i];
    const int32_t s = slot_of_row[r];
    if (out) out[i] = s >= 0 ? static_cast<int32_t>(base + s) : -1;
    if (s >= 0) {
      hits += !Marked(marks, s);
      MarkSlot(marks, s);
    } else if (s == -1) {
      slot_of_row[r] = -2;
      miss[m++] = r;
    }
  }
  *n_miss = m;
  return hits;
}

// The LRU order of a slot map's used slots, so that victims cost O(victims), not O(slots):
// log[head, tail) holds slots in the order they were last stamped (each batch's ascending), so
// its live entries are the used slots sorted by (last_used, slot). An entry is live iff
// pos[slot] is its index (a slot stamped again has a newer one). tail < 0: the order is
// unknown (another pass stamped the slots) and is rebuilt from last_used. cap >= 2 * slots.
struct LruLog {
  int32_t* log;
  int64_t cap;
  int64_t* pos;
  int64_t* ends;  // head, tail
};

inline void LogRebuild(const LruLog& q, const int64_t* last_used, int64_t used) {
  std::vector<int32_t> order(used);
  for (int64_t s = 0; s < used; ++s) order[s] = static_cast<int32_t>(s);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return last_used[a] < last_used[b]; });
  for (int64_t p = 0; p < used; ++p) {
    q.log[p] = order[p];
    q.pos[order[p]] = p;
  }
  q.ends[0] = 0;
  q.ends[1] = used;
}

inline void LogCompact(const LruLog& q) {  // the live entries moved to the front, in order
  int64_t j = 0;
  for (int64_t p = q.ends[0]; p < q.ends[1]; ++p) {
    const int32_t s = q.log[p];
    if (q.pos[s] != p) continue;
    q.log[j] = s;
    q.pos[s] = j++;
  }
  q.ends[0] = 0;
  q.ends[1] = j;
}

// LFU's order of a slot map's used slots, so that victims cost O(victims), not O(slots): a
// log per count value below `limit`, each holding the slots whose row reached that count in
// the order they did (each batch's ascending), so its live entries are sorted by (last_used,
// slot): counts only grow, and only for rows a batch looks up, whose slots it stamps. Slots
// with larger counts (hot rows, victims seldom) wait unordered in `over`; a batch that needs
// victims past the logs rebuilds the order with a larger limit. An entry is live iff its seq
// is its slot's. A batch's slots are logged at the next assign (`pending`), once their rows'
// counts are final. Not valid: rebuilt from the counts and stamps.
struct LfuOrder {
  using Entry = std::pair<int32_t, int64_t>;  // (slot, seq)
  struct Log {
    std::vector<Entry> entries;
    size_t head = 0;
  };
  std::vector<Log> logs;  // by count, below limit
  std::vector<Entry> over;  // counts >= limit, unordered
  uint32_t limit = 1024, lowest = 0;  // logs below lowest are empty
  std::vector<int64_t> seq_of_slot;  // its live entry's seq, -1: none
  std::vector<int32_t> pending;  // the last batch's slots, ascending
  int64_t next_seq = 0, entries = 0;
  bool valid = false;

  void Add(int32_t s, uint32_t count) {
    if (count < limit) {
      logs[count].entries.emplace_back(s, next_seq);
      lowest = std::min(lowest, count);
    } else {
      over.emplace_back(s, next_seq);
    }
    seq_of_slot[s] = next_seq++;
    ++entries;
  }

  // From the counts and stamps. With `victims`: also the k victims (ascending, left out of
  // the order), and the limit raised past their counts (up to 2^16 logs) so that the next
  // batches find theirs in the logs.
  void Rebuild(const int64_t* row_of_slot, const uint32_t* counts, const int64_t* last_used,
               const uint64_t* marks, int64_t used, int64_t slots, int64_t k, int64_t* victims) {
    std::vector<int32_t> order(used);
    for (int64_t s = 0; s < used; ++s) order[s] = static_cast<int32_t>(s);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      const uint32_t ca = counts[row_of_slot[a]], cb = counts[row_of_slot[b]];
      if (ca != cb) return ca < cb;
      return last_used[a] != last_used[b] ? last_used[a] < last_used[b] : a < b;
    });
    std::vector<uint8_t> taken(used, 0);
    if (victims) {
      int64_t j = 0;
      for (size_t i = 0; i < order.size() && j < k; ++i) {
        const int32_t s = order[i];
        if (Marked(marks, s)) continue;  // the batch's
        taken[s] = 1;
        victims[j++] = s;
        if (j == k) {
          const uint64_t c = counts[row_of_slot[s]];
          const uint64_t want = std::max<uint64_t>(limit, 2 * c + 64);
          limit = static_cast<uint32_t>(std::min<uint64_t>(1 << 16, want));
        }
      }
      std::sort(victims, victims + k);
    }
    logs.assign(limit, Log{});
    over.clear();
    pending.clear();
    seq_of_slot.assign(slots, -1);
    entries = 0;
    lowest = limit;
    for (int32_t s : order) {
      if (!taken[s]) Add(s, counts[row_of_slot[s]]);
    }
    valid = true;
  }

  void Compact() {  // drops the dead entries (a hot row leaves one per batch it is in)
    auto keep = [&](std::vector<Entry>& e, size_t from) {
      size_t j = 0;
      for (size_t i = from; i < e.size(); ++i) {
        if (seq_of_slot[e[i].first] == e[i].second) e[j++] = e[i];
      }
      e.resize(j);
      return static_cast<int64_t>(j);
    };
    entries = keep(over, 0);
    for (uint32_t c = lowest; c < limit; ++c) {
      entries += keep(logs[c].entries, logs[c].head);
      logs[c].head = 0;
    }
  }
};

// k victims into victims[] (ascending): the used slots the batch does not use with the k
// smallest keys: LRU (`lru`) the last use, then the slot; LFU (`lfu`) the row's count, then
// the last use, then the slot. Each is the first k such live entries of its order (popped).
// The caller checked that k slots may be evicted; false: LFU's lie past its logs (rebuild
// it). The numpy twin is SlotMap._victims.
inline bool CacheVictims(int64_t k, const uint64_t* marks, int64_t used, const LruLog* lru,
                         LfuOrder* lfu, int64_t* victims) {
  static thread_local std::vector<uint64_t> picked;  // a bitmap: the victims come out sorted
  picked.assign((used + 63) / 64, 0);
  int64_t j = 0;
  if (lfu) {
    for (; lfu->lowest < lfu->limit && j < k; ++lfu->lowest) {
      auto& log = lfu->logs[lfu->lowest];
      for (; log.head < log.entries.size() && j < k; ++log.head) {
        const auto [s, q] = log.entries[log.head];
        --lfu->entries;
        if (lfu->seq_of_slot[s] != q) continue;  // dead
        lfu->seq_of_slot[s] = -1;  // a victim, or the batch's (logged again after it)
        if (Marked(marks, s)) continue;
        MarkSlot(picked.data(), s);
        ++j;
      }
      if (j == k) break;  // (this log may hold more)
      log.entries.clear();
      log.head = 0;
    }
    if (j < k) return false;  // the rest lie past the logs
  } else {
    int64_t p = lru->ends[0];
    for (; p < lru->ends[1] && j < k; ++p) {
      const int32_t s = lru->log[p];
      if (lru->pos[s] != p || Marked(marks, s)) continue;  // dead, or the batch's (re-logged)
      MarkSlot(picked.data(), s);
      ++j;
    }
    lru->ends[0] = p;
  }
  j = 0;
  TakeMarks(picked.data(), static_cast<int64_t>(picked.size()),
            [&](int64_t s) { victims[j++] = s; });
  return true;
}

// Gives the m missed rows fill_rows slots: first the never-used slots [used, slots), then k
// victims (CacheVictims; LFU: `lfu` with `counts`, else LRU: `lru`). fill_slots[:k] are the
// victims (ascending), evict_rows their rows. The batch's slots, its hits (marked by
// CacheScan) and its fills, are stamped last_used = clock and logged (LRU now, LFU at the
// next call); the marks are cleared. Returns the new `used`, or -1
// (nothing changed) when fewer than k slots may be evicted. The numpy twin is
// SlotMap._victims / SlotMap.assign.
inline int64_t CacheAssign(const int64_t* fill_rows, int64_t m, int32_t* slot_of_row,
                           int64_t* row_of_slot, int64_t slots, int64_t* last_used,
                           const uint32_t* counts, int64_t used, int64_t clock, uint64_t* marks,
                           const LruLog* lru, LfuOrder* lfu, int64_t* fill_slots,
                           int64_t* evict_rows) {
  const int64_t fresh = std::min(m, slots - used), k = m - fresh;
  const int64_t words = (slots + 63) / 64;
  int64_t hits = 0;  // the marks are the batch's hits: the other used slots may be evicted
  for (int64_t w = 0; w < words; ++w) hits += __builtin_popcountll(marks[w]);
  if (used - hits < k) return -1;  // nothing changed
  if (lfu) {
    if (!lfu->valid || static_cast<int64_t>(lfu->seq_of_slot.size()) != slots) {
      lfu->Rebuild(row_of_slot, counts, last_used, marks, used, slots, 0, nullptr);
    }
    // Their counts are final now. Each is a random row of counts, and each count's log tail
    // a random line: the counts are fetched far ahead, the tails (known once a count is in
    // cache) nearer.
    const auto& pend = lfu->pending;
    const size_t np = pend.size();
    constexpr size_t kCounts = 48, kTails = 12;
    for (size_t i = 0; i < np; ++i) {
      if (i + kCounts < np) __builtin_prefetch(counts + row_of_slot[pend[i + kCounts]], 0, 1);
      if (i + kTails < np) {
        const uint32_t c = counts[row_of_slot[pend[i + kTails]]];
        if (c < lfu->limit) {
          const auto& e = lfu->logs[c].entries;
          __builtin_prefetch(e.data() + e.size(), 1, 1);
        }
      }
      lfu->Add(pend[i], counts[row_of_slot[pend[i]]]);
    }
    lfu->pending.clear();
    if (lfu->entries > 2 * slots + 1024) lfu->Compact();
  } else if (lru->ends[1] < 0) {
    LogRebuild(*lru, last_used, used);
  }
  if (k > 0) {
    if (!CacheVictims(k, marks, used, lru, lfu, fill_slots)) {  // past LFU's logs
      lfu->Rebuild(row_of_slot, counts, last_used, marks, used, slots, k, fill_slots);
    }
    for (int64_t i = 0; i < k; ++i) evict_rows[i] = row_of_slot[fill_slots[i]];
    for (int64_t i = 0; i < k; ++i) {  // random rows of a map larger than L2: fetched early
      if (i + 16 < k) __builtin_prefetch(slot_of_row + evict_rows[i + 16], 1, 1);
      slot_of_row[evict_rows[i]] = -1;
    }
  }
  for (int64_t i = 0; i < fresh; ++i) fill_slots[k + i] = used + i;
  for (int64_t i = 0; i < m; ++i) {
    if (i + 16 < m) __builtin_prefetch(slot_of_row + fill_rows[i + 16], 1, 1);
    slot_of_row[fill_rows[i]] = static_cast<int32_t>(fill_slots[i]);
    row_of_slot[fill_slots[i]] = fill_rows[i];
    MarkSlot(marks, fill_slots[i]);
  }
  if (lfu) {
    TakeMarks(marks, words, [&](int64_t s) {
      last_used[s] = clock;
      lfu->pending.push_back(static_cast<int32_t>(s));
    });
  } else {
    // a batch stamps at most `slots`; live entries are at most `slots` <= cap / 2
    if (lru->ends[1] + slots > lru->cap) LogCompact(*lru);
    int64_t tail = lru->ends[1];
    TakeMarks(marks, words, [&](int64_t s) {
      last_used[s] = clock;
      lru->log[tail] = static_cast<int32_t>(s);
      lru->pos[s] = tail++;
    });
    lru->ends[1] = tail;
  }
  return used + fresh;
}

// out[i] = base + slot of ids[i] where out[i] < 0: the missed ids after CacheScan with `out`
// and CacheAssign, or every id (out filled with -1). Returns false (nothing else changed) if
// such an id's row has no slot.
inline bool CacheFix(const int32_t* ids, int64_t n, const int32_t* slot_of_row, int64_t slots,
                     int64_t base, int32_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    if (out[i] >= 0) continue;
    const int32_t s = slot_of_row[ids[i]];
    if (s < 0 || s >= slots) return false;
    out[i] = static_cast<int32_t>(base + s);
  }
  return true;
}

// LFU: counts each id's row (saturating).
inline void CacheCount(const int32_t* ids, int64_t n, uint32_t* counts) {
  constexpr int64_t kAhead = 16;  // random rows of counts larger than L2
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) __builtin_prefetch(counts + ids[i + kAhead], 1, 1);
    if (counts[ids[i]] != UINT32_MAX) ++counts[ids[i]];
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

namespace {

// Copies rows of `nbytes` bytes: dst + dst_at(i) * dst_stride <- src + src_at(i) * src_stride
// for i in [0, n) where keep(i), split over threads, source and destination rows prefetched a
// few ahead (both are random rows, the host's mostly cold: a store to a cold line stalls on
// its read as a load does).
template <typename SrcAt, typename DstAt, typename Keep>
void MoveRows(const char* src, int64_t src_stride, char* dst, int64_t dst_stride, int64_t n,
              int64_t nbytes, const SrcAt& src_at, const DstAt& dst_at, const Keep& keep) {
  ParallelFor(ThreadsFor(n * nbytes), [&](int t, int nt) {
    const int64_t i0 = n * t / nt, i1 = n * (t + 1) / nt;
    constexpr int64_t kAhead = 8;
    for (int64_t i = i0; i < i1; ++i) {
      if (i + kAhead < i1 && keep(i + kAhead)) {
        const char* s = src + src_at(i + kAhead) * src_stride;
        char* d = dst + dst_at(i + kAhead) * dst_stride;
        for (int64_t b = 0; b < nbytes; b += 64) {
          __builtin_prefetch(s + b, 0, 0);
          __builtin_prefetch(d + b, 1, 0);
        }
      }
      if (keep(i)) std::memcpy(dst + dst_at(i) * dst_stride, src + src_at(i) * src_stride, nbytes);
    }
  });
}

// One part of a cache move, in place on an (aliased, donated) buffer of cache slots (see
// jaxrec/cache/mover.py): the buffer rows at evict_pos go to host rows evict_rows, then host
// rows fill_rows come into buffer rows fill_pos. On the CPU the device's memory is the
// host's, so the host table is read and written where it lies (`host`: its address in this
// process; `host_offset` / `nbytes`: the columns of this part) and each row moves once.
// Positions outside the buffer are padding. Rows are int64 passed as int32 pairs (JAX
// without x64 has no int64 arrays; a host table may have more than 2^31 rows).
ffi::Error CacheMoveImpl(ffi::AnyBuffer, ffi::Buffer<ffi::S32> evict_pos,
                         ffi::Buffer<ffi::S32> evict_rows, ffi::Buffer<ffi::S32> fill_pos,
                         ffi::Buffer<ffi::S32> fill_rows, ffi::Result<ffi::AnyBuffer> buf,
                         int64_t host, int64_t host_rows, int64_t host_stride,
                         int64_t host_offset, int64_t nbytes) {
  const auto dims = buf->dimensions();
  const int64_t rows = dims.size() == 0 ? 1 : dims[0];
  const int64_t row_bytes = rows ? static_cast<int64_t>(buf->size_bytes()) / rows : 0;
  const int64_t ne = evict_pos.element_count(), nf = fill_pos.element_count();
  if (static_cast<int64_t>(evict_rows.element_count()) != 2 * ne ||
      static_cast<int64_t>(fill_rows.element_count()) != 2 * nf) {
    return ffi::Error::InvalidArgument("jaxrec_cache_move: positions and rows differ in size");
  }
  if (nbytes <= 0 || nbytes > row_bytes || host_offset < 0 ||
      host_offset + nbytes > host_stride) {
    return ffi::Error::InvalidArgument("jaxrec_cache_move: row bytes outside the rows");
  }
  const int32_t* ep = evict_pos.typed_data();
  const int32_t* fp = fill_pos.typed_data();
  const int64_t* er = reinterpret_cast<const int64_t*>(evict_rows.typed_data());
  const int64_t* fr = reinterpret_cast<const int64_t*>(fill_rows.typed_data());
  auto in_buf = [rows](int32_t p) { return p >= 0 && p < rows; };
  for (int64_t i = 0; i < ne; ++i) {  // a bad host row would write outside the table
    if (in_buf(ep[i]) && (er[i] < 0 || er[i] >= host_rows)) {
      return ffi::Error::InvalidArgument("jaxrec_cache_move: an evicted row outside the table");
    }
  }
  for (int64_t i = 0; i < nf; ++i) {
    if (in_buf(fp[i]) && (fr[i] < 0 || fr[i] >= host_rows)) {
      return ffi::Error::InvalidArgument("jaxrec_cache_move: a filled row outside the table");
    }
  }
  char* b = static_cast<char*>(buf->untyped_data());
  char* h = reinterpret_cast<char*>(host) + host_offset;
  MoveRows(b, row_bytes, h, host_stride, ne, nbytes, [&](int64_t i) { return ep[i]; },
           [&](int64_t i) { return er[i]; }, [&](int64_t i) { return in_buf(ep[i]); });
  MoveRows(h, host_stride, b, row_bytes, nf, nbytes, [&](int64_t i) { return fr[i]; },
           [&](int64_t i) { return fp[i]; }, [&](int64_t i) { return in_buf(fp[i]); });
  return ffi::Error::Success();
}

}  // namespace
