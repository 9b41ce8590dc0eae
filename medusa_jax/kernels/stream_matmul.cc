// Weight-streaming matrix products for decoding on the CPU, as an XLA FFI custom call.
//
// A decoding step multiplies a handful of rows (M = batch x tree nodes, 1-16) by every weight
// matrix of the model. Such a product is bound by memory bandwidth: each weight is read once and
// used M times. XLA's CPU GEMM for a few rows reads the weights well below the bandwidth (issue 13,
// docs/performance.md: the 2-row lm_head product cost 2-2.8x the 1-row one), so this kernel reads
// each weight matrix once, in the [out, in] layout (rows contiguous, as torch's nn.Linear.weight
// and the embedding of a tied lm_head), and accumulates all M rows from registers and L1:
//
//   medusa_matmul_nt:       y[M, N] = x[M, K] @ w[N, K]^T     float32, AVX2 + FMA
//   medusa_matmul_nt_bf16:  the same with bfloat16 w (float32 x, y and sums): half the bytes
//   medusa_matmul_nt_q8_0, _q4_0, _q4_1: the same with w as a GGUF file stores it (blocks of 32
//     weights, `Q8_0W` and the others below), dequantized in registers exactly as the gguf
//     package dequantizes them (float32 multiply, then add): a sixth to a quarter of the bytes
//
//   medusa_dequantize_q8_0, _q4_0, _q4_1: GGUF blocks -> float32 weights, the same values (for
//     products with more rows, which XLA runs: prefill)
//
//   medusa_cache_attention: attention of T <= 16 new tokens over the KV cache (below)
//
//   medusa_argmax_rows: the greedy token of each row of logits, as jnp.argmax (below)
//
// The Python side (__init__.py) loads this library only on x86-64 CPUs with AVX2 and FMA (built
// with AVX-512VL too where the CPU has it: 32 vector registers, and `table16` below). The
// output rows of w are split between the calling thread and the kernel's own workers (`Workers`).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i tail_mask(int64_t count) {  // the first `count` (0..8) lanes
  alignas(32) int32_t bits[8];
  for (int i = 0; i < 8; ++i) bits[i] = i < count ? -1 : 0;
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(bits));
}

// All-ones lanes where m[i] is true, for the first n (1..8) of 8 bools (bool is one byte, 0 or 1).
inline __m256 visible_lanes(const bool* m, int64_t n) {
  uint64_t bytes = 0;
  if (n == 8) std::memcpy(&bytes, m, 8);
  else std::memcpy(&bytes, m, size_t(n));
  const __m256i w = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(bytes)));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(w, _mm256_setzero_si256()));
}

// Weights are float32 or bfloat16 (the upper 16 bits of a float32, stored as uint16): a bf16 load
// widens 8 values to float32 exactly (zero-extend, shift left 16), so both products run the same
// float32 fused multiply-adds in the same order.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
inline __m256 load8_masked(const float* p, __m256i tail, int64_t) { return _mm256_maskload_ps(p, tail); }
inline __m256 load8_masked(const uint16_t* p, __m256i, int64_t count) {  // the first `count` (1..7) values
  alignas(16) uint16_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(buf, p, size_t(count) * sizeof(uint16_t));
  return load8(buf);
}

// Weight formats: where row n of a [N, K] weight starts (`row`; row n + j is `stride` further), 8
// of its weights from column k as float32 (`load8`, k a multiple of 8; `load8_tail` for the last
// 1-7), and the address to prefetch for column k (`at`). float32 and bfloat16 rows hold K values;
// the GGUF formats hold K / 32 blocks of 32 weights, each with float16 scales (`kBytes` per block).
template <typename T>
struct PlainW {  // float32, or uint16_t holding bfloat16
  using Row = const T*;
  static constexpr int64_t kBlock = 1;
  static int64_t row_bytes(int64_t K) { return K * int64_t(sizeof(T)); }
  static int64_t stride(int64_t K) { return K; }
  static Row row(const void* w, int64_t n, int64_t K) { return static_cast<const T*>(w) + n * K; }
  static __m256 load8(Row r, int64_t k) { return ::load8(r + k); }
  static __m256 load8_tail(Row r, int64_t k, __m256i tail, int64_t count) { return load8_masked(r + k, tail, count); }
  static const void* at(Row r, int64_t k) { return r + k; }
};
using F32W = PlainW<float>;
using BF16W = PlainW<uint16_t>;

// A block of 32 weights: its float16 scales widened once (`scales`), then its 4 vectors of 8
// (`vec(b, s, h)`: weights 8h..8h+7 of the block at b), each read from the block's bytes as it is
// needed, so that a product keeps only the vector it multiplies in a register. Each value is
// computed exactly as the gguf package computes it (below, per format).
struct Scales {
  __m256 d, m;  // the block's scale and offset, in every lane
};

// A block's float16 scale d (its first 2 bytes), or d and m (its first 4), widened exactly and
// broadcast: one load and one conversion for both (a scalar conversion and a broadcast for each
// made the one-row Q4_1 product 1.18x slower, docs/performance.md, session 22).
inline Scales half_d(const uint8_t* b) {
  int16_t h;
  std::memcpy(&h, b, 2);
  return {_mm256_cvtph_ps(_mm_set1_epi16(h)), _mm256_setzero_ps()};
}
inline Scales half_dm(const uint8_t* b) {
  float dm;  // d and m, 2 + 2 bytes
  std::memcpy(&dm, b, 4);
  const __m256 v = _mm256_cvtph_ps(_mm_castps_si128(_mm_set1_ps(dm)));  // d, m, d, m, ...
  return {_mm256_moveldup_ps(v), _mm256_movehdup_ps(v)};
}

template <int64_t BYTES>
struct BlockW {
  using Row = const uint8_t*;
  static constexpr int64_t kBlock = 32, kBytes = BYTES;
  static int64_t row_bytes(int64_t K) { return K / 32 * BYTES; }
  static int64_t stride(int64_t K) { return row_bytes(K); }
  static Row row(const void* w, int64_t n, int64_t K) { return static_cast<const uint8_t*>(w) + n * row_bytes(K); }
  static const void* at(Row r, int64_t k) { return r + (k >> 5) * BYTES; }
};

// Vector h of a block's 32 4-bit values as 8 int32: values 0-15 are the low nibbles of its 16
// bytes, 16-31 their high nibbles (ggml's layout); bytes widened straight from memory.
inline __m256i nibbles8(const uint8_t* qs, int h) {
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * (h & 1))));
  return h < 2 ? _mm256_and_si256(x, _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(x, 4);
}

