// mtp_jax/cpu_gemm.py's XLA FFI handler: C = op(A) op(B) in float32 (row-major, as XLA:CPU lays
// out its buffers) through Intel MKL's Fortran sgemm, whose address Python hands over once with
// that of MKL_Set_Num_Threads_Local. Each GEMM is cut into blocks of C's rows (or columns), one
// single-threaded sgemm each, run by XLA's own intra-op pool and the calling thread. Operands of
// rank 3 are a batch of matrices (jax.ffi.ffi_call's vmap_method="broadcast_all").
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Fortran BLAS, 32-bit integers (MKL's LP64 interface): column-major.
using Sgemm = void (*)(const char* trans_a, const char* trans_b, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);
using SetThreadsLocal = int (*)(int);
static Sgemm sgemm = nullptr;
static SetThreadsLocal set_threads_local = nullptr;

extern "C" void mtp_set_sgemm(void* sgemm_fn, void* set_threads_local_fn) {
  sgemm = reinterpret_cast<Sgemm>(sgemm_fn);
  set_threads_local = reinterpret_cast<SetThreadsLocal>(set_threads_local_fn);
}

// One row-major GEMM C[m, n] = op(A) op(B) with leading dimensions lda, ldb, ldc: column-major
// sgemm of the transposes, C^T = op(B)^T op(A)^T.
struct Part {
  const float* a;
  const float* b;
  float* c;
  int64_t m, n, k;
};

struct Work {
  std::vector<Part> parts;
  char trans_a, trans_b;
  int lda, ldb, ldc;
  std::atomic<int64_t> next{0}, done{0};

  // Runs parts until none is left unclaimed: the calling thread and every task scheduled on
  // XLA's pool alike, so that no thread ever waits on a part that nobody has started.
  void Drain() {
    set_threads_local(1);  // this thread's MKL calls: one thread (XLA's pool is the threading)
    const float one = 1.0f, zero = 0.0f;
    for (int64_t i; (i = next.fetch_add(1)) < static_cast<int64_t>(parts.size());) {
      const Part& p = parts[i];
      const int m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
      sgemm(&trans_b, &trans_a, &n, &m, &k, &one, p.b, &ldb, p.a, &lda, &zero, p.c, &ldc);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

static ffi::Error Gemm(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b,
                       ffi::Result<ffi::AnyBuffer> c, bool trans_a, bool trans_b) {
  if (sgemm == nullptr || set_threads_local == nullptr) {
    return ffi::Error::Internal("mtp_jax_sgemm: no sgemm set (mtp_jax.cpu_gemm registers it)");
  }
  auto da = a.dimensions(), db = b.dimensions();
  if (a.element_type() != ffi::F32 || b.element_type() != ffi::F32 || da.size() != db.size() ||
      da.size() < 2 || da.size() > 3) {
    return ffi::Error::InvalidArgument("mtp_jax_sgemm: float32 operands of equal rank 2 or 3");
  }
  const int r = static_cast<int>(da.size());
  const int64_t batch = r == 3 ? da[0] : 1;
  const int64_t a0 = da[r - 2], a1 = da[r - 1], b0 = db[r - 2], b1 = db[r - 1];
  const int64_t m = trans_a ? a1 : a0, k = trans_a ? a0 : a1, n = trans_b ? b0 : b1;
  if ((r == 3 && db[0] != batch) || (trans_b ? b1 : b0) != k) {
    return ffi::Error::InvalidArgument("mtp_jax_sgemm: operand shapes do not match");
  }
  const int64_t int_max = 2147483647;
  if (a0 * a1 > int_max || b0 * b1 > int_max || m * n > int_max) {
    return ffi::Error::InvalidArgument("mtp_jax_sgemm: a matrix over 2^31 elements");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();

  auto work = std::make_shared<Work>();
  work->trans_a = trans_a ? 'T' : 'N';
  work->trans_b = trans_b ? 'T' : 'N';
  work->lda = static_cast<int>(a1), work->ldb = static_cast<int>(b1);
  work->ldc = static_cast<int>(n);
  // Blocks of C's rows (or of its columns where there are more), in multiples of 16, one per
  // thread: no threads of MKL's own beside XLA's busy ones.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const bool by_rows = m >= n;
  const int64_t extent = by_rows ? m : n;
  const int64_t pieces = std::max<int64_t>(1, std::min<int64_t>(threads, extent / 16));
  const int64_t step = (extent + pieces - 1) / pieces;
  const int64_t block = (step + 15) / 16 * 16;
  const float* pa = static_cast<const float*>(a.untyped_data());
  const float* pb = static_cast<const float*>(b.untyped_data());
  float* pc = static_cast<float*>(c->untyped_data());
  for (int64_t i = 0; i < batch; ++i) {
    const float* ai = pa + i * a0 * a1;
    const float* bi = pb + i * b0 * b1;
    float* ci = pc + i * m * n;
    for (int64_t s = 0; s < extent; s += block) {
      const int64_t w = std::min(block, extent - s);
      if (by_rows) {  // rows s.. of C: rows of A, or its columns when A is transposed
        work->parts.push_back({ai + (trans_a ? s : s * a1), bi, ci + s * n, w, n, k});
      } else {  // columns s.. of C: columns of B, or its rows when B is transposed
        work->parts.push_back({ai, bi + (trans_b ? s * b1 : s), ci + s, m, w, k});
      }
    }
  }
  const int64_t total = static_cast<int64_t>(work->parts.size());
  const int64_t helpers = std::min<int64_t>(threads, total) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtpSgemm, Gemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b"));
