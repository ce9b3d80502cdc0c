// Threads, native-width vectors, pooling, row prefetch and huge pages.
// Part of jaxrec_cpu.cc (one translation unit: included once, in order).
#pragma once

namespace {

// ----- threads -----
int MaxThreads() {
  static const int n = [] {
    const char* env = std::getenv("JAXREC_CPU_THREADS");
    int v = env ? std::atoi(env) : 0;
    if (v <= 0) v = static_cast<int>(std::thread::hardware_concurrency());
    return std::max(1, std::min(v, 64));
  }();
  return n;
}

// Threads worth using for `work` bytes touched (waking a worker costs ~20-70 us).
int ThreadsFor(int64_t work) {
  int64_t by_work = std::max<int64_t>(1, work / (1 << 18));
  return static_cast<int>(std::min<int64_t>(MaxThreads(), by_work));
}

// Worker threads that live across calls, asleep on a condition variable
// between them. A thread started per call lands on its parent's core when the
// cores were idle (this VM: the second thread then started 2-4 ms late, or
// shared a core for the whole call); a woken worker goes back to the core it
// last ran on, as an OpenMP pool's do.
class WorkerPool {
 public:
  using Fn = void (*)(const void*, int, int);
  // Runs fn(ctx, t, n) for t in [1, n) on workers and t = 0 here; false if
  // another call holds the pool (the caller then starts its own threads).
  bool Run(int n, Fn fn, const void* ctx) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || getpid() != pid_) return false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (static_cast<int>(workers_) < n - 1) {
        std::thread(&WorkerPool::Work, this, static_cast<int>(workers_) + 1).detach();
        ++workers_;
      }
      fn_ = fn;
      ctx_ = ctx;
      n_ = n;
      pending_ = n - 1;
      ++gen_;
    }
    wake_.notify_all();
    fn(ctx, 0, n);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return pending_ == 0; });
    return true;
  }

 private:
  void Work(int t) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] { return gen_ != seen; });
      seen = gen_;
      if (t >= n_) continue;
      Fn fn = fn_;
      const void* ctx = ctx_;
      const int n = n_;
      lock.unlock();
      fn(ctx, t, n);
      lock.lock();
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex busy_, mu_;
  std::condition_variable wake_, done_;
  size_t workers_ = 0;
  uint64_t gen_ = 0;
  Fn fn_ = nullptr;
  const void* ctx_ = nullptr;
  int n_ = 0, pending_ = 0;
  const pid_t pid_ = getpid();  // a forked child has no workers: it starts threads
};

WorkerPool& Workers() {
  static WorkerPool* pool = new WorkerPool;  // never destroyed: workers sleep until exit
  return *pool;
}

template <class F>
void ParallelFor(int n, const F& f) {  // f(t, n) for t in [0, n)
  if (n <= 1) {
    f(0, 1);
    return;
  }
  auto call = [](const void* ctx, int t, int nt) { (*static_cast<const F*>(ctx))(t, nt); };
  if (Workers().Run(n, call, &f)) return;
  std::vector<std::thread> pool;
  pool.reserve(n - 1);
  for (int t = 1; t < n; ++t) pool.emplace_back([&f, t, n] { f(t, n); });
  f(0, n);
  for (auto& th : pool) th.join();
}

// ----- bag layout (jaxrec.sparse.bags' rule, read from the raw lengths) -----
// o[i] = start of bag i of a key whose ids are [start, end), i in [0, b]:
// bag i's ids are [o[i], o[i + 1]). A bag with a negative length, or whose
// ids run past `end` (and so every later non-empty bag), is invalid: it is
// empty here and moves no later bag. Returns how many bags were invalid.
inline int64_t BagOffsets(const int32_t* lengths, int64_t b, int64_t start, int64_t end,
                          int32_t* o) {
  int64_t pos = start, bad = 0, total = 0;
  int32_t lowest = 0;
  for (int64_t i = 0; i < b; ++i) {  // the common case, in one vector pass: all valid
    total += lengths[i];
    lowest = std::min(lowest, lengths[i]);
  }
  o[0] = static_cast<int32_t>(pos);
  if (lowest >= 0 && total <= end - start) {
    for (int64_t i = 0; i < b; ++i) o[i + 1] = o[i] + lengths[i];
    return 0;
  }
  bool past = false;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t n = lengths[i];
    if (n < 0 || (n > 0 && (past || n > end - pos))) {
      ++bad;
      past |= n > 0;
    } else {
      pos += n;
    }
    o[i + 1] = static_cast<int32_t>(pos);
  }
  return bad;
}