// Q8_0: float16 d, 32 int8 q; w = float(q) * d.
struct Q8_0W : BlockW<34> {
  using Scales = ::Scales;
  static Scales scales(const uint8_t* b) { return half_d(b); }
  static __m256 vec(const uint8_t* b, Scales s, int h) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * h));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s.d);
  }
};

#if defined(__AVX512VL__)
// With AVX-512VL (library.py builds with it where the CPU has it), a 4-bit block's 16 possible
// weights are computed once per block (`table16`: the same multiply, or multiply-add, per value as
// the AVX2 build's per vector) and each vector of 8 is looked up in them by its nibbles
// (`vpermt2ps`, a two-register table indexed by the low 4 bits of each lane, so the low nibbles
// need no mask): a lookup in place of a conversion, a multiply(-add) and a mask per vector, the
// same values (session 26: a step's Q4_1 products 2-6% faster at 1-4 rows, docs/performance.md).
struct Table16 {
  __m256 lo, hi;  // the weights of q = 0..7 and 8..15
};
inline Table16 table16(Scales s, bool offset) {
  const __m256 lo = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), hi = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
  if (offset) return {_mm256_fmadd_ps(s.d, lo, s.m), _mm256_fmadd_ps(s.d, hi, s.m)};  // Q4_1: d * q + m
  const __m256 eight = _mm256_set1_ps(8);                                                // Q4_0: d * (q - 8)
  return {_mm256_mul_ps(s.d, _mm256_sub_ps(lo, eight)), _mm256_mul_ps(s.d, _mm256_sub_ps(hi, eight))};
}
inline __m256 lookup16(const uint8_t* qs, Table16 t, int h) {  // vector h of the block, as `nibbles8`
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * (h & 1))));
  return _mm256_permutex2var_ps(t.lo, h < 2 ? x : _mm256_srli_epi32(x, 4), t.hi);
}
#endif

// Q4_0: float16 d, 32 4-bit q; w = d * float(q - 8).
struct Q4_0W : BlockW<18> {
#if defined(__AVX512VL__)
  using Scales = Table16;
  static Scales scales(const uint8_t* b) { return table16(half_d(b), false); }
  static __m256 vec(const uint8_t* b, Scales t, int h) { return lookup16(b + 2, t, h); }
#else
  using Scales = ::Scales;
  static Scales scales(const uint8_t* b) { return half_d(b); }
  static __m256 vec(const uint8_t* b, Scales s, int h) {
    const __m256i q = _mm256_sub_epi32(nibbles8(b + 2, h), _mm256_set1_epi32(8));
    return _mm256_mul_ps(s.d, _mm256_cvtepi32_ps(q));
  }
#endif
};

// Q4_1: float16 d and m, 32 4-bit q; w = (d * float(q)) + m, a multiply then an add, computed here
// as one fused multiply-add with the same result: d has 11 significant bits and q at most 4, so
// d * q is exact in float32 and only the add rounds, as in the fused operation.
struct Q4_1W : BlockW<20> {
#if defined(__AVX512VL__)
  using Scales = Table16;
  static Scales scales(const uint8_t* b) { return table16(half_dm(b), true); }
  static __m256 vec(const uint8_t* b, Scales t, int h) { return lookup16(b + 4, t, h); }
#else
  using Scales = ::Scales;
  static Scales scales(const uint8_t* b) { return half_dm(b); }
  static __m256 vec(const uint8_t* b, Scales s, int h) {
    return _mm256_fmadd_ps(s.d, _mm256_cvtepi32_ps(nibbles8(b + 4, h)), s.m);
  }
#endif
};

// Rows n..n+R-1 of a GGUF-block weight as float32 in out [R, K] (each value as `WF::vec` gives
// it), prefetching the same bytes of the rows `ahead` further down.
template <typename WF>
inline void dequantize_rows(const void* w, int64_t n, int64_t R, int64_t K, int64_t ahead, float* out) {
  if constexpr (WF::kBlock > 1)  // (instantiated, never called, for float32 and bfloat16 rows)
  for (int64_t j = 0; j < R; ++j) {
    const typename WF::Row r = WF::row(w, n + j, K);
    for (int64_t k = 0; k < K; k += 32) {
      if (ahead) _mm_prefetch(static_cast<const char*>(WF::at(WF::row(w, n + ahead + j, K), k)), _MM_HINT_T0);
      const uint8_t* b = static_cast<const uint8_t*>(WF::at(r, k));
      const typename WF::Scales s = WF::scales(b);
      for (int h = 0; h < 4; ++h) _mm256_storeu_ps(out + j * K + k + 8 * h, WF::vec(b, s, h));
    }
  }
}

