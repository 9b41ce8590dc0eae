// Weight-streaming matrix products for decoding on the CPU, as an XLA FFI custom call.
//
// A decoding step multiplies a handful of rows (M = batch x tree nodes, 1-16) by every weight
// matrix of the model. Such a product is bound by memory bandwidth: each weight is read once and
// used M times. XLA's CPU GEMM for a few rows reads the weights well below the bandwidth (issue 13,
// docs/performance.md: the 2-row lm_head product cost 2-2.8x the 1-row one), so this kernel reads
// each weight matrix once, in the [out, in] layout (rows contiguous, as torch's nn.Linear.weight
// and the embedding of a tied lm_head), and accumulates all M rows from registers and L1:
//
//   medusa_matmul_nt:  y[M, N] = x[M, K] @ w[N, K]^T     float32, AVX2 + FMA
//
// The Python side (__init__.py) loads this library only on x86-64 CPUs with AVX2 and FMA. The
// output rows of w are split between the caller thread and XLA's intra-op thread pool.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One block of the product: rows t..t+TB-1 of x against rows n..n+NB-1 of w ([N, K]), TB x NB
// accumulators in registers, k in steps of 8 (the K tail by a masked load). For k in [pf0, pf1)
// the rows `ahead` rows further down w are prefetched, one cache line per row every 16 k, so that
// memory keeps streaming while blocks compute from L1.
template <int TB, int NB>
inline void nt_block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t t, int64_t n,
                     __m256i tail, int64_t pf0, int64_t pf1, int64_t ahead) {
  __m256 acc[TB][NB];
  for (int i = 0; i < TB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  const float* e = w + n * K;
  const float* xs = x + t * K;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    if (k >= pf0 && k < pf1)
      for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(e + (ahead + j) * K + k), _MM_HINT_T0);
    for (int h = 0; h < 16; h += 8) {
      __m256 u[NB];
      for (int j = 0; j < NB; ++j) {
        u[j] = _mm256_loadu_ps(e + j * K + k + h);
        if (TB > 1) __asm__("" : "+x"(u[j]));  // keep it in a register: it is used TB times
      }
      for (int i = 0; i < TB; ++i) {
        const __m256 v = _mm256_loadu_ps(xs + i * K + k + h);
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(v, u[j], acc[i][j]);
      }
    }
  }
  for (; k < K; k += 8) {
    const bool full = k + 8 <= K;
    __m256 u[NB];
    for (int j = 0; j < NB; ++j)
      u[j] = full ? _mm256_loadu_ps(e + j * K + k) : _mm256_maskload_ps(e + j * K + k, tail);
    for (int i = 0; i < TB; ++i) {
      const __m256 v = full ? _mm256_loadu_ps(xs + i * K + k) : _mm256_maskload_ps(xs + i * K + k, tail);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(v, u[j], acc[i][j]);
    }
  }
  for (int i = 0; i < TB; ++i)
    for (int j = 0; j < NB; ++j) y[(t + i) * N + n + j] = hsum(acc[i][j]);
}

// y[:, n0:n1] = x @ w[n0:n1, :]^T, w row-major [N, K]. Four rows of w (four outputs) at a time,
// streamed from memory once (prefetching the next four) and re-read from L1 for every two rows of
// x. Each output is one dot product whose order of additions does not depend on M, so a row's
// result is the same whether it is multiplied alone or with others.
// y[:, n0:n1] = x @ w[n0:n1, :]^T for w row-major [N, K]: NB rows of w (NB outputs) at a time,
// streamed from memory once and re-read from L1 for every TB rows of x (the last pass takes the
// 1 to TB - 1 rows left over). Each block prefetches a block two ahead, the work spread over its
// passes, so memory keeps streaming while blocks compute.
template <int TB, int NB>
void nt_rows_blocked(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
                     int64_t n0, int64_t n1, __m256i tail) {
  static_assert(TB >= 1 && TB <= 4, "passes of 1 to 4 rows");
  const int64_t passes = (M + TB - 1) / TB;
  const int64_t kAhead = 2 * NB;
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    const int64_t ahead = (n + kAhead + NB <= n1) ? kAhead : 0;
    for (int64_t p = 0, t = 0; p < passes; ++p, t += TB) {
      const int64_t pf0 = ahead ? K * p / passes / 16 * 16 : K;
      const int64_t pf1 = !ahead ? K : (p + 1 == passes) ? K : K * (p + 1) / passes / 16 * 16;
      switch (std::min<int64_t>(TB, M - t)) {
        case 4: nt_block<(TB >= 4 ? 4 : 1), NB>(x, w, y, K, N, t, n, tail, pf0, pf1, ahead); break;
        case 3: nt_block<(TB >= 3 ? 3 : 1), NB>(x, w, y, K, N, t, n, tail, pf0, pf1, ahead); break;
        case 2: nt_block<(TB >= 2 ? 2 : 1), NB>(x, w, y, K, N, t, n, tail, pf0, pf1, ahead); break;
        default: nt_block<1, NB>(x, w, y, K, N, t, n, tail, pf0, pf1, ahead); break;
      }
    }
  }
  for (; n < n1; ++n)  // fewer than NB outputs left
    for (int64_t t = 0; t < M; ++t) nt_block<1, 1>(x, w, y, K, N, t, n, tail, K, K, 0);
}

