// jaxrec's C++ CPU kernels, called from JAX through the XLA FFI (API 0.3).
//
// * jaxrec_kjt_embedding_bag: table-batched pooled lookup of every feature
//   slot in one call, straight from a KeyedJaggedTensor's values and lengths
//   (bounds check, per-sample weights, SUM/MEAN), fp32 or bf16 rows summed in
//   fp32 with native-width vector accumulators, bags split over threads, rows
//   prefetched ahead into L2, tables advised onto transparent huge pages.
// * jaxrec_embedding_bag: the same over precomputed rows and segment ids
//   (out[seg[c]] += w[rows[c]] * scale[c]; used by sharded lookups).
// * jaxrec_backward_update_{sgd,rowwise_adagrad,adagrad}: a lookup's backward
//   fused with one optimizer step, in place on the (aliased, donated) table and
//   state: de-duplicate rows, sum each row's gradients out_grad[seg[c]] *
//   scale[c] in id order, apply the update maths of jaxrec.optim.
// * jaxrec_cache_move: jaxrec.cache's row moves between a host table and the
//   cache slots of a (donated) buffer, in place on both.
// * jaxrec_cache_plan_sets: jaxrec.cache.sets.plan_sets (a set-associative slot map's
//   plan of one batch: hits, victims, slots, moves), bit for bit, in place on the state.
// * jaxrec_zch_train_step, jaxrec_zch_remap: jaxrec.modules.zch_index.train_step and remap
//   (a dynamic table's hash index: hits, admission, eviction, rows), bit for bit, in place
//   on the state.
// * jaxrec_uniform_rows: a buffer of initial table values, Philox4x32-10
//   uniform draws addressed by (stream, row, col), bit for bit those of
//   jaxrec.xla.philox.uniform_rows_xla (float32, bfloat16, float16), rows
//   split over threads, counters vectorized across the rows of a piece.
//
// The kernels live in jaxrec_cpu/{common,lookup,update,cache,sets,zch,init}.h, included below;
// this file binds them as FFI handlers and exports them to Python.
//
// Floating-point order follows the XLA reference (products rounded before the
// sums, sums in id order, no FMA contraction: built with -ffp-contract=off), so
// pooled outputs and per-row gradient sums equal XLA's bit for bit.

#include <Python.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <climits>
#include <map>
#include <mutex>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#include "jaxrec_cpu/common.h"
#include "jaxrec_cpu/lookup.h"
#include "jaxrec_cpu/update.h"
#include "jaxrec_cpu/roofline.h"
#include "jaxrec_cpu/cache.h"
#include "jaxrec_cpu/sets.h"
#include "jaxrec_cpu/zch.h"
#include "jaxrec_cpu/init.h"

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecKjtEmbeddingBag, KjtBagImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("drop"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecEmbeddingBag, EmbeddingBagImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

#define JAXREC_UPDATE_ATTRS .Attr<float>("eps").Attr<float>("weight_decay").Attr<int32_t>("mode")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecBackwardUpdateSgd, SgdImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>() JAXREC_UPDATE_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecBackwardUpdateRowwiseAdagrad, RowwiseAdagradImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>() JAXREC_UPDATE_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecBackwardUpdateAdagrad, AdagradImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>() JAXREC_UPDATE_ATTRS);

#define JAXREC_KJT_UPDATE_ARGS                                                              \
  .Arg<ffi::Buffer<ffi::F32>>()      /* g */                                               \
      .Arg<ffi::Buffer<ffi::S32>>()  /* values */                                          \
      .Arg<ffi::Buffer<ffi::S32>>()  /* lengths */                                         \
      .Arg<ffi::Buffer<ffi::F32>>()  /* weights */                                         \
      .Arg<ffi::Buffer<ffi::S32>>()  /* slots */                                           \
      .Arg<ffi::Buffer<ffi::S32>>()  /* starts */                                          \
      .Arg<ffi::Buffer<ffi::F32>>()  /* lr */                                              \
      .Arg<ffi::Buffer<ffi::F32>>()  /* dep */

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecKjtBackwardUpdateSgd, KjtSgdImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>() JAXREC_KJT_UPDATE_ARGS
                                  .Ret<ffi::AnyBuffer>() JAXREC_UPDATE_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecKjtBackwardUpdateRowwiseAdagrad,
                              KjtStatefulImpl<Opt::kRowwiseAdagrad>,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>() JAXREC_KJT_UPDATE_ARGS
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>() JAXREC_UPDATE_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecKjtBackwardUpdateAdagrad, KjtStatefulImpl<Opt::kAdagrad>,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>() JAXREC_KJT_UPDATE_ARGS
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>() JAXREC_UPDATE_ATTRS);