// One block of the product: rows t..t+TB-1 of x against rows wn..wn+NB-1 of w (outputs n..n+NB-1), TB x NB
// accumulators in registers, k in steps of 8 (the K tail by a masked load; GGUF blocks: steps of
// 32, one block per weight row at a time). For k in [pf0, pf1)
// the rows `ahead` rows further down w are prefetched, one cache line per row every 16 k, so that
// memory keeps streaming while blocks compute from L1.
template <typename WF, int TB, int NB>
inline void nt_block(const float* x, const void* w, int64_t wn, float* y, int64_t K, int64_t N, int64_t t, int64_t n,
                     __m256i tail, int64_t pf0, int64_t pf1, int64_t ahead) {
  __m256 acc[TB][NB];
  for (int i = 0; i < TB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  const typename WF::Row e = WF::row(w, wn, K);  // outputs n.. read weight rows wn..
  const int64_t rs = WF::stride(K);
  const float* xs = x + t * K;
  if constexpr (WF::kBlock > 1) {
    // GGUF blocks (K a multiple of 32): the NB weight rows' blocks at k, vector by vector: each
    // vector of 8 weights dequantized once (`vec`) and used by the TB rows, each x vector loaded
    // once for the NB outputs; every accumulator still adds its 8-wide products in increasing k.
    for (int64_t k = 0; k < K; k += 32) {
      if (k >= pf0 && k < pf1)
        for (int j = 0; j < NB; ++j)
          _mm_prefetch(static_cast<const char*>(WF::at(e + (ahead + j) * rs, k)), _MM_HINT_T0);
      const uint8_t* b[NB];
      typename WF::Scales s[NB];
      for (int j = 0; j < NB; ++j) {
        b[j] = static_cast<const uint8_t*>(WF::at(e + j * rs, k));
        s[j] = WF::scales(b[j]);
      }
      if constexpr (TB == 1) {  // one row: weight row by weight row, few registers live (the 4
                                // rows' vectors interleaved spilled registers: 1.25x slower)
        for (int j = 0; j < NB; ++j)
          for (int h = 0; h < 4; ++h)
            acc[0][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + k + 8 * h), WF::vec(b[j], s[j], h), acc[0][j]);
      } else {
        // 2 rows: each vector dequantized in registers and used twice. 3 or 4 rows: the block's
        // NB x 32 weights dequantized into L1 first (`ub`), then multiplied as float32 weights
        // are; dequantizing in registers there needs more than the 16 vector registers (scales,
        // vectors and 12 accumulators), and the spills cost more.
        alignas(32) float ub[NB][32];
        if constexpr (TB > 2)
          for (int j = 0; j < NB; ++j)
            for (int h = 0; h < 4; ++h) _mm256_store_ps(ub[j] + 8 * h, WF::vec(b[j], s[j], h));
        for (int h = 0; h < 4; ++h) {
          __m256 u[NB];
          for (int j = 0; j < NB; ++j) u[j] = TB > 2 ? _mm256_load_ps(ub[j] + 8 * h) : WF::vec(b[j], s[j], h);
          for (int i = 0; i < TB; ++i) {
            const __m256 v = _mm256_loadu_ps(xs + i * K + k + 8 * h);
            for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(v, u[j], acc[i][j]);
          }
        }
      }
    }
  } else {
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      if (k >= pf0 && k < pf1)
        for (int j = 0; j < NB; ++j)
          _mm_prefetch(static_cast<const char*>(WF::at(e + (ahead + j) * rs, k)), _MM_HINT_T0);
      for (int h = 0; h < 16; h += 8) {
        __m256 u[NB];
        for (int j = 0; j < NB; ++j) {
          u[j] = WF::load8(e + j * rs, k + h);
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
      for (int j = 0; j < NB; ++j) u[j] = full ? WF::load8(e + j * rs, k) : WF::load8_tail(e + j * rs, k, tail, K - k);
      for (int i = 0; i < TB; ++i) {
        const __m256 v = full ? _mm256_loadu_ps(xs + i * K + k) : _mm256_maskload_ps(xs + i * K + k, tail);
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(v, u[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < TB; ++i)
    for (int j = 0; j < NB; ++j) y[(t + i) * N + n + j] = hsum(acc[i][j]);
}

// y[:, n0:n1] = x @ w[n0:n1, :]^T for w row-major [N, K]: NB rows of w (NB outputs) at a time,
// streamed from memory once and re-read from L1 for every TB rows of x (the last pass takes the
// 1 to TB - 1 rows left over). Each block prefetches a block two ahead, the work spread over its
// passes, so memory keeps streaming while blocks compute. Each output is one dot product whose
// order of additions does not depend on M, so a row's result is the same whether it is multiplied
// alone or with others.
// One pass: rows t.. of x (the TB, or the 1 to TB - 1 left) against NB weight rows from wn.
template <typename WF, int TB, int NB>
inline void nt_pass(const float* x, const void* w, int64_t wn, float* y, int64_t M, int64_t K, int64_t N, int64_t t,
                    int64_t n, __m256i tail, int64_t pf0, int64_t pf1, int64_t ahead) {
  switch (std::min<int64_t>(TB, M - t)) {
    case 4: nt_block<WF, (TB >= 4 ? 4 : 1), NB>(x, w, wn, y, K, N, t, n, tail, pf0, pf1, ahead); break;
    case 3: nt_block<WF, (TB >= 3 ? 3 : 1), NB>(x, w, wn, y, K, N, t, n, tail, pf0, pf1, ahead); break;
    case 2: nt_block<WF, (TB >= 2 ? 2 : 1), NB>(x, w, wn, y, K, N, t, n, tail, pf0, pf1, ahead); break;
    default: nt_block<WF, 1, NB>(x, w, wn, y, K, N, t, n, tail, pf0, pf1, ahead); break;
  }
}

template <typename WF, int TB, int NB>
void nt_rows_blocked(const float* x, const void* w, float* y, int64_t M, int64_t K, int64_t N,
                     int64_t n0, int64_t n1, __m256i tail) {
  static_assert(TB >= 1 && TB <= 4, "passes of 1 to 4 rows");
  // GGUF blocks over several passes (more than TB rows): NB rows dequantized once into an L1
  // buffer (`dequantize_rows`), which every pass then reads as float32 weights, the bytes ahead
  // prefetched while dequantizing; in one pass they are dequantized in registers (`WF::vec`).
  const int64_t passes = (M + TB - 1) / TB;
  constexpr bool kBlocks = WF::kBlock > 1;
  using PW = std::conditional_t<kBlocks, F32W, WF>;
  float* buf = nullptr;
  if constexpr (kBlocks) {
    if (passes > 1) {
      thread_local std::vector<float> rows;  // this thread's NB dequantized rows
      if (rows.size() < size_t(NB * K)) rows.resize(size_t(NB * K));
      buf = rows.data();
    }
  }
  const int64_t kAhead = 2 * NB;
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    const int64_t ahead = (n + kAhead + NB <= n1) ? kAhead : 0;
    if (buf) {
      dequantize_rows<WF>(w, n, NB, K, ahead, buf);
      for (int64_t t = 0; t < M; t += TB) nt_pass<PW, TB, NB>(x, buf, 0, y, M, K, N, t, n, tail, K, K, 0);
      continue;
    }
    for (int64_t p = 0, t = 0; p < passes; ++p, t += TB) {
      const int64_t pf0 = ahead ? K * p / passes / 16 * 16 : K;
      const int64_t pf1 = !ahead ? K : (p + 1 == passes) ? K : K * (p + 1) / passes / 16 * 16;
      nt_pass<WF, TB, NB>(x, w, n, y, M, K, N, t, n, tail, pf0, pf1, ahead);
    }
  }
  for (; n < n1; ++n) {  // fewer than NB outputs left
    if (buf) dequantize_rows<WF>(w, n, 1, K, 0, buf);
    for (int64_t t = 0; t < M; ++t) {
      if (buf) nt_block<PW, 1, 1>(x, buf, 0, y, K, N, t, n, tail, K, K, 0);
      else nt_block<WF, 1, 1>(x, w, n, y, K, N, t, n, tail, K, K, 0);
    }
  }
}

// The blocking by M, measured on this project's AVX2 CPU (docs/performance.md): one row, 4 outputs
// per block (memory-bound); two rows, 2 x 4 (GGUF blocks: 2 x 2, which leaves registers for the
// scales and the dequantized vectors); more, 4 x 3 accumulators (12 of the 16 registers).
// Every output is the same dot product, summed in the same order, whatever the blocking.
template <typename WF>
void nt_rows(const float* x, const void* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const __m256i tail = tail_mask(K % 8);
  if (M == 1) nt_rows_blocked<WF, 1, 4>(x, w, y, M, K, N, n0, n1, tail);
  else if (M == 2) nt_rows_blocked<WF, 2, (WF::kBlock > 1 ? 2 : 4)>(x, w, y, M, K, N, n0, n1, tail);
  else nt_rows_blocked<WF, 4, 3>(x, w, y, M, K, N, n0, n1, tail);
}

// ---------------------------------------------------------------------------------------------
// Threads. A decoding step runs ~200 products of 0.1-1 ms each, so what a product pays to start its
// helper threads matters: waking a sleeping thread costs tens of microseconds on a virtual machine.
// (With XLA's intra-op pool, a stack of 3.5 MB products streamed at 0.69 of the bandwidth where one
// 113 MB product reached 0.97 on this project's CPU, docs/performance.md.)
// The helpers here are the kernel's own, started on first use: after a product they spin for a
// short while (MEDUSA_JAX_SPIN_US, default 200 us) waiting for the next one, and only then sleep.
// Work is split into chunks of output columns that the caller and the helpers claim from one
// counter, so the caller starts at once and never waits for a helper that has not claimed anything:
// a late helper costs the parallelism it missed, not its wake-up time. Each output is computed by
// one thread in a fixed order, so the results do not depend on who ran which chunk.

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

class Workers {
 public:
  // The process's workers (recreated in a forked child, whose parent's threads do not exist).
  static Workers& get() {
    static std::atomic<Workers*> instance{nullptr};
    static std::mutex mu;
    Workers* w = instance.load(std::memory_order_acquire);
    if (w && w->pid_ == getpid()) return *w;
    std::lock_guard<std::mutex> lock(mu);
    w = instance.load(std::memory_order_acquire);
    if (!w || w->pid_ != getpid()) {
      w = new Workers();  // never freed: its threads live as long as the process
      instance.store(w, std::memory_order_release);
    }
    return *w;
  }

  int threads() const { return helpers_ + 1; }

  // Runs fn(begin, end) over [0, n) in `nchunks` chunks of `chunk` columns, on the caller and the
  // helpers. A product that finds the helpers busy (another device's thread is using them) runs
  // alone on its caller.
  void run(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn) {
    const int64_t nchunks = (n + chunk - 1) / chunk;
    if (helpers_ == 0 || nchunks < 2 || nchunks > kMaxChunks || !run_mu_.try_lock()) {
      fn(0, n);
      return;
    }
    fn_ = &fn;
    n_ = n;
    chunk_ = chunk;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = ++gen_;
    ticket_.store(pack(gen, nchunks, 0), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mu_);
      wake_.notify_all();
    }
    work(gen);
    while (done_.load(std::memory_order_acquire) != nchunks) _mm_pause();
    run_mu_.unlock();
  }

 private:
  static constexpr int64_t kMaxChunks = 0xffff;

  // ticket = generation (32 bits) | chunks (16) | next chunk (16): a claim is one compare-exchange
  // that also checks the product is still the one the claimer saw.
  static uint64_t pack(uint64_t gen, int64_t nchunks, int64_t next) {
    return (gen << 32) | (uint64_t(nchunks) << 16) | uint64_t(next);
  }
  static uint64_t gen_of(uint64_t t) { return t >> 32; }

  Workers() : pid_(getpid()) {
    cpu_set_t set;
    int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    helpers_ = std::max(0, std::min(cpus, env_int("MEDUSA_JAX_THREADS", cpus)) - 1);
    spin_ = std::chrono::microseconds(std::max(0, env_int("MEDUSA_JAX_SPIN_US", 200)));
    for (int i = 0; i < helpers_; ++i) std::thread([this] { helper(); }).detach();
  }

  // Claims and runs chunks of product `gen` until none is left (or another product started).
  void work(uint64_t gen) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    while (gen_of(t) == gen) {
      const int64_t nchunks = (t >> 16) & 0xffff, next = t & 0xffff;
      if (next >= nchunks) return;
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      // The claim holds the product open (its caller waits for every chunk): fn_, n_, chunk_ are its.
      (*fn_)(next * chunk_, std::min(n_, (next + 1) * chunk_));
      done_.fetch_add(1, std::memory_order_release);
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  void helper() {
    uint64_t seen = 0;
    for (;;) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      if (gen_of(t) != seen) {
        seen = gen_of(t);
        work(seen);
        continue;
      }
      const auto until = std::chrono::steady_clock::now() + spin_;
      bool fresh = false;
      while (!fresh && std::chrono::steady_clock::now() < until) {
        for (int i = 0; i < 64 && !fresh; ++i) {
          _mm_pause();
          fresh = gen_of(ticket_.load(std::memory_order_acquire)) != seen;
        }
      }
      if (fresh) continue;
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      {
        std::unique_lock<std::mutex> lock(sleep_mu_);
        wake_.wait(lock, [&] { return gen_of(ticket_.load(std::memory_order_seq_cst)) != seen; });
      }
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  const pid_t pid_;
  int helpers_ = 0;
  std::chrono::microseconds spin_{0};
  std::mutex run_mu_;  // held by the product the helpers work for
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, chunk_ = 1;
  uint64_t gen_ = 0;
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::mutex sleep_mu_;
  std::condition_variable wake_;
};

// Splits [0, N) into chunks of whole `align`-column units (`row_bytes` per column: the caller's
// measure of a column's work) and runs fn(begin, end) on them across the workers. A chunk is about
// MEDUSA_JAX_CHUNK_KB (default 256) KiB, or for a large product 1 / MEDUSA_JAX_CHUNKS_PER_THREAD
// (default 16; 0: fixed-size chunks) of each thread's share, if that is more: every chunk starts
// with rows that no earlier block prefetched, and in 256 KiB chunks a one-row product over Q8_0
// blocks streamed from memory at 19-23 GB/s where 1 MiB chunks reached 21-28 (docs/performance.md,
// session 25; the lm_head, 113 MB of float32 work, had ~450 chunks). Small products keep their two
// or more chunks, so both threads share them.
void parallel_columns(int64_t N, int64_t row_bytes, int64_t align, const std::function<void(int64_t, int64_t)>& fn) {
  static const int64_t chunk_bytes = int64_t{1024} * std::max(4, env_int("MEDUSA_JAX_CHUNK_KB", 256));
  static const int64_t per_thread = std::max(0, env_int("MEDUSA_JAX_CHUNKS_PER_THREAD", 16));
  Workers& workers = Workers::get();
  if (row_bytes * N < 2 * chunk_bytes || workers.threads() == 1) {
    fn(0, N);  // too small to be worth a hand-off
    return;
  }
  const int64_t share = per_thread ? row_bytes * N / (workers.threads() * per_thread) : 0;
  const int64_t units = std::max<int64_t>(1, std::max(chunk_bytes, share) / (row_bytes * align));
  workers.run(N, units * align, fn);
}

// x [M, K], w [N, row bytes] (a format's rows, `WF::row_bytes(K)` bytes each), y [M, N].
template <typename WF, typename WBuffer>
ffi::Error check_shapes(const ffi::Buffer<ffi::F32>& x, const WBuffer& w,
                        ffi::ResultBuffer<ffi::F32>& y, int64_t* M, int64_t* K, int64_t* N) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("medusa_matmul_nt: x, w and y must be 2-D");
  *M = xd[0];
  *K = xd[1];
  *N = wd[0];
  if (*K % WF::kBlock != 0)
    return ffi::Error::InvalidArgument("medusa_matmul_nt: K must be a multiple of the weights' block of 32");
  const int64_t bytes = wd[1] * int64_t(ffi::ByteWidth(w.element_type()));
  if (bytes != WF::row_bytes(*K) || yd[0] != *M || yd[1] != *N)
    return ffi::Error::InvalidArgument("medusa_matmul_nt: shapes do not agree (x [M, K], w [N, K] or its "
                                       "blocks' bytes, y [M, N])");
  return ffi::Error::Success();
}

// y = x @ w^T with weights of format WF streamed by `nt_rows`.
template <typename WF, typename WBuffer>
ffi::Error run_nt(const ffi::Buffer<ffi::F32>& x, const WBuffer& w, ffi::ResultBuffer<ffi::F32>& y) {
  int64_t M, K, N;
  if (auto err = check_shapes<WF>(x, w, y, &M, &K, &N); err.failure()) return err;
  const float* xp = x.typed_data();
  const void* wp = w.untyped_data();
  float* yp = y->typed_data();
  // Chunks are sized by a column's work, K multiply-adds, as float32 bytes (4 K), not by the bytes its
  // format stores: the block kernels are bound by arithmetic, and sized by their bytes (0.625 K for
  // Q4_1) a step's q/k/v and o products (345 and 207 KB of Q4_1) fell under the two-chunk threshold
  // and ran on one thread (docs/performance.md, session 21). The outputs do not depend on the split.
  parallel_columns(N, int64_t(sizeof(float)) * K, 12,
                   [&](int64_t b, int64_t e) { nt_rows<WF>(xp, wp, yp, M, K, N, b, e); });
  return ffi::Error::Success();
}

ffi::Error MatmulNT(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  return run_nt<F32W>(x, w, y);
}

// The same product with bfloat16 weights (float32 activations and sums): half the bytes streamed.
ffi::Error MatmulNTBf16(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y) {
  return run_nt<BF16W>(x, w, y);
}

// The same product with GGUF blocks as w ([N, K / 32 * block bytes] uint8).
template <typename WF>
ffi::Error MatmulNTBlocks(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::ResultBuffer<ffi::F32> y) {
  return run_nt<WF>(x, w, y);
}

// GGUF blocks w [N, K / 32 * block bytes] -> float32 y [N, K] (for products with more rows than the
// streaming kernel takes: prefill chunks, which XLA then multiplies), each value as `vec` gives
// it, rows split between the threads.
template <typename WF>
ffi::Error DequantizeBlocks(ffi::Buffer<ffi::U8> w, ffi::ResultBuffer<ffi::F32> y) {
  auto wd = w.dimensions(), yd = y->dimensions();
  if (wd.size() != 2 || yd.size() != 2 || yd[0] != wd[0] || yd[1] % 32 != 0 || WF::row_bytes(yd[1]) != wd[1])
    return ffi::Error::InvalidArgument("medusa_dequantize: w [N, K / 32 * block bytes] and y [N, K] do not agree");
  const int64_t N = wd[0], K = yd[1];
  const void* wp = w.untyped_data();
  float* yp = y->typed_data();
  parallel_columns(N, WF::row_bytes(K) + 4 * K, 1,
                   [&](int64_t b, int64_t e) { dequantize_rows<WF>(wp, b, e - b, K, 0, yp + b * K); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(medusa_matmul_nt, MatmulNT,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

#define MEDUSA_BLOCKS_HANDLER(name, format)                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, MatmulNTBlocks<format>,        \
                                ffi::Ffi::Bind()                     \
                                    .Arg<ffi::Buffer<ffi::F32>>()    \
                                    .Arg<ffi::Buffer<ffi::U8>>()     \
                                    .Ret<ffi::Buffer<ffi::F32>>());

MEDUSA_BLOCKS_HANDLER(medusa_matmul_nt_q8_0, Q8_0W)
MEDUSA_BLOCKS_HANDLER(medusa_matmul_nt_q4_0, Q4_0W)
MEDUSA_BLOCKS_HANDLER(medusa_matmul_nt_q4_1, Q4_1W)

#define MEDUSA_DEQUANTIZE_HANDLER(name, format)                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, DequantizeBlocks<format>,      \
                                ffi::Ffi::Bind()                     \
                                    .Arg<ffi::Buffer<ffi::U8>>()     \
                                    .Ret<ffi::Buffer<ffi::F32>>());

MEDUSA_DEQUANTIZE_HANDLER(medusa_dequantize_q8_0, Q8_0W)
MEDUSA_DEQUANTIZE_HANDLER(medusa_dequantize_q4_0, Q4_0W)
MEDUSA_DEQUANTIZE_HANDLER(medusa_dequantize_q4_1, Q4_1W)

XLA_FFI_DEFINE_HANDLER_SYMBOL(medusa_matmul_nt_bf16, MatmulNTBf16,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

namespace {

// ---------------------------------------------------------------------------------------------
// Attention of a decoding or tree step over the KV cache, read in place:
//
//   medusa_cache_attention: out[B, T, H * Dh] = softmax(q k^T / sqrt(Dh), mask) v
//     q [B, T, H, Dh] float32 (RoPE applied); k, v [L, B, KVH, S, Dh] float32 (the whole cache,
//     layer `layer` read); mask [B, T, S] bool; lengths [B] int32 (slots >= lengths[b] + T are
//     never visible, so they are not read).
//
// XLA copied each layer's cache slice out of the cache and ran two small products per layer
// (docs/performance.md). Here, per (row b, KV head): the g = H / KVH query heads' T queries are
// the rows of one block; its scores against the slots are a `nt_rows` product with the layer's
// [S, Dh] keys (each score one dot product in a fixed order), then a masked softmax per row
// (float32, exp by a polynomial accurate to ~2 ulp), then the rows' weighted sums of the values
// (`weighted_rows`). Each phase is split between the threads (`CacheAttention`). Every output
// is the same sum, in the same order, whatever T is and whichever thread computes it, so a tree
// step's root row equals a plain step's bit for bit. A query that sees no slot gets the mean of all S values
// (as the XLA path: every score at float32's lowest).

// e^x for x <= 0 (x below -87.3 gives 0): Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, and
// a degree-6 polynomial for e^r (Cephes' expf coefficients).
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Weighted sums of several query rows over the same values, 32 columns at a time:
//   o[r][0:w] = scale[r] * sum_{s < E} p[r][s] * v[s * Dh + 0:w],  w <= 32 (NV vectors of 8).
// Two rows share each load of v, and the slots go in tiles of `kValueTile`, whose values the
// other rows re-read from L1: streaming v from L2 once per row was the bound. Each output is one
// fused multiply-add per slot, in slot order, then the scale, whatever the rows and tiles.
constexpr int64_t kValueTile = 64;

template <int NV, int RB, bool FULL>
void weighted_tile(const float* const* p, const float* v, int64_t s0, int64_t s1, int64_t Dh, __m256i last,
                   float* acc_mem, int64_t prefetch_to) {
  __m256 acc[RB][NV];
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_loadu_ps(acc_mem + (i * NV + j) * 8);
  for (int64_t s = s0; s < s1; ++s) {
    const float* vs = v + s * Dh;
    if (s + kValueTile < prefetch_to)  // the next tile, while this one computes
      for (int j = 0; j < NV; j += 2) _mm_prefetch(reinterpret_cast<const char*>(vs + kValueTile * Dh + 8 * j), _MM_HINT_T0);
    __m256 x[NV];
    for (int j = 0; j < NV; ++j) {
      x[j] = (FULL || j + 1 < NV) ? _mm256_loadu_ps(vs + 8 * j) : _mm256_maskload_ps(vs + 8 * j, last);
      if (RB > 1) __asm__("" : "+x"(x[j]));  // keep it in a register: it is used RB times
    }
    for (int i = 0; i < RB; ++i) {
      const __m256 ps = _mm256_broadcast_ss(p[i] + s);
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_fmadd_ps(ps, x[j], acc[i][j]);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(acc_mem + (i * NV + j) * 8, acc[i][j]);
}

template <int NV, bool FULL>
void weighted_rows(const float* const* p, const float* v, int64_t E, int64_t Dh, int64_t w, const float* scale,
                   float* const* o, int64_t n) {
  const __m256i last = tail_mask(w - 8 * (NV - 1));
  thread_local std::vector<float> acc;
  acc.assign(n * NV * 8, 0.0f);
  for (int64_t s0 = 0; s0 < E; s0 += kValueTile) {
    const int64_t s1 = std::min(E, s0 + kValueTile);
    int64_t i = 0;
    // the first rows prefetch the next tile's values (measured: 10-20% off the attention)
    for (; i + 2 <= n; i += 2)
      weighted_tile<NV, 2, FULL>(p + i, v, s0, s1, Dh, last, acc.data() + i * NV * 8, i == 0 ? E : 0);
    if (i < n) weighted_tile<NV, 1, FULL>(p + i, v, s0, s1, Dh, last, acc.data() + i * NV * 8, i == 0 ? E : 0);
  }
  for (int64_t i = 0; i < n; ++i) {
    const __m256 sc = _mm256_set1_ps(scale[i]);
    for (int j = 0; j < NV; ++j) {
      const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(acc.data() + (i * NV + j) * 8), sc);
      if (FULL || j + 1 < NV) _mm256_storeu_ps(o[i] + 8 * j, y);
      else _mm256_maskstore_ps(o[i] + 8 * j, last, y);
    }
  }
}

// `weighted_rows` for columns [c0, c0 + w) of v and of each o[r], w <= 32.
void weighted_columns(const float* const* p, const float* v, int64_t E, int64_t Dh, int64_t c0, int64_t w,
                      const float* scale, float* const* o, int64_t n) {
  std::vector<float*> oc(o, o + n);
  for (auto& x : oc) x += c0;
  const bool full = w % 8 == 0;
  switch ((w + 7) / 8) {
    case 1: full ? weighted_rows<1, true>(p, v + c0, E, Dh, w, scale, oc.data(), n)
                 : weighted_rows<1, false>(p, v + c0, E, Dh, w, scale, oc.data(), n); break;
    case 2: full ? weighted_rows<2, true>(p, v + c0, E, Dh, w, scale, oc.data(), n)
                 : weighted_rows<2, false>(p, v + c0, E, Dh, w, scale, oc.data(), n); break;
    case 3: full ? weighted_rows<3, true>(p, v + c0, E, Dh, w, scale, oc.data(), n)
                 : weighted_rows<3, false>(p, v + c0, E, Dh, w, scale, oc.data(), n); break;
    default: full ? weighted_rows<4, true>(p, v + c0, E, Dh, w, scale, oc.data(), n)
                  : weighted_rows<4, false>(p, v + c0, E, Dh, w, scale, oc.data(), n); break;
  }
}

struct AttentionShape {
  int64_t B, T, H, KVH, S, Dh, layer;
  int64_t rows() const { return (H / KVH) * T; }  // query rows of one (row b, KV head) block
  int64_t visible(const int32_t* lengths, int64_t b) const {  // slots [0, E) of row b are read
    return std::min<int64_t>(S, std::max<int64_t>(0, int64_t(lengths[b]) + T));
  }
  const float* cache(const float* c, int64_t b, int64_t kvh) const {  // [S, Dh] of this layer
    return c + ((layer * B + b) * KVH + kvh) * S * Dh;
  }
};

// Slots per score chunk: the unit of work the threads share in the scores phase.
constexpr int64_t kSlotChunk = 128;

// Scores of block j = (b, kvh) against slots [s0, s1): scores[r, s] = qs[r] . k[s], each one
// dot product in a fixed order (`nt_rows`), whichever thread computes which slots.
void attention_scores(const AttentionShape& a, const float* qs, const float* kc, float* scores,
                      int64_t j, int64_t s0, int64_t s1) {
  const int64_t b = j / a.KVH, kvh = j % a.KVH, R = a.rows();
  nt_rows<F32W>(qs + j * R * a.Dh, a.cache(kc, b, kvh), scores + j * R * a.S, R, a.Dh, a.S, s0, s1);
}

// Query row r of block j = (b, kvh): the masked softmax of its scores over slots [0, E) (float32,
// exp by a polynomial), left unnormalised in place; returns 1 / their total. A row that sees no
// slot gets the mean of all S values, written to out here, and returns 0.
float attention_softmax(const AttentionShape& a, const float* vc, const bool* mask, float* scores, int64_t E,
                        float* out, int64_t j, int64_t r) {
  const int64_t b = j / a.KVH, kvh = j % a.KVH, g = a.H / a.KVH, Dh = a.Dh;
  const int64_t t = r / g, h = kvh * g + r % g;
  const float* v = a.cache(vc, b, kvh);
  float* o = out + (b * a.T + t) * a.H * Dh + h * Dh;
  float* sc = scores + (j * a.rows() + r) * a.S;
  const bool* m = mask + (b * a.T + t) * a.S;
  // pass 1: the largest visible score (vector max over 8 slots at a time)
  const __m256 lowest = _mm256_set1_ps(-INFINITY);
  __m256 top8 = lowest;
  const int64_t whole = E / 8 * 8;  // slots in whole groups of 8; the rest by masked loads
  for (int64_t s = 0; s < whole; s += 8)
    top8 = _mm256_max_ps(top8, _mm256_blendv_ps(lowest, _mm256_loadu_ps(sc + s), visible_lanes(m + s, 8)));
  const __m256i rest = tail_mask(E - whole);
  if (whole < E)
    top8 = _mm256_max_ps(top8, _mm256_blendv_ps(lowest, _mm256_maskload_ps(sc + whole, rest),
                                                visible_lanes(m + whole, E - whole)));
  __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(top8), _mm256_extractf128_ps(top8, 1));
  t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
  const float top = _mm_cvtss_f32(_mm_max_ss(t4, _mm_movehdup_ps(t4)));
  if (top == -INFINITY) {  // sees no slot: the mean of all S values
    const std::vector<float> ones(a.S, 1.0f);
    const float* p = ones.data();
    const float mean = 1.0f / float(a.S);
    for (int64_t c0 = 0; c0 < Dh; c0 += 32) weighted_columns(&p, v, a.S, Dh, c0, std::min<int64_t>(32, Dh - c0), &mean, &o, 1);
    return 0.0f;
  }
  // pass 2: p = e^(score - top) on visible slots, 0 elsewhere, in place; their total
  const __m256 tv = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  auto prob = [&](__m256 x, int64_t s, int64_t n) {  // e^(x - top) where visible, else 0
    x = _mm256_min_ps(_mm256_sub_ps(x, tv), _mm256_setzero_ps());
    return _mm256_and_ps(exp_nonpositive(x), visible_lanes(m + s, n));
  };
  for (int64_t s = 0; s < whole; s += 8) {
    const __m256 p = prob(_mm256_loadu_ps(sc + s), s, 8);
    _mm256_storeu_ps(sc + s, p);
    total = _mm256_add_ps(total, p);
  }
  if (whole < E) {
    const __m256 p = prob(_mm256_maskload_ps(sc + whole, rest), whole, E - whole);
    _mm256_maskstore_ps(sc + whole, rest, p);
    total = _mm256_add_ps(total, p);
  }
  return 1.0f / hsum(total);
}

// Three phases, each split between the threads in small pieces (a step's B x KVH blocks alone are
// too few: 3 on 2 threads at batch 1 left one thread idle a third of the time):
//   1. scores, in chunks of `kSlotChunk` slots of one block (the keys are read once);
//   2. per query row, its softmax;
//   3. weighted sums of the values, per block and 32 columns (the values are read once per
//      block from memory, and re-read from L1 for its rows: `weighted_rows`).
// Every score and every row's sums are computed in the same order whatever the split, so the
// result does not depend on the threads, and a query's result is the same at any T.
ffi::Error CacheAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                          ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> lengths, int64_t layer,
                          ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || md.size() != 3 || vd.size() != 5 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()))
    return ffi::Error::InvalidArgument("medusa_cache_attention: q [B, T, H, Dh], k = v [L, B, KVH, S, Dh], mask [B, T, S]");
  const AttentionShape a{qd[0], qd[1], qd[2], kd[2], kd[3], qd[3], layer};
  if (kd[1] != a.B || kd[4] != a.Dh || a.H % a.KVH || md[0] != a.B || md[1] != a.T || md[2] != a.S ||
      lengths.element_count() != size_t(a.B) || layer < 0 || layer >= kd[0] ||
      out->element_count() != size_t(a.B * a.T * a.H * a.Dh))
    return ffi::Error::InvalidArgument("medusa_cache_attention: shapes do not agree");
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const bool* mp = mask.typed_data();
  const int32_t* lp = lengths.typed_data();
  float* op = out->typed_data();
  const int64_t blocks = a.B * a.KVH, R = a.rows(), g = a.H / a.KVH, Dh = a.Dh;

  // The scaled queries, [blocks, R, Dh]: row r = t * g + i of block (b, kvh) is query head
  // kvh * g + i of token t; and room for every block's scores, [blocks, R, S].
  thread_local std::vector<float> qs, scores;
  qs.resize(blocks * R * Dh);
  scores.resize(blocks * R * a.S);
  const float inv_sqrt = 1.0f / std::sqrt(float(Dh));
  for (int64_t j = 0; j < blocks; ++j)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t b = j / a.KVH, kvh = j % a.KVH, t = r / g, i = r % g;
      const float* src = qp + ((b * a.T + t) * a.H + kvh * g + i) * Dh;
      float* dst = qs.data() + (j * R + r) * Dh;
      for (int64_t d = 0; d < Dh; ++d) dst[d] = src[d] * inv_sqrt;
    }

  // Phase 1: score chunks, numbered block by block.
  std::vector<int64_t> first(blocks + 1, 0);  // block j's chunks are [first[j], first[j + 1])
  for (int64_t j = 0; j < blocks; ++j)
    first[j + 1] = first[j] + (a.visible(lp, j / a.KVH) + kSlotChunk - 1) / kSlotChunk;
  // (the phases run on other threads too: they see these buffers through pointers, not by the
  // thread_local names, which name another buffer on each thread)
  const float* qsp = qs.data();
  float* sp = scores.data();
  auto score_chunks = [&](int64_t begin, int64_t end) {
    int64_t j = 0;
    for (int64_t c = begin; c < end; ++c) {
      while (c >= first[j + 1]) ++j;
      const int64_t E = a.visible(lp, j / a.KVH), s0 = (c - first[j]) * kSlotChunk;
      attention_scores(a, qsp, kp, sp, j, s0, std::min(E, s0 + kSlotChunk));
    }
  };
  // Phase 2: each row's softmax, rows numbered block by block.
  thread_local std::vector<float> scale;
  scale.resize(blocks * R);
  float* scp = scale.data();
  auto softmax_rows = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      scp[i] = attention_softmax(a, vp, mp, sp, a.visible(lp, i / R / a.KVH), op, i / R, i % R);
  };
  // Phase 3: weighted sums of the values, in units of one block's rows x 32 columns.
  const int64_t groups = (Dh + 31) / 32;
  auto value_units = [&](int64_t begin, int64_t end) {
    std::vector<const float*> ps;
    std::vector<float*> os;
    std::vector<float> scales;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t j = u / groups, b = j / a.KVH, kvh = j % a.KVH, c0 = (u % groups) * 32;
      ps.clear(), os.clear(), scales.clear();
      for (int64_t r = 0; r < R; ++r) {
        if (scp[j * R + r] == 0.0f) continue;  // saw no slot: done in phase 2
        const int64_t t = r / g, h = kvh * g + r % g;
        ps.push_back(sp + (j * R + r) * a.S);
        os.push_back(op + (b * a.T + t) * a.H * Dh + h * Dh);
        scales.push_back(scp[j * R + r]);
      }
      weighted_columns(ps.data(), a.cache(vp, b, kvh), a.visible(lp, b), Dh, c0, std::min<int64_t>(32, Dh - c0),
                       scales.data(), os.data(), int64_t(ps.size()));
    }
  };
  // Split between threads only when the step is worth the hand-offs.
  const int64_t work = a.T * g * a.S * Dh;
  Workers& workers = Workers::get();
  if (work < (int64_t{1} << 17) || workers.threads() == 1) {
    score_chunks(0, first[blocks]);
    softmax_rows(0, blocks * R);
    value_units(0, blocks * groups);
  } else {
    workers.run(first[blocks], 1, score_chunks);
    workers.run(blocks * R, 1, softmax_rows);
    workers.run(blocks * groups, 1, value_units);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(medusa_cache_attention, CacheAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("layer")
                                  .Ret<ffi::Buffer<ffi::F32>>());

namespace {

// ---------------------------------------------------------------------------------------------
// Greedy choice over the vocabulary: out[r] = the first index of the largest x[r, :], a NaN
// counting as the largest (the first NaN wins), exactly jnp.argmax's answer. XLA:CPU's argmax is a
// scalar loop over (value, index) pairs, ~1 ns an element: 0.4 ms for the 8 rows of an 8-node tree
// step over SmolLM2's 49,152 logits. Here one vector pass finds the maximum (and whether a NaN is
// present) and a second finds its first index.
int32_t argmax_row(const float* p, int64_t V) {
  __m256 m = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256 a = _mm256_loadu_ps(p + v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, a);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float best = lanes[0];
  for (int i = 1; i < 8; ++i) best = std::max(best, lanes[i]);
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (; v < V; ++v) {
    has_nan |= std::isnan(p[v]);
    best = std::max(best, p[v]);
  }
  if (has_nan) {
    for (int64_t i = 0; i < V; ++i)
      if (std::isnan(p[i])) return int32_t(i);
  }
  const __m256 b = _mm256_set1_ps(best);
  for (v = 0; v + 8 <= V; v += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + v), b, _CMP_EQ_OQ));
    if (mask) return int32_t(v + __builtin_ctz(unsigned(mask)));
  }
  for (; v < V; ++v)
    if (p[v] == best) return int32_t(v);
  return 0;  // V == 0 is refused by the caller; all -inf rows end above
}

ffi::Error ArgmaxRows(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || out->dimensions().size() != 1 || out->dimensions()[0] != xd[0] || xd[1] < 1)
    return ffi::Error::InvalidArgument("medusa_argmax_rows: x must be [R, V] with V >= 1 and out [R]");
  const float* xp = x.typed_data();
  int32_t* op = out->typed_data();
  for (int64_t r = 0; r < xd[0]; ++r) op[r] = argmax_row(xp + r * xd[1], xd[1]);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(medusa_argmax_rows, ArgmaxRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

// Read bandwidth of this machine in bytes/s: `threads` threads each sum their share of a
// `bytes`-long buffer, best of `repeats` passes (the roofline the kernels are measured against).
extern "C" double medusa_read_bandwidth(int64_t bytes, int32_t threads, int32_t repeats) {
  const int64_t n = bytes / sizeof(float) / 64 * 64;
  // on 2 MB pages where the OS gives them, as the decoding weights are (kernels.on_huge_pages)
  const size_t huge = size_t{2} << 20, len = (n * sizeof(float) + huge - 1) / huge * huge;
  void* mem = nullptr;
  if (posix_memalign(&mem, huge, len) != 0) return 0.0;
  madvise(mem, len, MADV_HUGEPAGE);
  float* buf = static_cast<float*>(mem);
  std::fill(buf, buf + n, 1.0f);
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
  free(mem);
  return best;
}