// The blocking by M, measured on this project's AVX2 CPU (docs/performance.md): one row, 4 outputs
// per block (memory-bound); two rows, 2 x 4; more, 4 x 3 accumulators (12 of the 16 registers).
// Every output is the same dot product, summed in the same order, whatever the blocking.
void nt_rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  alignas(32) int32_t mask_bits[8];
  for (int i = 0; i < 8; ++i) mask_bits[i] = (i < K % 8) ? -1 : 0;
  const __m256i tail = _mm256_load_si256(reinterpret_cast<const __m256i*>(mask_bits));
  if (M == 1) nt_rows_blocked<1, 4>(x, w, y, M, K, N, n0, n1, tail);
  else if (M == 2) nt_rows_blocked<2, 4>(x, w, y, M, K, N, n0, n1, tail);
  else nt_rows_blocked<4, 3>(x, w, y, M, K, N, n0, n1, tail);
}

// ---------------------------------------------------------------------------------------------
// Splits [0, N) into `parts` ranges of whole `align`-column units and runs fn(begin, end) on each:
// the caller and tasks handed to XLA's intra-op pool claim ranges from one counter, and the caller
// waits only for ranges that another thread has claimed. A task the pool does not start in time
// (it may sit in the calling thread's own queue) cannot stall the caller: the caller runs the
// range itself, and the task, when it runs later, finds nothing left (it holds the shared
// counters, never the caller's stack).
// Threads of our own that spin between products were tried: on a 2-core machine they slowed XLA's
// own operations more than they saved.
struct Claims {
  std::atomic<int64_t> next{0}, done{0};
  int64_t parts = 0;
  std::function<void(int64_t)> run;  // valid while the caller waits; called only for a claimed part

  // Claims and runs parts until none is left, or `limit` of them have run.
  void work(int64_t limit = INT64_MAX) {
    for (int64_t p; limit > 0 && (p = next.fetch_add(1, std::memory_order_acq_rel)) < parts; --limit) {
      run(p);
      done.fetch_add(1, std::memory_order_acq_rel);
    }
  }
};

template <typename Fn>
void parallel_columns(ffi::ThreadPool& pool, int64_t N, int64_t align, int64_t work, Fn fn) {
  static const int64_t max_parts = [] {
    const char* v = std::getenv("MEDUSA_JAX_THREADS");
    return v ? std::max(1, std::atoi(v)) : 16;
  }();
  int64_t parts = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), max_parts));
  if (work < (int64_t{1} << 16)) parts = 1;  // too small to be worth a hand-off
  const int64_t units = (N + align - 1) / align;
  parts = std::max<int64_t>(1, std::min(parts, units));
  if (parts == 1) {
    fn(0, N);
    return;
  }
  auto claims = std::make_shared<Claims>();
  claims->parts = parts;
  claims->run = [&](int64_t p) {
    fn(units * p / parts * align, std::min(N, units * (p + 1) / parts * align));
  };
  for (int64_t p = 1; p < parts; ++p) pool.Schedule([claims] { claims->work(); });
  // The caller's own part first; then it gives the pool's threads as long again to claim theirs
  // (they usually start within microseconds) before it takes what is left.
  const auto t0 = std::chrono::steady_clock::now();
  claims->work(1);
  const auto patience = std::chrono::steady_clock::now() - t0;
  const auto t1 = std::chrono::steady_clock::now();
  while (claims->next.load(std::memory_order_acquire) < parts && std::chrono::steady_clock::now() - t1 < patience)
    _mm_pause();
  claims->work();
  while (claims->done.load(std::memory_order_acquire) != parts) _mm_pause();
}

ffi::Error check_shapes(const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::F32>& w,
                        ffi::ResultBuffer<ffi::F32>& y, int64_t* M, int64_t* K, int64_t* N) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("medusa_matmul_nt: x, w and y must be 2-D");
  *M = xd[0];
  *K = xd[1];
  *N = wd[0];
  if (wd[1] != *K || yd[0] != *M || yd[1] != *N)
    return ffi::Error::InvalidArgument("medusa_matmul_nt: shapes do not agree (x [M, K], w [N, K], y [M, N])");
  return ffi::Error::Success();
}

ffi::Error MatmulNT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  int64_t M, K, N;
  if (auto err = check_shapes(x, w, y, &M, &K, &N); err.failure()) return err;
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  parallel_columns(pool, N, 12, K * N, [&](int64_t b, int64_t e) { nt_rows(xp, wp, yp, M, K, N, b, e); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(medusa_matmul_nt, MatmulNT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Read bandwidth of this machine in bytes/s: `threads` threads each sum their share of a
// `bytes`-long buffer, best of `repeats` passes (the roofline the kernels are measured against).
extern "C" double medusa_read_bandwidth(int64_t bytes, int32_t threads, int32_t repeats) {
  const int64_t n = bytes / sizeof(float) / 64 * 64;
  std::vector<float> buf(n, 1.0f);
  std::vector<float> sums(threads * 16, 0.f);
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (int p = 0; p < threads; ++p) {
      pool.emplace_back([&, p] {
        const int64_t b = n / 64 * p / threads * 64, e = n / 64 * (p + 1) / threads * 64;
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t i = b; i < e; i += 32) {
          s0 = _mm256_add_ps(s0, _mm256_loadu_ps(&buf[i]));
          s1 = _mm256_add_ps(s1, _mm256_loadu_ps(&buf[i + 8]));
          s2 = _mm256_add_ps(s2, _mm256_loadu_ps(&buf[i + 16]));
          s3 = _mm256_add_ps(s3, _mm256_loadu_ps(&buf[i + 24]));
        }
        sums[p * 16] = hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
      });
    }
    for (auto& th : pool) th.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, n * sizeof(float) / s);
  }
  return best;
}