// ----- Python module: the handlers as capsules, for jax.ffi.register_ffi_target -----
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecCacheMove, CacheMoveImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("host")
                                  .Attr<int64_t>("host_rows")
                                  .Attr<int64_t>("host_stride")
                                  .Attr<int64_t>("host_offset")
                                  .Attr<int64_t>("nbytes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecCachePlanSets, PlanSetsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows
                                  .Arg<ffi::Buffer<ffi::S32>>()  // stamps
                                  .Arg<ffi::Buffer<ffi::S32>>()  // counts
                                  .Arg<ffi::Buffer<ffi::S32>>()  // clock
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // valid
                                  .Ret<ffi::Buffer<ffi::S32>>()  // rows
                                  .Ret<ffi::Buffer<ffi::S32>>()  // stamps
                                  .Ret<ffi::Buffer<ffi::S32>>()  // counts
                                  .Ret<ffi::Buffer<ffi::S32>>()  // clock
                                  .Ret<ffi::Buffer<ffi::S32>>()  // slots
                                  .Ret<ffi::Buffer<ffi::S32>>()  // fill_slots
                                  .Ret<ffi::Buffer<ffi::S32>>()  // fill_rows
                                  .Ret<ffi::Buffer<ffi::S32>>()  // evict_slots
                                  .Ret<ffi::Buffer<ffi::S32>>()  // evict_rows
                                  .Ret<ffi::Buffer<ffi::S32>>()  // n_fill
                                  .Ret<ffi::Buffer<ffi::S32>>()  // n_evict
                                  .Ret<ffi::Buffer<ffi::S32>>()  // n_ids
                                  .Ret<ffi::Buffer<ffi::S32>>()  // n_rows
                                  .Ret<ffi::Buffer<ffi::PRED>>()  // overflow
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("shard_rows")
                                  .Attr<int64_t>("shards")
                                  .Attr<int64_t>("slots")
                                  .Attr<int64_t>("sets")
                                  .Attr<int64_t>("lfu"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecZchTrainStep, ZchTrainStepImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()  // id_lo
                                  .Arg<ffi::Buffer<ffi::U32>>()  // id_hi
                                  .Arg<ffi::Buffer<ffi::S32>>()  // last_seen
                                  .Arg<ffi::Buffer<ffi::S32>>()  // counts
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sketch
                                  .Arg<ffi::Buffer<ffi::S32>>()  // current_iter
                                  .Arg<ffi::Buffer<ffi::S32>>()  // occupancy
                                  .Arg<ffi::Buffer<ffi::U32>>()  // lo
                                  .Arg<ffi::Buffer<ffi::U32>>()  // hi
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // valid
                                  .Ret<ffi::Buffer<ffi::U32>>()  // id_lo
                                  .Ret<ffi::Buffer<ffi::U32>>()  // id_hi
                                  .Ret<ffi::Buffer<ffi::S32>>()  // last_seen
                                  .Ret<ffi::Buffer<ffi::S32>>()  // counts
                                  .Ret<ffi::Buffer<ffi::S32>>()  // sketch
                                  .Ret<ffi::Buffer<ffi::S32>>()  // current_iter
                                  .Ret<ffi::Buffer<ffi::S32>>()  // occupancy
                                  .Ret<ffi::Buffer<ffi::S32>>()  // rows
                                  .Ret<ffi::Buffer<ffi::S32>>()  // evicted
                                  .Ret<ffi::Buffer<ffi::S32>>()  // [admitted, evicted, rejected]
                                  .Attr<int64_t>("slots")
                                  .Attr<int64_t>("ways")
                                  .Attr<int64_t>("total_buckets")
                                  .Attr<int64_t>("bucket_offset")
                                  .Attr<int64_t>("row_offset")
                                  .Attr<int64_t>("seed")
                                  .Attr<int64_t>("policy")
                                  .Attr<int64_t>("single_ttl")
                                  .Attr<int64_t>("admission")
                                  .Attr<int64_t>("threshold")
                                  .Attr<int64_t>("cutoff"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecZchRemap, ZchRemapImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()  // id_lo
                                  .Arg<ffi::Buffer<ffi::U32>>()  // id_hi
                                  .Arg<ffi::Buffer<ffi::S32>>()  // last_seen
                                  .Arg<ffi::Buffer<ffi::U32>>()  // lo
                                  .Arg<ffi::Buffer<ffi::U32>>()  // hi
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // valid
                                  .Ret<ffi::Buffer<ffi::S32>>()  // rows
                                  .Attr<int64_t>("slots")
                                  .Attr<int64_t>("ways")
                                  .Attr<int64_t>("total_buckets")
                                  .Attr<int64_t>("bucket_offset")
                                  .Attr<int64_t>("row_offset")
                                  .Attr<int64_t>("seed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecUniformRows, UniformRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()  // key
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ints [P, 6]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // floats [P, 2]
                                  .Ret<ffi::AnyBuffer>());

namespace {

PyObject* Handlers(PyObject*, PyObject*) {
  PyObject* dict = PyDict_New();
  if (!dict) return nullptr;
  struct Entry {
    const char* name;
    void* fn;
  };
  const Entry entries[] = {
      {"jaxrec_embedding_bag", reinterpret_cast<void*>(JaxrecEmbeddingBag)},
      {"jaxrec_kjt_embedding_bag", reinterpret_cast<void*>(JaxrecKjtEmbeddingBag)},
      {"jaxrec_backward_update_sgd", reinterpret_cast<void*>(JaxrecBackwardUpdateSgd)},
      {"jaxrec_backward_update_rowwise_adagrad",
       reinterpret_cast<void*>(JaxrecBackwardUpdateRowwiseAdagrad)},
      {"jaxrec_backward_update_adagrad", reinterpret_cast<void*>(JaxrecBackwardUpdateAdagrad)},
      {"jaxrec_kjt_backward_update_sgd", reinterpret_cast<void*>(JaxrecKjtBackwardUpdateSgd)},
      {"jaxrec_kjt_backward_update_rowwise_adagrad",
       reinterpret_cast<void*>(JaxrecKjtBackwardUpdateRowwiseAdagrad)},
      {"jaxrec_kjt_backward_update_adagrad",
       reinterpret_cast<void*>(JaxrecKjtBackwardUpdateAdagrad)},
      {"jaxrec_cache_move", reinterpret_cast<void*>(JaxrecCacheMove)},
      {"jaxrec_cache_plan_sets", reinterpret_cast<void*>(JaxrecCachePlanSets)},
      {"jaxrec_zch_train_step", reinterpret_cast<void*>(JaxrecZchTrainStep)},
      {"jaxrec_zch_remap", reinterpret_cast<void*>(JaxrecZchRemap)},
      {"jaxrec_uniform_rows", reinterpret_cast<void*>(JaxrecUniformRows)},
  };
  for (const Entry& e : entries) {
    PyObject* cap = PyCapsule_New(e.fn, nullptr, nullptr);
    if (!cap || PyDict_SetItemString(dict, e.name, cap) < 0) {
      Py_XDECREF(cap);
      Py_DECREF(dict);
      return nullptr;
    }
    Py_DECREF(cap);
  }
  return dict;
}

PyObject* Info(PyObject*, PyObject*) {
  // cache_api: the signatures of the cache_* host functions (jaxrec.cpu.host_functions)
  // uniform_rows_f16: whether jaxrec_uniform_rows writes float16 (the compiler has _Float16)
  return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i}", "vector_bytes", kVecBytes, "max_threads",
                       MaxThreads(), "ffi_api_minor", XLA_FFI_API_MINOR, "cache_api", 3,
                       "uniform_rows_f16", static_cast<int>(kInitF16));
}

// A C-contiguous buffer of 4-byte items of kind `kind` ('f' float, 'i' int32), or an error.
bool GetBuffer(PyObject* obj, Py_buffer* view, char kind, int ndim, const char* name) {
  if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return false;
  const char* f = view->format ? view->format : "B";
  const char last = f[std::strlen(f) - 1];
  const bool ok_kind = kind == 'f' ? last == 'f' : (last == 'i' || last == 'l');
  if (!ok_kind || view->itemsize != 4 || view->ndim != ndim) {
    PyErr_Format(PyExc_TypeError, "%s: expected a C-contiguous %d-d %s array, got format=%s "
                 "itemsize=%zd ndim=%d", name, ndim, kind == 'f' ? "float32" : "int32", f,
                 view->itemsize, view->ndim);
    PyBuffer_Release(view);
    return false;
  }
  return true;
}

PyObject* PyReadBandwidth(PyObject*, PyObject* args) {
  PyObject* obj;
  int threads;
  if (!PyArg_ParseTuple(args, "Oi", &obj, &threads)) return nullptr;
  Py_buffer buf;
  if (!GetBuffer(obj, &buf, 'f', 1, "read_bandwidth(data)")) return nullptr;
  double sum = 0, s;
  Py_BEGIN_ALLOW_THREADS;
  s = ReadBandwidth(static_cast<const float*>(buf.buf), buf.len / 4, std::max(1, threads), &sum);
  Py_END_ALLOW_THREADS;
  PyBuffer_Release(&buf);
  return Py_BuildValue("(dd)", s, sum);
}

PyObject* PyGatherRows(PyObject*, PyObject* args) {
  PyObject *tobj, *iobj;
  int threads;
  long long ahead;
  if (!PyArg_ParseTuple(args, "OOiL", &tobj, &iobj, &threads, &ahead)) return nullptr;
  Py_buffer table, ids;
  if (!GetBuffer(tobj, &table, 'f', 2, "gather_rows(table)")) return nullptr;
  if (!GetBuffer(iobj, &ids, 'i', 1, "gather_rows(ids)")) {
    PyBuffer_Release(&table);
    return nullptr;
  }
  const int64_t r = table.shape[0], d = table.shape[1], n = ids.len / 4;
  const int32_t* id = static_cast<const int32_t*>(ids.buf);
  for (int64_t c = 0; c < n; ++c) {
    if (id[c] < 0 || id[c] >= r) {
      PyBuffer_Release(&table);
      PyBuffer_Release(&ids);
      return PyErr_Format(PyExc_ValueError, "gather_rows: ids[%lld]=%d outside [0, %lld)",
                          static_cast<long long>(c), id[c], static_cast<long long>(r));
    }
  }
  std::vector<float> sums(d);
  double s;
  Py_BEGIN_ALLOW_THREADS;
  s = GatherRows(static_cast<const float*>(table.buf), d, id, n, std::max(1, threads), ahead,
                 sums.data());
  Py_END_ALLOW_THREADS;
  PyBuffer_Release(&table);
  PyBuffer_Release(&ids);
  PyObject* list = PyList_New(d);
  if (!list) return nullptr;
  for (int64_t j = 0; j < d; ++j) PyList_SET_ITEM(list, j, PyFloat_FromDouble(sums[j]));
  return Py_BuildValue("(dN)", s, list);
}

PyObject* PyGatherPoolRows(PyObject*, PyObject* args) {
  PyObject *tobj, *iobj, *oobj;
  int threads;
  long long per, ahead;
  if (!PyArg_ParseTuple(args, "OOLOiL", &tobj, &iobj, &per, &oobj, &threads, &ahead))
    return nullptr;
  Py_buffer table, ids, out;
  if (!GetBuffer(tobj, &table, 'f', 2, "gather_pool_rows(table)")) return nullptr;
  if (!GetBuffer(iobj, &ids, 'i', 1, "gather_pool_rows(ids)")) {
    PyBuffer_Release(&table);
    return nullptr;
  }
  if (PyObject_GetBuffer(oobj, &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
    PyBuffer_Release(&table);
    PyBuffer_Release(&ids);
    return nullptr;
  }
  struct Release {
    Py_buffer *a, *b, *c;
    ~Release() {
      PyBuffer_Release(a);
      PyBuffer_Release(b);
      PyBuffer_Release(c);
    }
  } release{&table, &ids, &out};
  const int64_t r = table.shape[0], d = table.shape[1], n = ids.len / 4;
  if (per < 1 || n % per != 0 || out.ndim != 2 || out.itemsize != 4 || out.shape[0] != n / per ||
      out.shape[1] != d)
    return PyErr_Format(PyExc_ValueError, "gather_pool_rows: out must be float32 [%lld, %lld] "
                        "(ids in runs of per=%lld)", static_cast<long long>(per > 0 ? n / per : 0),
                        static_cast<long long>(d), per);
  const int32_t* id = static_cast<const int32_t*>(ids.buf);
  for (int64_t c = 0; c < n; ++c) {
    if (id[c] < 0 || id[c] >= r)
      return PyErr_Format(PyExc_ValueError, "gather_pool_rows: ids[%lld]=%d outside [0, %lld)",
                          static_cast<long long>(c), id[c], static_cast<long long>(r));
  }
  double s;
  Py_BEGIN_ALLOW_THREADS;
  s = GatherPoolRows(static_cast<const float*>(table.buf), d, id, n, per, std::max(1, threads),
                     ahead, static_cast<float*>(out.buf));
  Py_END_ALLOW_THREADS;
  return PyFloat_FromDouble(s);
}

// A writable (or read-only) C-contiguous 1-d buffer of `itemsize`-byte items, or an error.
bool GetVector(PyObject* obj, Py_buffer* view, Py_ssize_t itemsize, bool writable,
               const char* name) {
  const int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj, view, flags) < 0) return false;
  if (view->itemsize != itemsize || view->ndim != 1) {
    PyErr_Format(PyExc_TypeError, "%s: expected a C-contiguous 1-d array of %zd-byte items, "
                 "got itemsize=%zd ndim=%d", name, itemsize, view->itemsize, view->ndim);
    PyBuffer_Release(view);
    return false;
  }
  return true;
}

// Releases every buffer it got, on any exit.
struct Buffers {
  std::vector<Py_buffer> views;
  bool Get(PyObject* obj, Py_ssize_t itemsize, bool writable, const char* name) {
    views.emplace_back();
    if (GetVector(obj, &views.back(), itemsize, writable, name)) return true;
    views.pop_back();
    return false;
  }
  template <typename T>
  T* At(size_t i) { return static_cast<T*>(views[i].buf); }
  int64_t Len(size_t i) const { return views[i].len / views[i].itemsize; }
  ~Buffers() {
    for (Py_buffer& v : views) PyBuffer_Release(&v);
  }
};

bool IdsInRange(const int32_t* ids, int64_t n, int64_t rows, const char* name) {
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= rows) {
      PyErr_Format(PyExc_ValueError, "%s: ids[%lld]=%d outside [0, %lld)", name,
                   static_cast<long long>(i), ids[i], static_cast<long long>(rows));
      return false;
    }
  }
  return true;
}