// A per-sample weight as the lookups use it: NaN and inf count as zero.
inline float FiniteOrZero(float x) { return std::isfinite(x) ? x : 0.0f; }

// ----- native-width vectors -----
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif
constexpr int kVL = kVecBytes / 4;  // floats per vector
typedef float VF __attribute__((vector_size(kVecBytes)));
typedef uint32_t VU __attribute__((vector_size(kVecBytes)));
typedef uint16_t VH __attribute__((vector_size(kVecBytes / 2)));

using bf16_t = uint16_t;  // raw bfloat16 bits

inline float ToF32(float x) { return x; }
inline float ToF32(bf16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as XLA's f32 -> bf16 convert; NaN stays a quiet NaN.
inline void FromF32(float f, float* out) { *out = f; }
inline void FromF32(float f, bf16_t* out) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *out = static_cast<bf16_t>((u >> 16) | 0x40);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *out = static_cast<bf16_t>(u >> 16);
}

inline VF LoadV(const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline VF LoadV(const bf16_t* p) {
  VH h;
  std::memcpy(&h, p, sizeof(h));
  VU u = __builtin_convertvector(h, VU) << 16;
  VF v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

int PrefetchHint() {
  static const int n = [] {
    const char* env = std::getenv("JAXREC_CPU_PF_HINT");
    return env ? std::atoi(env) : 1;  // into L2: more misses in flight than L1 allows
  }();
  return n;
}

inline void StoreV(float* p, VF v) { std::memcpy(p, &v, sizeof(v)); }

template <typename T>
inline void PrefetchRow(const T* row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  switch (PrefetchHint()) {
    case 0: for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 0); break;
    case 1: for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 1); break;
    case 2: for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 2); break;
    default: for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3); break;
  }
}

// ----- pooling -----
// Adds to out[j0, j0 + NV * kVL) the rows of ids [c0, c1): row_of(c) is the
// row's first element (nullptr: skip the id), scale_of(c) its multiplier
// (rounded product, then the sum, as XLA). The first block of a row issues the
// prefetches (pf.Next() once per id).
template <typename T, int NV, bool kScaled, bool kStore, class RowFn, class ScaleFn, class Pf>
inline void PoolBlock(int64_t j0, int64_t c0, int64_t c1, const RowFn& row_of,
                      const ScaleFn& scale_of, float* out, Pf* pf) {
  VF acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = VF{};
  for (int64_t c = c0; c < c1; ++c) {
    if (pf) pf->Next();
    const T* p = row_of(c);
    if (!p) continue;
    p += j0;
    if constexpr (kScaled) {
      const float s = scale_of(c);
      for (int v = 0; v < NV; ++v) {
        VF x = LoadV(p + v * kVL) * s;
        acc[v] += x;
      }
    } else {
      for (int v = 0; v < NV; ++v) acc[v] += LoadV(p + v * kVL);
    }
  }
  for (int v = 0; v < NV; ++v) {
    if constexpr (kStore) {
      std::memcpy(out + j0 + v * kVL, &acc[v], sizeof(VF));
    } else {
      VF o = LoadV(out + j0 + v * kVL) + acc[v];
      std::memcpy(out + j0 + v * kVL, &o, sizeof(o));
    }
  }
}

template <typename T, int NV, bool kScaled, bool kStore, class RowFn, class ScaleFn, class Pf>
inline void PoolBlockN(int nv, int64_t j0, int64_t c0, int64_t c1, const RowFn& row_of,
                       const ScaleFn& scale_of, float* out, Pf* pf) {
  if constexpr (NV > 0) {
    if (nv == NV) return PoolBlock<T, NV, kScaled, kStore>(j0, c0, c1, row_of, scale_of, out, pf);
    return PoolBlockN<T, NV - 1, kScaled, kStore>(nv, j0, c0, c1, row_of, scale_of, out, pf);
  }
}

