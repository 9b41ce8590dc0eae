// The weight-streaming product kernel alone, outside XLA: GB/s of weights read for M = 1..16 rows,
// on one thread and on the kernel's workers (docs/performance.md, issue 13 second pass).
//
//   c++ -O3 -mavx2 -mfma -std=c++17 -w -I"$(.venv/bin/python -c 'import jax; print(jax.ffi.include_dir())')" \
//       scripts/kernel_harness.cc -o /tmp/kernel_harness -lpthread && /tmp/kernel_harness [N] [huge]
//
// N: rows of the [N, 576] float32 matrix (default 196,608: 453 MB, far more than the caches; 6,144
// is 14 MB, inside a 32 MB L3); huge = 1 asks for transparent huge pages (madvise).
#include "../medusa_jax/kernels/stream_matmul.cc"

#include <sys/mman.h>

#include <cstdio>

int main(int argc, char** argv) {
  const int64_t K = 576, N = argc > 1 ? atol(argv[1]) : 196608;
  const size_t bytes = size_t(K * N) * sizeof(float);
  float* w = static_cast<float*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (argc > 2 && atoi(argv[2])) madvise(w, bytes, MADV_HUGEPAGE);
  for (int64_t i = 0; i < K * N; ++i) w[i] = float(i % 7) * 0.01f;
  std::vector<float> x(16 * K, 0.5f), y(16 * N);
  const int repeats = bytes > (size_t(64) << 20) ? 4 : 40;
  for (int64_t M : {1, 2, 4, 8, 16}) {
    double one = 1e9, all = 1e9;
    for (int r = 0; r < repeats; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      nt_rows(x.data(), w, y.data(), M, K, N, 0, N);
      one = std::min(one, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      t0 = std::chrono::steady_clock::now();
      parallel_columns(N, K, 12, [&](int64_t b, int64_t e) { nt_rows(x.data(), w, y.data(), M, K, N, b, e); });
      all = std::min(all, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    printf("M=%2ld  1 thread %5.1f GB/s   workers (%d threads) %5.1f GB/s\n", long(M), bytes / one / 1e9,
           Workers::get().threads(), bytes / all / 1e9);
  }
  return 0;
}