PyObject* PyCacheScan(PyObject*, PyObject* args) {
  PyObject *ids, *slot_of_row, *miss, *out, *marks;
  long long n_miss, base, slots;
  if (!PyArg_ParseTuple(args, "OOLOLOLO", &ids, &slot_of_row, &slots, &miss, &n_miss, &out, &base,
                        &marks))
    return nullptr;
  Buffers b;
  if (!b.Get(ids, 4, false, "cache_scan(ids)") || !b.Get(slot_of_row, 4, true, "slot_of_row") ||
      !b.Get(miss, 8, true, "miss") || !b.Get(out, 4, true, "out") ||
      !b.Get(marks, 8, true, "marks"))
    return nullptr;
  const int64_t n = b.Len(0);
  if (!IdsInRange(b.At<int32_t>(0), n, b.Len(1), "cache_scan")) return nullptr;
  if (n_miss < 0 || n_miss + n > b.Len(2))
    return PyErr_Format(PyExc_ValueError, "cache_scan: miss holds %lld, needs up to %lld",
                        static_cast<long long>(b.Len(2)), n_miss + static_cast<long long>(n));
  if (b.Len(3) != 0 && b.Len(3) != n)
    return PyErr_Format(PyExc_ValueError, "cache_scan: out and ids differ");
  if (slots < 1 || b.Len(4) != (slots + 63) / 64)
    return PyErr_Format(PyExc_ValueError, "cache_scan: marks need a bit per slot");
  // (slot_of_row holds slots below `slots` or -1 / -2: SlotMap keeps it so)
  int32_t* o = b.Len(3) ? b.At<int32_t>(3) : nullptr;
  int64_t m = n_miss, hits;
  Py_BEGIN_ALLOW_THREADS;
  hits = CacheScan(b.At<int32_t>(0), n, b.At<int32_t>(1), b.At<int64_t>(2), &m, o, base,
                   b.At<uint64_t>(4));
  Py_END_ALLOW_THREADS;
  return Py_BuildValue("(LL)", static_cast<long long>(hits), static_cast<long long>(m));
}