// out[0, d) += (kStore: =) sum over ids [c0, c1) of row_of(c) * scale_of(c).
template <typename T, bool kScaled, bool kStore, class RowFn, class ScaleFn, class Pf>
void Pool(int64_t d, int64_t c0, int64_t c1, const RowFn& row_of, const ScaleFn& scale_of,
          float* out, Pf* pf) {
  constexpr int kMaxNV = 8;
  int64_t j0 = 0;
  for (; j0 + kMaxNV * kVL <= d; j0 += kMaxNV * kVL) {
    PoolBlock<T, kMaxNV, kScaled, kStore>(j0, c0, c1, row_of, scale_of, out,
                                          j0 == 0 ? pf : nullptr);
  }
  const int nv = static_cast<int>((d - j0) / kVL);
  if (nv > 0) {
    PoolBlockN<T, kMaxNV - 1, kScaled, kStore>(nv, j0, c0, c1, row_of, scale_of, out,
                                               j0 == 0 ? pf : nullptr);
    j0 += nv * kVL;
  }
  if (j0 < d) {  // tail columns, scalar
    if (d < kVL && pf) {
      for (int64_t c = c0; c < c1; ++c) pf->Next();
    }
    for (int64_t j = j0; j < d; ++j) {
      float acc = 0.0f;
      for (int64_t c = c0; c < c1; ++c) {
        const T* p = row_of(c);
        if (!p) continue;
        float x = ToF32(p[j]);
        if constexpr (kScaled) x = x * scale_of(c);
        acc += x;
      }
      out[j] = kStore ? acc : out[j] + acc;
    }
  }
}

// Prefetches the rows of ids ahead of the one being summed: ids are visited as
// a list of ranges [start, end), in order.
template <typename T, class RowFn>
struct Prefetcher {
  const int32_t* starts;  // range i is [starts[2 i], starts[2 i + 1])
  size_t n_ranges;
  const RowFn& row_of;
  int64_t bytes;
  size_t ri = 0;
  int64_t c = 0;
  void Init(int ahead) {
    Skip();
    for (int k = 0; k < ahead; ++k) Next();
  }
  void Skip() {
    while (ri < n_ranges && (c < starts[2 * ri] || c >= starts[2 * ri + 1])) {
      if (c < starts[2 * ri]) {
        c = starts[2 * ri];
      } else {
        ++ri;
      }
    }
  }
  void Next() {
    if (ri >= n_ranges) return;
    if (const T* p = row_of(c)) PrefetchRow(p, bytes);
    ++c;
    Skip();
  }
};

// Rows to prefetch ahead: about 8 KiB of rows in flight per thread.
int PrefetchAhead(int64_t row_bytes) {
  static const int n = [] {
    const char* env = std::getenv("JAXREC_CPU_PREFETCH");
    return env ? std::atoi(env) : 0;
  }();
  if (n > 0) return n;
  return static_cast<int>(std::min<int64_t>(64, std::max<int64_t>(8, 8192 / row_bytes)));
}

constexpr int kMadvCollapse = 25;  // MADV_COLLAPSE, absent from older libc headers

// Backs a large table with transparent huge pages (once per buffer): random
// row reads then miss the TLB far less (one 4 KiB page per row read
// otherwise). A hint: contents are unchanged. JAXREC_CPU_HUGEPAGES=0 turns it off.
void AdviseHugePages(const void* data, int64_t bytes) {
#if defined(MADV_HUGEPAGE)
  constexpr int64_t kHuge = 2 << 20;
  static const bool enabled = [] {
    const char* env = std::getenv("JAXREC_CPU_HUGEPAGES");
    return !(env && env[0] == '0');
  }();
  if (!enabled || bytes < 8 * kHuge) return;
  uintptr_t lo = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~uintptr_t(kHuge - 1);
  uintptr_t hi = (reinterpret_cast<uintptr_t>(data) + bytes) & ~uintptr_t(kHuge - 1);
  if (hi <= lo) return;
  // Advised ranges, by when: a freed buffer's range is often handed to the
  // next buffer of that size (a new table, after an old one), which must be
  // advised again, so an entry is trusted for a while only. Collapsing an
  // already huge range is cheap (see README).
  static std::mutex mu;
  static std::map<std::pair<uintptr_t, uintptr_t>, std::chrono::steady_clock::time_point> done;
  const auto now = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(mu);
    auto [it, fresh] = done.try_emplace({lo, hi}, now);
    if (!fresh && now - it->second < std::chrono::seconds(2)) return;
    it->second = now;
  }
  void* p = reinterpret_cast<void*>(lo);
  madvise(p, hi - lo, MADV_HUGEPAGE);
  madvise(p, hi - lo, kMadvCollapse);  // Linux >= 6.1; an (ignored) error before
  if (std::getenv("JAXREC_CPU_TIMING")) {
    std::fprintf(stderr, "huge pages: advised %.0f MiB in %.2f ms\n", (hi - lo) / 1048576.0,
                 std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - now)
                     .count());
  }
#endif
}

}  // namespace
