// A decoding step's GGUF-block products alone, outside XLA (docs/performance.md, session 26): the
// 120 Q4_1 products of SmolLM2-135M's 30 layers (q/k/v [960, 576], o [576, 576], gate/up
// [3072, 576], down [576, 1536]) and the Q8_0 lm_head [49152, 576], random blocks on 2 MB pages,
// run through the kernel's threads as decoding runs them; ms per step (best of 15) for M = 1..4 rows.
//
//   INC=$(.venv/bin/python -c 'import jax; print(jax.ffi.include_dir())')
//   c++ -O3 -mavx2 -mfma -mf16c -ffp-contract=off -std=c++17 -w -I"$INC" \
//       scripts/block_step_harness.cc -o /tmp/block_step_avx2 -lpthread
//   c++ -O3 -mavx2 -mfma -mf16c -mavx512f -mavx512vl -ffp-contract=off -std=c++17 -w -I"$INC" \
//       scripts/block_step_harness.cc -o /tmp/block_step_avx512 -lpthread
//   for i in 1 2 3 4 5; do /tmp/block_step_avx2; /tmp/block_step_avx512; done
//
// The checksum is the same for both builds (their outputs are bit for bit alike).
#include "../medusa_jax/kernels/stream_matmul.cc"

#include <sys/mman.h>

#include <cstdio>
#include <random>

namespace {
struct Product {
  int64_t N, K;
  bool q8_0;
  uint8_t* w;
};

Product random_blocks(std::mt19937& g, int64_t N, int64_t K, bool q8_0) {
  const int64_t bb = q8_0 ? 34 : 20;
  const size_t bytes = size_t(N) * (K / 32) * bb;
  auto* w = static_cast<uint8_t*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  madvise(w, bytes, MADV_HUGEPAGE);
  for (size_t i = 0; i < bytes; ++i) w[i] = g() & 0xff;
  for (int64_t b = 0; b < N * (K / 32); ++b) {  // finite float16 scales (and offsets)
    const uint16_t d = 0x2000 | (g() & 0x3ff), m = 0xa000 | (g() & 0x3ff);
    std::memcpy(w + b * bb, &d, 2);
    if (!q8_0) std::memcpy(w + b * bb + 2, &m, 2);
  }
  return {N, K, q8_0, w};
}
}  // namespace

int main() {
  std::mt19937 g(0);
  std::vector<Product> ps;
  for (int layer = 0; layer < 30; ++layer)
    for (auto [N, K] : {std::pair<int64_t, int64_t>{960, 576}, {576, 576}, {3072, 576}, {576, 1536}})
      ps.push_back(random_blocks(g, N, K, false));
  ps.push_back(random_blocks(g, 49152, 576, true));
  std::vector<float> x(16 * 1536), y(16 * 49152);
  for (auto& v : x) v = float(g() % 1000) / 1000.f - 0.5f;
  for (int64_t M : {1, 2, 3, 4}) {
    double q4 = 1e9, lm = 1e9;
    for (int r = 0; r < 15; ++r) {
      double t_q4 = 0;
      for (const Product& p : ps) {
        const auto t0 = std::chrono::steady_clock::now();
        parallel_columns(p.N, 4 * p.K, 12, [&](int64_t b, int64_t e) {
          if (p.q8_0) nt_rows<Q8_0W>(x.data(), p.w, y.data(), M, p.K, p.N, b, e);
          else nt_rows<Q4_1W>(x.data(), p.w, y.data(), M, p.K, p.N, b, e);
        });
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (p.q8_0) lm = std::min(lm, s);
        else t_q4 += s;
      }
      q4 = std::min(q4, t_q4);
    }
    double checksum = 0;
    for (int64_t i = 0; i < M * 49152; ++i) checksum += y[i];
    std::printf("M=%ld  q4_1 products %.3f ms  lm_head q8_0 %.3f ms  (checksum %.9g)\n", long(M), q4 * 1e3, lm * 1e3,
                checksum);
  }
  return 0;
}