constexpr const char* kLfuName = "jaxrec.cache.LfuOrder";

void FreeLfuOrder(PyObject* cap) {
  delete static_cast<LfuOrder*>(PyCapsule_GetPointer(cap, kLfuName));
}

PyObject* PyLfuOrder(PyObject*, PyObject*) {
  return PyCapsule_New(new LfuOrder, kLfuName, FreeLfuOrder);
}

PyObject* PyLfuReset(PyObject*, PyObject* cap) {
  auto* q = static_cast<LfuOrder*>(PyCapsule_GetPointer(cap, kLfuName));
  if (!q) return nullptr;
  q->valid = false;  // rebuilt from the counts and stamps at the next assign
  Py_RETURN_NONE;
}

PyObject* PyCacheAssign(PyObject*, PyObject* args) {
  PyObject *fill_rows, *slot_of_row, *row_of_slot, *last_used, *counts, *fill_slots,
      *evict_rows, *marks, *log, *pos, *ends, *order;
  long long used, clock;
  if (!PyArg_ParseTuple(args, "OOOOOLLOOOOOOO", &fill_rows, &slot_of_row, &row_of_slot,
                        &last_used, &counts, &used, &clock, &fill_slots, &evict_rows, &marks,
                        &log, &pos, &ends, &order))
    return nullptr;
  Buffers b;
  if (!b.Get(fill_rows, 8, false, "cache_assign(fill_rows)") ||
      !b.Get(slot_of_row, 4, true, "slot_of_row") || !b.Get(row_of_slot, 8, true, "row_of_slot") ||
      !b.Get(last_used, 8, true, "last_used") || !b.Get(counts, 4, false, "counts") ||
      !b.Get(fill_slots, 8, true, "fill_slots") ||
      !b.Get(evict_rows, 8, true, "evict_rows") || !b.Get(marks, 8, true, "marks") ||
      !b.Get(log, 4, true, "log") || !b.Get(pos, 8, true, "pos") || !b.Get(ends, 8, true, "ends"))
    return nullptr;
  const int64_t m = b.Len(0), rows = b.Len(1), slots = b.Len(2);
  const int64_t k = m - std::min<int64_t>(m, slots - used);
  if (used < 0 || used > slots || b.Len(3) != slots || b.Len(5) != m || b.Len(6) != k ||
      (b.Len(4) != 0 && b.Len(4) != rows) || b.Len(7) != (slots + 63) / 64)
    return PyErr_Format(PyExc_ValueError, "cache_assign: inconsistent sizes");
  LfuOrder* lfu = nullptr;
  LruLog q{b.At<int32_t>(8), b.Len(8), b.At<int64_t>(9), b.At<int64_t>(10)};
  if (b.Len(4)) {  // LFU: its order
    lfu = static_cast<LfuOrder*>(PyCapsule_GetPointer(order, kLfuName));
    if (!lfu) return nullptr;
  } else {
    const int64_t head = q.ends[0], tail = q.ends[1];
    if (q.cap < 2 * slots || b.Len(9) != slots || b.Len(10) != 2 ||
        (tail >= 0 && (head < 0 || head > tail || tail > q.cap)))
      return PyErr_Format(PyExc_ValueError, "cache_assign: a bad LRU log (2 * slots entries, a "
                          "position per slot, 0 <= head <= tail <= entries)");
  }
  const int64_t* fr = b.At<int64_t>(0);
  for (int64_t i = 0; i < m; ++i) {
    if (fr[i] < 0 || fr[i] >= rows)
      return PyErr_Format(PyExc_ValueError, "cache_assign: fill row %lld outside [0, %lld)",
                          static_cast<long long>(fr[i]), static_cast<long long>(rows));
  }
  const uint32_t* cnt = b.Len(4) ? b.At<uint32_t>(4) : nullptr;
  int64_t new_used;
  Py_BEGIN_ALLOW_THREADS;
  new_used = CacheAssign(fr, m, b.At<int32_t>(1), b.At<int64_t>(2), slots, b.At<int64_t>(3), cnt,
                         used, clock, b.At<uint64_t>(7), lfu ? nullptr : &q, lfu,
                         b.At<int64_t>(5), b.At<int64_t>(6));
  Py_END_ALLOW_THREADS;
  if (new_used < 0)
    return PyErr_Format(PyExc_ValueError, "cache_assign: fewer than %lld slots to evict",
                        static_cast<long long>(k));
  return PyLong_FromLongLong(new_used);
}

PyObject* PyCacheFix(PyObject*, PyObject* args) {
  PyObject *ids, *slot_of_row, *out, *counts;
  long long slots, base;
  if (!PyArg_ParseTuple(args, "OOLLOO", &ids, &slot_of_row, &slots, &base, &out, &counts))
    return nullptr;
  Buffers b;
  if (!b.Get(ids, 4, false, "cache_fix(ids)") || !b.Get(slot_of_row, 4, false, "slot_of_row") ||
      !b.Get(out, 4, true, "out") || !b.Get(counts, 4, true, "counts"))
    return nullptr;
  const int64_t n = b.Len(0);
  if (b.Len(2) != n) return PyErr_Format(PyExc_ValueError, "cache_fix: out and ids differ");
  if (b.Len(3) != 0 && b.Len(3) != b.Len(1))
    return PyErr_Format(PyExc_ValueError, "cache_fix: counts and slot_of_row differ");
  if (!IdsInRange(b.At<int32_t>(0), n, b.Len(1), "cache_fix")) return nullptr;
  bool ok;
  Py_BEGIN_ALLOW_THREADS;
  ok = CacheFix(b.At<int32_t>(0), n, b.At<int32_t>(1), slots, base, b.At<int32_t>(2));
  if (ok && b.Len(3)) CacheCount(b.At<int32_t>(0), n, b.At<uint32_t>(3));
  Py_END_ALLOW_THREADS;
  if (!ok) return PyErr_Format(PyExc_ValueError, "cache_fix: a missed row has no slot");
  Py_RETURN_NONE;
}

PyObject* PyCacheRows(PyObject*, PyObject* args) {
  PyObject *src, *rows, *dst;
  int scatter;
  if (!PyArg_ParseTuple(args, "OOOp", &src, &rows, &dst, &scatter)) return nullptr;
  Py_buffer s, d;
  if (PyObject_GetBuffer(src, &s, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return nullptr;
  if (PyObject_GetBuffer(dst, &d, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
    PyBuffer_Release(&s);
    return nullptr;
  }
  Buffers b;
  const bool ok_rows = b.Get(rows, 8, false, "cache_rows(rows)");
  struct Release {
    Py_buffer *a, *b;
    ~Release() { PyBuffer_Release(a); PyBuffer_Release(b); }
  } release{&s, &d};
  if (!ok_rows) return nullptr;
  if (s.ndim < 1 || d.ndim < 1 || s.itemsize != d.itemsize || s.ndim != d.ndim ||
      (s.ndim == 2 && s.shape[1] != d.shape[1]) || s.ndim > 2)
    return PyErr_Format(PyExc_TypeError, "cache_rows: src and dst need the same row shape");
  const int64_t n = b.Len(0), row_bytes = s.len / std::max<Py_ssize_t>(s.shape[0], 1);
  const int64_t table_rows = scatter ? d.shape[0] : s.shape[0];
  const int64_t* r = b.At<int64_t>(0);
  if ((scatter ? s.shape[0] : d.shape[0]) != n)
    return PyErr_Format(PyExc_ValueError, "cache_rows: %lld rows for %lld row ids",
                        static_cast<long long>(scatter ? s.shape[0] : d.shape[0]),
                        static_cast<long long>(n));
  for (int64_t i = 0; i < n; ++i) {
    if (r[i] < 0 || r[i] >= table_rows)
      return PyErr_Format(PyExc_ValueError, "cache_rows: rows[%lld]=%lld outside [0, %lld)",
                          static_cast<long long>(i), static_cast<long long>(r[i]),
                          static_cast<long long>(table_rows));
  }
  Py_BEGIN_ALLOW_THREADS;
  CacheRows(static_cast<const char*>(s.buf), static_cast<char*>(d.buf), r, n, row_bytes,
            scatter != 0);
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"handlers", Handlers, METH_NOARGS, "FFI handler capsules by target name."},
    {"info", Info, METH_NOARGS, "Build facts: vector width, threads, FFI API minor version."},
    {"read_bandwidth", PyReadBandwidth, METH_VARARGS,
     "read_bandwidth(data, threads) -> (seconds, sum): sums a 1-d float32 array (a ceiling)."},
    {"gather_rows", PyGatherRows, METH_VARARGS,
     "gather_rows(table, ids, threads, ahead) -> (seconds, column sums): sums rows ids of a "
     "float32 [R, D] table, `ahead` rows prefetched (a ceiling)."},
    {"gather_pool_rows", PyGatherPoolRows, METH_VARARGS,
     "gather_pool_rows(table, ids, per, out, threads, ahead) -> seconds: out[g] = the sum of "
     "rows ids[g * per : (g + 1) * per] of a float32 [R, D] table (a ceiling)."},
    {"cache_scan", PyCacheScan, METH_VARARGS,
     "cache_scan(ids, slot_of_row, slots, miss, n_miss, out, base, marks) -> (hits, n_miss): "
     "jaxrec.cache's plan pass (int32 ids and map, int64 miss; out: hits' base + slot, -1 for "
     "misses, or empty; marks: uint64, a bit per slot, set for hits: the batch's record)."},
    {"lfu_order", PyLfuOrder, METH_NOARGS,
     "lfu_order() -> capsule: the C++ LFU order of a slot map (cache_assign's last argument)."},
    {"lfu_reset", PyLfuReset, METH_O,
     "lfu_reset(order): the order is rebuilt from the counts and stamps at the next assign."},
    {"cache_assign", PyCacheAssign, METH_VARARGS,
     "cache_assign(fill_rows, slot_of_row, row_of_slot, last_used, counts, used, clock, "
     "fill_slots, evict_rows, marks, log, pos, ends, order) -> used: slots for a "
     "batch's missed rows (victims first); the batch's (marked) slots stamped; victims from "
     "the LRU log, or with counts the LFU order (lfu_order())."},
    {"cache_fix", PyCacheFix, METH_VARARGS,
     "cache_fix(ids, slot_of_row, slots, base, out, counts): out[i] = base + slot where out[i] "
     "< 0 (after cache_scan with out); counts the ids when counts is not empty."},
    {"cache_rows", PyCacheRows, METH_VARARGS,
     "cache_rows(src, rows, dst, scatter): dst[i] = src[rows[i]], or dst[rows[i]] = src[i] with "
     "scatter; whole rows of C-contiguous arrays, int64 rows, over threads."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_kernels", "jaxrec C++ CPU kernels", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__kernels() { return PyModule_Create(&kModule); }

