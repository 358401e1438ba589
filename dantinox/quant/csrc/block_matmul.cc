// dantinox's block matrix product as an XLA FFI custom call (CPU): y [R, N] = x [R, M] . W^T for float32
// activations x and a weight matrix W [N, M] kept in one of ggml's block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
// IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS), each block dequantized right before its multiply, float32
// accumulation.
//
// Two algorithms, chosen by the caller (attribute `tiled`). The few-row loops (decode steps, verify calls, small
// batches): one pass over the weights serves up to MAX_ROWS activation rows. The tiled product (prefill, long
// chunks; block_gemm.inc): panels of weights dequantized once per task into float32 and multiplied with register
// tiles of many rows. In the few-row loops the output rows are cut into
// chunks that the calling thread and tasks on XLA's intra-op thread pool (ffi::ThreadPool) take from one
// atomic counter, so the call never waits for a task that has not started. The loops are compiled three
// times (AVX-512, AVX2 + FMA, and portable) and the CPU picks one at run time (__builtin_cpu_supports); the
// 32-value formats (Q8_0, Q4_0, Q4_1) have hand-vectorised AVX2 / AVX-512 loops that keep each block in
// registers (block_simd32.inc; on AVX-512 the 4-bit ones decode through a 16-entry table of weights,
// block_avx512.inc), the other formats the compiler-vectorised loops of block_formats.inc (one decode routine
// per format: a block into floats).
//
// The same extension holds decode attention (decode_attention.inc, decode_attention_simd.inc): one new token
// per row (or a few: a speculative verify call) attending over the filled slots of a float32 static cache, the
// slots of every KV head cut into ranges that the threads take as the block product's rows, partial softmaxes
// merged in a fixed order (so a row's result does not depend on the batch or the thread count).
//
// The same attention reads a paged pool through block tables (paged_attention: served prefill chunks and decode
// steps read only the blocks a row has filled, no gathered copy of the table's width).
//
// Prefill attention (prefill_attention.inc): a prompt's tokens over their own keys, blocked flash-attention style
// (no [T, T] score matrix, key blocks above the diagonal skipped), its tasks shared by the threads as above.
//
// And zeros whose pages the operating system provides (zero_pages.inc), for the KV pool and cache.
//
// The Python module _block_matmul exposes handler(), attention_handler(), prefill_attention_handler() and
// zero_pages_handler() (PyCapsules of the FFI handlers for jax.ffi.register_ffi_target) and isa() (the
// instruction set chosen on this CPU).

#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int MAX_ROWS = 16;
// Activation rows per pass over the weights on AVX-512 (block_simd32.inc, block_avx512.inc): a speculative verify
// call of 5 tokens reads each weight once. Zen 4, medians of 25, 2 threads: Q4_1 1,536 x 576 at 5 rows 85 us in
// one pass against 129 us in two (4 + 1); the Q8_0 head's cost grows about 0.45 ms per row either way.
#ifndef Q8_PASS_ROWS_AVX512
#define Q8_PASS_ROWS_AVX512 5
#endif
#ifndef Q4_PASS_ROWS_AVX512
#define Q4_PASS_ROWS_AVX512 6
#endif
static_assert(Q8_PASS_ROWS_AVX512 >= 1 && Q8_PASS_ROWS_AVX512 <= 8, "simd_rows_any has cases for 1..8 rows");
static_assert(Q4_PASS_ROWS_AVX512 >= 1 && Q4_PASS_ROWS_AVX512 <= 6, "dequantized_rows_any has cases for 1..6 rows");
// Panels of output channels per task and activation floats per row chunk of the many-row product.
constexpr int GEMM_PANELS = 2;
constexpr int64_t GEMM_CHUNK_FLOATS = 1 << 17;
#ifndef GEMM_KC
#define GEMM_KC 256   // input channels per slice of a panel (32 KiB of float32 at 32 output channels: L1)
#endif
enum Format { FORMAT_Q8_0 = 0, FORMAT_Q4_0 = 1, FORMAT_Q4_1 = 2, FORMAT_Q4_K = 3, FORMAT_Q5_K = 4, FORMAT_Q6_K = 5,
              FORMAT_Q5_0 = 6, FORMAT_Q5_1 = 7, FORMAT_Q2_K = 8, FORMAT_Q3_K = 9, FORMAT_IQ4_NL = 10, FORMAT_IQ4_XS = 11,
              FORMAT_LAST = FORMAT_IQ4_XS };
constexpr int64_t BLOCK_SIZE[] = {32, 32, 32, 256, 256, 256, 32, 32, 256, 256, 32, 256};
constexpr int64_t BLOCK_BYTES[] = {34, 18, 20, 144, 176, 210, 22, 24, 84, 110, 18, 136};
enum Isa { ISA_AUTO = 0, ISA_SCALAR = 1, ISA_AVX2 = 2, ISA_AVX512 = 3 };

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// IEEE half -> float, exact (subnormals, infinities and NaN included).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    int e = -1;
    do {
      mant <<= 1;
      ++e;
    } while ((mant & 0x400) == 0);
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The operands of a prefill attention call (prefill_attention.inc): q, y [B, T, K, G, D], the keys kt as panels
// [B, K, ceil(T / 32), D, 32], v [B, T, K, D], lo, hi [B, T].
struct PrefillArgs {
  const float *q, *kt, *v;
  const int32_t *lo, *hi;
  float* y;
  int64_t B, K, G, T, D;
};

}  // namespace

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DANTINOX_X86 1
#endif

namespace scalar {
#include "block_formats.inc"
#include "decode_attention.inc"
// Portable vectors for block_gemm.inc: four floats in plain loops (the compiler may vectorise them).
struct VEC {
  float f[4];
};
constexpr int VEC_LANES = 4;
inline VEC vzero() { return VEC{{0.f, 0.f, 0.f, 0.f}}; }
inline VEC vset1(float v) { return VEC{{v, v, v, v}}; }
inline VEC vload(const float* p) { return VEC{{p[0], p[1], p[2], p[3]}}; }
inline void vstore(float* p, VEC v) {
  for (int i = 0; i < 4; ++i) p[i] = v.f[i];
}
inline VEC vfma(VEC a, VEC b, VEC c) {
  for (int i = 0; i < 4; ++i) c.f[i] += a.f[i] * b.f[i];
  return c;
}
inline VEC vadd(VEC a, VEC b) {
  for (int i = 0; i < 4; ++i) a.f[i] += b.f[i];
  return a;
}
inline VEC vsub(VEC a, VEC b) {
  for (int i = 0; i < 4; ++i) a.f[i] -= b.f[i];
  return a;
}
inline VEC vmul(VEC a, VEC b) {
  for (int i = 0; i < 4; ++i) a.f[i] *= b.f[i];
  return a;
}
inline VEC vmax(VEC a, VEC b) {
  for (int i = 0; i < 4; ++i) a.f[i] = a.f[i] > b.f[i] ? a.f[i] : b.f[i];
  return a;
}
inline float vsum(VEC v) { return (v.f[0] + v.f[2]) + (v.f[1] + v.f[3]); }
inline float vmax_all(VEC v) { return std::max(std::max(v.f[0], v.f[1]), std::max(v.f[2], v.f[3])); }
inline VEC vexp_nonpositive(VEC x) {
  for (int i = 0; i < 4; ++i) x.f[i] = std::exp(x.f[i]);
  return x;
}
// dst [4, 4] (row stride ldd) = src [4, 4]^T (row stride lds)
inline void vtranspose(const float* src, int64_t lds, float* dst, int64_t ldd) {
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) dst[i * ldd + j] = src[j * lds + i];
}
template <class F>
inline void decode_block(const uint8_t* b, float* w) {
  F::decode(b, w);
}
constexpr int GEMM_NV = 2, GEMM_MR = 4;
#include "block_gemm.inc"
#include "prefill_attention.inc"
static void run_rows(int format, const uint8_t* W, int64_t row_bytes, int64_t M, const float* x, int B, float* y,
                     int64_t N, int64_t r0, int64_t r1, float* w) {
  generic_rows(format, W, row_bytes, M, x, B, y, N, r0, r1, w);
}
}  // namespace scalar

#ifdef DANTINOX_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace avx2 {
#include "block_formats.inc"
#include "decode_attention.inc"
using VEC = __m256;
constexpr int VEC_LANES = 8;
inline VEC vzero() { return _mm256_setzero_ps(); }
inline VEC vset1(float v) { return _mm256_set1_ps(v); }
inline VEC vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, VEC v) { _mm256_storeu_ps(p, v); }
// exp(x) for x <= 0 (a softmax's shifted scores), within 2 ulp of expf; x below -87.3 gives 0. Cody-Waite
// reduction x = n ln 2 + r and Cephes' degree-6 polynomial for exp(r) (S. L. Moshier, "Methods and Programs for
// Mathematical Functions", 1989), scaled by 2^n through the exponent bits.
inline VEC vexp_nonpositive(VEC x) {
  const VEC floor = _mm256_set1_ps(-87.33654f);
  const VEC tiny = _mm256_cmp_ps(x, floor, _CMP_LT_OQ);
  x = _mm256_max_ps(x, floor);
  const VEC n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  VEC r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  VEC p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(scale)));
}
inline VEC vmul(VEC a, VEC b) { return _mm256_mul_ps(a, b); }
inline VEC vadd(VEC a, VEC b) { return _mm256_add_ps(a, b); }
inline VEC vsub(VEC a, VEC b) { return _mm256_sub_ps(a, b); }
inline VEC vfma(VEC a, VEC b, VEC c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(VEC v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// 32 int8 -> 4 x 8 floats
inline void load_q8(const uint8_t* p, VEC* q) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
  q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
  q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}
// 16 bytes of nibbles -> 4 x 8 floats (low nibbles are values 0..15, high nibbles 16..31), minus `offset`
inline void load_q4(const uint8_t* p, VEC* q, int offset) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  const __m256i off = _mm256_set1_epi32(offset);
  q[0] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(lo), off));
  q[1] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)), off));
  q[2] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(hi), off));
  q[3] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)), off));
}
#include "block_simd32.inc"
#include "decode_attention_simd.inc"
// dst [8, 8] (row stride ldd) = src [8, 8]^T (row stride lds): pairs of rows interleaved by 32 then 64 bits, then
// the 128-bit halves exchanged.
inline void vtranspose(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8], a[8], b[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int j = 0; j < 2; ++j) {  // b[4 j + c], 128-bit lane l: column 4 l + c of rows 4 j .. 4 j + 3
    const __m256d a0 = _mm256_castps_pd(a[4 * j]), a1 = _mm256_castps_pd(a[4 * j + 1]);
    const __m256d a2 = _mm256_castps_pd(a[4 * j + 2]), a3 = _mm256_castps_pd(a[4 * j + 3]);
    b[4 * j] = _mm256_castpd_ps(_mm256_unpacklo_pd(a0, a2));
    b[4 * j + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a0, a2));
    b[4 * j + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(a1, a3));
    b[4 * j + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(a1, a3));
  }
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(dst + c * ldd, _mm256_permute2f128_ps(b[c], b[4 + c], 0x20));
    _mm256_storeu_ps(dst + (4 + c) * ldd, _mm256_permute2f128_ps(b[c], b[4 + c], 0x31));
  }
}
template <class F>
inline void decode_block(const uint8_t* b, float* w) {
  F::decode(b, w);
}
constexpr int GEMM_NV = 2, GEMM_MR = 6;  // 12 accumulators of the 16 registers
#include "block_gemm.inc"
inline VEC vmax(VEC a, VEC b) { return _mm256_max_ps(a, b); }
inline float vmax_all(VEC v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
#include "prefill_attention.inc"
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512")
#endif
namespace avx512 {
#include "block_formats.inc"
#include "decode_attention.inc"
using VEC = __m512;
constexpr int VEC_LANES = 16;
inline VEC vzero() { return _mm512_setzero_ps(); }
inline VEC vset1(float v) { return _mm512_set1_ps(v); }
inline VEC vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, VEC v) { _mm512_storeu_ps(p, v); }
// exp(x) for x <= 0, as the avx2 one; 2^n by vscalefps.
inline VEC vexp_nonpositive(VEC x) {
  const VEC floor = _mm512_set1_ps(-87.33654f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, floor, _CMP_LT_OQ);
  x = _mm512_max_ps(x, floor);
  const VEC n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  VEC r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  VEC p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}
inline VEC vmul(VEC a, VEC b) { return _mm512_mul_ps(a, b); }
inline VEC vadd(VEC a, VEC b) { return _mm512_add_ps(a, b); }
inline VEC vsub(VEC a, VEC b) { return _mm512_sub_ps(a, b); }
inline VEC vfma(VEC a, VEC b, VEC c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(VEC v) { return _mm512_reduce_add_ps(v); }
// 32 int8 -> 2 x 16 floats
inline void load_q8(const uint8_t* p, VEC* q) {
  q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  q[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
}
// 16 bytes of nibbles -> 2 x 16 floats (low nibbles are values 0..15, high nibbles 16..31), minus `offset`
inline void load_q4(const uint8_t* p, VEC* q, int offset) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m512i off = _mm512_set1_epi32(offset);
  q[0] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask)), off));
  q[1] = _mm512_cvtepi32_ps(
      _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask)), off));
}
#include "block_simd32.inc"
#include "block_avx512.inc"
#include "decode_attention_simd.inc"
// dst [16, 16] (row stride ldd) = src [16, 16]^T (row stride lds): pairs of rows interleaved by 32 then 64 bits,
// then the 128-bit lanes of four vectors transposed as a 4 x 4 matrix.
inline void vtranspose(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m512 r[16], a[16], b[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int j = 0; j < 4; ++j) {  // b[4 j + c], 128-bit lane l: column 4 l + c of rows 4 j .. 4 j + 3
    const __m512d a0 = _mm512_castps_pd(a[4 * j]), a1 = _mm512_castps_pd(a[4 * j + 1]);
    const __m512d a2 = _mm512_castps_pd(a[4 * j + 2]), a3 = _mm512_castps_pd(a[4 * j + 3]);
    b[4 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, a2));
    b[4 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, a2));
    b[4 * j + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, a3));
    b[4 * j + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, a3));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 t0 = _mm512_shuffle_f32x4(b[c], b[4 + c], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 t1 = _mm512_shuffle_f32x4(b[c], b[4 + c], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512 t2 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 t3 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], _MM_SHUFFLE(3, 2, 3, 2));
    _mm512_storeu_ps(dst + c * ldd, _mm512_shuffle_f32x4(t0, t2, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_storeu_ps(dst + (4 + c) * ldd, _mm512_shuffle_f32x4(t0, t2, _MM_SHUFFLE(3, 1, 3, 1)));
    _mm512_storeu_ps(dst + (8 + c) * ldd, _mm512_shuffle_f32x4(t1, t3, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_storeu_ps(dst + (12 + c) * ldd, _mm512_shuffle_f32x4(t1, t3, _MM_SHUFFLE(3, 1, 3, 1)));
  }
}
// One block dequantized into w for block_gemm.inc's panels: the 4-bit 32-value formats through
// block_avx512.inc's table (the same float32 values as their decode), the others through their decode.
template <class F>
inline void decode_block(const uint8_t* b, float* w) {
  if constexpr (std::is_same_v<F, Q4_0> || std::is_same_v<F, Q4_1>) {
    __m512 v[2];
    dequantize32<std::is_same_v<F, Q4_0> ? FORMAT_Q4_0 : FORMAT_Q4_1>(b, v);
    _mm512_storeu_ps(w, v[0]);
    _mm512_storeu_ps(w + 16, v[1]);
  } else {
    F::decode(b, w);
  }
}
#ifndef GEMM_MR_AVX512
#define GEMM_MR_AVX512 12
#endif
constexpr int GEMM_NV = 2, GEMM_MR = GEMM_MR_AVX512;  // 24 accumulators of the 32 registers
#include "block_gemm.inc"
inline VEC vmax(VEC a, VEC b) { return _mm512_max_ps(a, b); }
inline float vmax_all(VEC v) { return _mm512_reduce_max_ps(v); }
#include "prefill_attention.inc"
}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

namespace {

// CPUs this process may run on (its affinity mask on Linux), at least 1.
int64_t usable_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set) > 0 ? CPU_COUNT(&set) : 1;
#endif
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? n : 1;
}

int detected_isa() {
#ifdef DANTINOX_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return ISA_AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return ISA_AVX2;
#endif
  return ISA_SCALAR;
}

using RowsFn = void (*)(int, const uint8_t*, int64_t, int64_t, const float*, int, float*, int64_t, int64_t,
                        int64_t, float*);

RowsFn rows_for(int isa) {
#ifdef DANTINOX_X86
  if (isa == ISA_AVX512) return avx512::run_rows_avx512;
  if (isa == ISA_AVX2) return avx2::run_rows;
#endif
  return scalar::run_rows;
}

struct Job {
  RowsFn fn;
  int format;
  const uint8_t* w;
  int64_t row_bytes, M, N;
  const float* x;
  float* y;
  int64_t R, chunk, chunks;
  std::atomic<int64_t> next{0}, done{0};

  // Take chunks until none is left; a chunk covers `chunk` output rows for every group of MAX_ROWS inputs.
  void work() {
    std::vector<float> row(static_cast<size_t>(M));  // one dequantized weight row
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      const int64_t r0 = c * chunk, r1 = r0 + chunk < N ? r0 + chunk : N;
      for (int64_t b0 = 0; b0 < R; b0 += MAX_ROWS) {
        const int B = static_cast<int>(R - b0 < MAX_ROWS ? R - b0 : MAX_ROWS);
        fn(format, w, row_bytes, M, x + b0 * M, B, y + b0 * N, N, r0, r1, row.data());
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

using GemmFn = void (*)(int, const uint8_t*, int64_t, int64_t, int64_t, const float*, float*, int64_t, int64_t,
                        int64_t, int64_t, float*, float*, float*, bool);

GemmFn gemm_for(int isa, int* channels) {
#ifdef DANTINOX_X86
  if (isa == ISA_AVX512) return *channels = avx512::GEMM_NR, avx512::gemm_task;
  if (isa == ISA_AVX2) return *channels = avx2::GEMM_NR, avx2::gemm_task;
#endif
  return *channels = scalar::GEMM_NR, scalar::gemm_task;
}

// The many-row product's tasks (block_gemm.inc): task t covers output channels [g group, (g + 1) group) and
// activation rows [c rows, (c + 1) rows) with g = t / chunks, c = t % chunks, so consecutive tasks share a group
// and a thread that takes two of them in a row dequantizes the group once.
struct GemmJob {
  GemmFn fn;
  int format, channels;
  const uint8_t* w;
  int64_t row_bytes, M, N, R;
  const float* x;
  float* y;
  int64_t group, rows, chunks, tasks;
  std::atomic<int64_t> next{0}, done{0};

  void work() {
    int64_t t = next.fetch_add(1);
    if (t >= tasks) return;   // a helper that started late: nothing to allocate
    std::vector<float> panels(static_cast<size_t>(GEMM_PANELS * M * channels));
    std::vector<float> tmp(static_cast<size_t>(channels * 256));   // one block of each panel row
    std::vector<float> narrow(static_cast<size_t>(rows * channels));  // a narrow panel's outputs
    int64_t packed = -1;
    for (; t < tasks; t = next.fetch_add(1)) {
      const int64_t g = t / chunks, c = t % chunks;
      const int64_t n0 = g * group, n1 = n0 + group < N ? n0 + group : N;
      const int64_t r0 = c * rows, r1 = r0 + rows < R ? r0 + rows : R;
      fn(format, w, row_bytes, M, N, x, y, n0, n1, r0, r1, panels.data(), tmp.data(), narrow.data(), packed != g);
      packed = g;
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

using AttendFn = void (*)(const float*, int64_t, const int64_t*, int64_t, const float*, const float*, int64_t,
                          float*, float*, float*, float*);

AttendFn attend_for(int isa) {
#ifdef DANTINOX_X86
  if (isa == ISA_AVX512) return avx512::attend_slots_simd;
  if (isa == ISA_AVX2) return avx2::attend_slots_simd;
#endif
  return scalar::attend_slots;
}

constexpr int64_t ATTENTION_RANGE = 128;  // cached slots per task of decode attention

// Decode attention's tasks. The new tokens t0 <= t < t1 of one row and KV head (kv = b * K + kv head) that share
// their first visible slot lo form a run; task i covers the run's slots [s0[i], s0[i] + ATTENTION_RANGE) (cut
// at each token's hi) for the run's (t1 - t0) * G queries, and leaves their partial softmaxes (m, l [Q],
// acc [Q, D]) in partial + offset[i].
struct AttentionJob {
  AttendFn fn;
  const float *q, *k, *v;
  const int32_t* hi;  // [B, T]
  int64_t K, T, G, L, D;
  // A paged pool instead of a cache (paged_attention): k, v [N, P, K, D], row b's slot s in block
  // table[b * M + s / P] at offset s % P; each task's rows are copied into a contiguous scratch first.
  const int32_t* table = nullptr;
  int64_t M = 0, P = 1;
  std::vector<int64_t> kv, t0, t1, s0, offset;
  std::vector<float> partial;
  std::atomic<int64_t> next{0}, done{0};

  // count[g] for the run's queries: the slots of task i that token t0 + g / G sees.
  void counts(int64_t i, int64_t* count) const {
    const int64_t b = kv[i] / K;
    for (int64_t t = t0[i]; t < t1[i]; ++t) {
      const int64_t top = hi[b * T + t] < L ? hi[b * T + t] : L;
      int64_t c = top - s0[i];
      c = c < 0 ? 0 : c > ATTENTION_RANGE ? ATTENTION_RANGE : c;
      for (int64_t g = 0; g < G; ++g) count[(t - t0[i]) * G + g] = c;
    }
  }

  // The first n rows of task i's keys and values from the pool, laid end to end in kbuf, vbuf [n, D].
  void gather(int64_t i, int64_t n, float* kbuf, float* vbuf) const {
    const int64_t b = kv[i] / K, head = kv[i] % K;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t s = s0[i] + r, block = table[b * M + s / P];
      const int64_t at = ((block * P + s % P) * K + head) * D;
      std::memcpy(kbuf + r * D, k + at, static_cast<size_t>(D) * sizeof(float));
      std::memcpy(vbuf + r * D, v + at, static_cast<size_t>(D) * sizeof(float));
    }
  }

  void work() {
    std::vector<float> scores(static_cast<size_t>(T * G * ATTENTION_RANGE));
    std::vector<int64_t> count(static_cast<size_t>(T * G));
    std::vector<float> kbuf(table ? static_cast<size_t>(ATTENTION_RANGE * D) : 0), vbuf(kbuf.size());
    const int64_t tasks = static_cast<int64_t>(kv.size());
    for (int64_t i = next.fetch_add(1); i < tasks; i = next.fetch_add(1)) {
      const int64_t Q = (t1[i] - t0[i]) * G;
      float* m = partial.data() + offset[i];
      counts(i, count.data());
      const float* qi = q + (kv[i] * T + t0[i]) * G * D;
      if (table) {
        int64_t n = 0;
        for (int64_t g = 0; g < Q; ++g) n = count[g] > n ? count[g] : n;
        gather(i, n, kbuf.data(), vbuf.data());
        fn(qi, Q, count.data(), D, kbuf.data(), vbuf.data(), 0, scores.data(), m, m + Q, m + 2 * Q);
      } else {
        fn(qi, Q, count.data(), D, k + kv[i] * L * D, v + kv[i] * L * D, s0[i], scores.data(), m, m + Q,
           m + 2 * Q);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// out [G, D] for new token t of KV head kv: the softmax over the token itself (score q . k_new, value v_new) and
// then the tasks first..last of its run in slot order, skipping the ranges it does not see: m = max(m1, m2),
// l = l1 e^(m1 - m) + l2 e^(m2 - m), acc likewise, out = acc / l. The same merges as a decode step of the token.
void merge_token(const AttentionJob& job, int64_t first, int64_t last, int64_t b, int64_t t, const float* q,
                 const float* k_new, const float* v_new, float* out) {
  const int64_t G = job.G, D = job.D;
  for (int64_t g = 0; g < G; ++g) {
    float m = scalar::attention_dot(q + g * D, k_new, D), l = 1.f;
    float* acc = out + g * D;
    for (int64_t d = 0; d < D; ++d) acc[d] = v_new[d];
    for (int64_t i = first; i < last; ++i) {
      if (job.s0[i] >= job.hi[b * job.T + t]) break;  // this token sees no slot of this range or later ones
      const int64_t Q = (job.t1[i] - job.t0[i]) * G, j = (t - job.t0[i]) * G + g;
      const float* part = job.partial.data() + job.offset[i];
      const float mt = part[j], lt = part[Q + j], *at = part + 2 * Q + j * D;
      const float top = mt > m ? mt : m, a = std::exp(m - top), c = std::exp(mt - top);
      l = l * a + lt * c;
      for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] * a + at[d] * c;
      m = top;
    }
    for (int64_t d = 0; d < D; ++d) acc[d] /= l;
  }
}

// q, y [B, K, T, G, D]: T new tokens per row, G query heads per KV head; k, v [B, K, L, D] the cache (the new
// tokens' own slots may be written already: a token never reads them, see hi); k_new, v_new [B, K, T, D];
// lo, hi [B, T]: new token t of row b sees cached slots [lo, hi) and then itself. A verify call (T > 1) passes
// the cache with its new tokens written and hi = cache_index + t, so token t reads the same slots, cut into the
// same ranges and merged in the same order as a decode step at that slot: the same float32 result. Tokens of a
// row with the same lo share their tasks, so each key row is read once for all of them.
// Build the tasks of ``job`` (its q, k, v, hi, K, T, G, L, D set), run them on the calling thread and XLA's pool,
// and merge each new token's ranges and itself into y. B rows; lo, hi [B, T]; k_new, v_new [B, K, T, D].
void run_attention(std::shared_ptr<AttentionJob> job, ffi::ThreadPool& pool, int64_t B, const int32_t* lo,
                   const int32_t* hi, const float* q, const float* k_new, const float* v_new, float* y) {
  const int64_t K = job->K, T = job->T, G = job->G, L = job->L, D = job->D;
  std::vector<int64_t> first(B * K * T + 1, 0), last(B * K * T, 0);  // each token's tasks: [first, last)
  int64_t size = 0;
  for (int64_t kv = 0; kv < B * K; ++kv) {
    const int32_t* lo_row = lo + (kv / K) * T;
    const int32_t* hi_row = hi + (kv / K) * T;
    for (int64_t t0 = 0, t1; t0 < T; t0 = t1) {
      int64_t top = 0;
      for (t1 = t0; t1 < T && lo_row[t1] == lo_row[t0]; ++t1) top = hi_row[t1] > top ? hi_row[t1] : top;
      top = top < L ? top : L;
      const int64_t bottom = lo_row[t0] > 0 ? lo_row[t0] : 0, begin = static_cast<int64_t>(job->kv.size());
      for (int64_t s = bottom; s < top; s += ATTENTION_RANGE) {
        job->kv.push_back(kv);
        job->t0.push_back(t0);
        job->t1.push_back(t1);
        job->s0.push_back(s);
        job->offset.push_back(size);
        size += (t1 - t0) * G * (D + 2);
      }
      for (int64_t t = t0; t < t1; ++t) {
        first[kv * T + t] = begin;
        last[kv * T + t] = static_cast<int64_t>(job->kv.size());
      }
    }
  }
  const int64_t tasks = static_cast<int64_t>(job->kv.size());
  job->partial.resize(static_cast<size_t>(size));
  static const int64_t cpus = usable_cpus();
  const int64_t threads = pool.num_threads() > cpus ? pool.num_threads() : cpus;
  const int64_t helpers = threads - 1 < tasks - 1 ? threads - 1 : tasks - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < tasks) std::this_thread::yield();
  for (int64_t e = 0; e < B * K * T; ++e)
    merge_token(*job, first[e], last[e], e / (K * T), e % T, q + e * G * D, k_new + e * D, v_new + e * D,
                y + e * G * D);
}

// q, y [B, K, T, G, D]: T new tokens per row, G query heads per KV head; k, v [B, K, L, D] the cache (the new
// tokens' own slots may be written already: a token never reads them, see hi); k_new, v_new [B, K, T, D];
// lo, hi [B, T]: new token t of row b sees cached slots [lo, hi) and then itself. A verify call (T > 1) passes
// the cache with its new tokens written and hi = cache_index + t, so token t reads the same slots, cut into the
// same ranges and merged in the same order as a decode step at that slot: the same float32 result. Tokens of a
// row with the same lo share their tasks, so each key row is read once for all of them.
ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                               ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                               ffi::Buffer<ffi::S32> lo, ffi::Buffer<ffi::S32> hi, ffi::ResultBuffer<ffi::F32> y,
                               int64_t isa) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), yd = y->dimensions();
  if (qd.size() != 5 || kd.size() != 4 || vd.size() != 4 || yd.size() != 5 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()) || !std::equal(qd.begin(), qd.end(), yd.begin()))
    return ffi::Error::InvalidArgument("decode_attention expects q, y [B, K, T, G, D] and k, v [B, K, L, D]");
  const int64_t B = qd[0], K = qd[1], T = qd[2], G = qd[3], D = qd[4], L = kd[2];
  if (kd[0] != B || kd[1] != K || kd[3] != D || k_new.element_count() != B * K * T * D ||
      v_new.element_count() != B * K * T * D || lo.element_count() != B * T || hi.element_count() != B * T)
    return ffi::Error::InvalidArgument("decode_attention: shapes of q, k, v, the new rows and the bounds disagree");
  if (B * K * T * G * D == 0) return ffi::Error::Success();
  auto job = std::make_shared<AttentionJob>();
  job->fn = attend_for(isa == ISA_AUTO ? detected_isa() : static_cast<int>(isa));
  job->q = q.typed_data();
  job->k = k.typed_data();
  job->v = v.typed_data();
  job->hi = hi.typed_data();
  job->K = K;
  job->T = T;
  job->G = G;
  job->L = L;
  job->D = D;
  run_attention(job, pool, B, lo.typed_data(), hi.typed_data(), q.typed_data(), k_new.typed_data(),
                v_new.typed_data(), y->typed_data());
  return ffi::Error::Success();
}

// The same attention over a paged pool: k, v [N, P, K, D] (block, offset, KV head), table [B, M] int32 the rows'
// block tables (slot s of row b at block table[b, s / P], offset s % P), L = M P. Ranges of ATTENTION_RANGE slots
// are copied out of the pool into a contiguous scratch and attended exactly as decode_attention attends a static
// cache's, so a row's result equals decode_attention's over the same keys and values.
ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                              ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::F32> k_new,
                              ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::S32> lo, ffi::Buffer<ffi::S32> hi,
                              ffi::ResultBuffer<ffi::F32> y, int64_t isa) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), td = table.dimensions(), yd = y->dimensions();
  if (qd.size() != 5 || kd.size() != 4 || vd.size() != 4 || td.size() != 2 || yd.size() != 5 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()) || !std::equal(qd.begin(), qd.end(), yd.begin()))
    return ffi::Error::InvalidArgument("paged_attention expects q, y [B, K, T, G, D], k, v [N, P, K, D] and a "
                                       "table [B, M]");
  const int64_t B = qd[0], K = qd[1], T = qd[2], G = qd[3], D = qd[4], N = kd[0], P = kd[1], M = td[1];
  if (kd[2] != K || kd[3] != D || td[0] != B || k_new.element_count() != B * K * T * D ||
      v_new.element_count() != B * K * T * D || lo.element_count() != B * T || hi.element_count() != B * T)
    return ffi::Error::InvalidArgument("paged_attention: shapes of q, the pool, the table, the new rows and the "
                                       "bounds disagree");
  if (B * K * T * G * D == 0) return ffi::Error::Success();
  const int32_t* t = table.typed_data();
  for (int64_t i = 0; i < B * M; ++i)
    if (t[i] < 0 || t[i] >= N) return ffi::Error::InvalidArgument("paged_attention: a block id outside [0, N)");
  auto job = std::make_shared<AttentionJob>();
  job->fn = attend_for(isa == ISA_AUTO ? detected_isa() : static_cast<int>(isa));
  job->q = q.typed_data();
  job->k = k.typed_data();
  job->v = v.typed_data();
  job->hi = hi.typed_data();
  job->table = t;
  job->M = M;
  job->P = P;
  job->K = K;
  job->T = T;
  job->G = G;
  job->L = M * P;
  job->D = D;
  run_attention(job, pool, B, lo.typed_data(), hi.typed_data(), q.typed_data(), k_new.typed_data(),
                v_new.typed_data(), y->typed_data());
  return ffi::Error::Success();
}

// y [R, N] = x [R, M] . W^T through block_gemm.inc's tiles, the tasks shared by `threads` threads.
void gemm(ffi::ThreadPool& pool, int64_t threads, int isa, int format, const float* x, const uint8_t* w,
          int64_t row_bytes, float* y, int64_t R, int64_t M, int64_t N) {
  auto job = std::make_shared<GemmJob>();
  job->fn = gemm_for(isa, &job->channels);
  job->format = format;
  job->w = w;
  job->row_bytes = row_bytes;
  job->M = M;
  job->N = N;
  job->R = R;
  job->x = x;
  job->y = y;
  int64_t rows = GEMM_CHUNK_FLOATS / M / 12 * 12;   // a multiple of every instruction set's tile height
  job->rows = rows < 12 ? 12 : rows;
  job->chunks = (R + job->rows - 1) / job->rows;
  // GEMM_PANELS panels per task (each chunk of x read once for both), one where that leaves under 4 tasks per
  // thread (k and v of SmolLM2 at 128 rows: 6 panels; 3 tasks would split 2 : 1 over two threads).
  const int64_t panels = (N + job->channels - 1) / job->channels;
  job->group = (panels + GEMM_PANELS - 1) / GEMM_PANELS * job->chunks >= 4 * threads ? GEMM_PANELS * job->channels
                                                                                     : job->channels;
  job->tasks = (N + job->group - 1) / job->group * job->chunks;
  const int64_t helpers = threads - 1 < job->tasks - 1 ? threads - 1 : job->tasks - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < job->tasks) std::this_thread::yield();
}

using PrefillWorkFn = void (*)(const PrefillArgs&, std::atomic<int64_t>&, std::atomic<int64_t>&);

PrefillWorkFn prefill_for(int isa) {
#ifdef DANTINOX_X86
  if (isa == ISA_AVX512) return avx512::prefill_attention_work;
  if (isa == ISA_AVX2) return avx2::prefill_attention_work;
#endif
  return scalar::prefill_attention_work;
}

struct PrefillJob {
  PrefillArgs args;
  PrefillWorkFn fn;
  std::atomic<int64_t> next{0}, done{0};
};

// Causal prefill attention (prefill_attention.inc): q, y [B, T, K, G, D], kt [B, K, ceil(T / 32), D, 32] (the keys
// in panels of 32, zeros past T), v [B, T, K, D], lo, hi [B, T] (token t of row b sees keys [lo, hi)); D a
// multiple of 32 (every instruction set's panel width).
ffi::Error PrefillAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kt,
                                ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lo, ffi::Buffer<ffi::S32> hi,
                                ffi::ResultBuffer<ffi::F32> y, int64_t isa) {
  auto qd = q.dimensions(), kd = kt.dimensions(), vd = v.dimensions(), yd = y->dimensions();
  if (qd.size() != 5 || kd.size() != 5 || vd.size() != 4 || yd.size() != 5 ||
      !std::equal(qd.begin(), qd.end(), yd.begin()))
    return ffi::Error::InvalidArgument(
        "prefill_attention expects q, y [B, T, K, G, D], kt [B, K, T / 32, D, 32] and v [B, T, K, D]");
  const int64_t B = qd[0], T = qd[1], K = qd[2], G = qd[3], D = qd[4];
  if (kd[0] != B || kd[1] != K || kd[2] != (T + 31) / 32 || kd[3] != D || kd[4] != 32 || vd[0] != B ||
      vd[1] != T || vd[2] != K || vd[3] != D || lo.element_count() != B * T || hi.element_count() != B * T)
    return ffi::Error::InvalidArgument("prefill_attention: shapes of q, kt, v and the bounds disagree");
  if (D % 32 != 0) return ffi::Error::InvalidArgument("prefill_attention: the head size must be a multiple of 32");
  if (B * K * G * T * D == 0) return ffi::Error::Success();
  auto job = std::make_shared<PrefillJob>();
  job->args = PrefillArgs{q.typed_data(), kt.typed_data(), v.typed_data(), lo.typed_data(), hi.typed_data(),
                          y->typed_data(), B, K, G, T, D};
  job->fn = prefill_for(isa == ISA_AUTO ? detected_isa() : static_cast<int>(isa));
  const int64_t tasks = B * K * ((T + 31) / 32);   // PA_BQ = 32 in every instruction set
  static const int64_t cpus = usable_cpus();
  const int64_t threads = pool.num_threads() > cpus ? pool.num_threads() : cpus;
  const int64_t helpers = threads - 1 < tasks - 1 ? threads - 1 : tasks - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->fn(job->args, job->next, job->done); });
  job->fn(job->args, job->next, job->done);
  while (job->done.load(std::memory_order_acquire) < tasks) std::this_thread::yield();
  return ffi::Error::Success();
}

// tiled: 1 for the many-row product of block_gemm.inc (prefill), 0 for the few-row loops (decode, verify calls).
ffi::Error BlockMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                           ffi::ResultBuffer<ffi::F32> y, int64_t format, int64_t isa, int64_t tiled) {
  if (format < 0 || format > FORMAT_LAST) return ffi::Error::InvalidArgument("unknown block format code");
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("block_matmul expects x [R, M], blocks [N, row bytes], y [R, N]");
  const int64_t R = xd[0], M = xd[1], N = wd[0];
  if (M % BLOCK_SIZE[format] != 0 || wd[1] != M / BLOCK_SIZE[format] * BLOCK_BYTES[format] || yd[0] != R ||
      yd[1] != N)
    return ffi::Error::InvalidArgument("block_matmul: shapes of x, blocks and y disagree with the format");
  if (R == 0 || N == 0) return ffi::Error::Success();
  const int chosen = isa == ISA_AUTO ? detected_isa() : static_cast<int>(isa);
  // The pool reports num_threads() = 1 on a 2-CPU host, yet a task scheduled on it runs on another thread: so
  // the call splits the rows for as many threads as the process has CPUs. A task that starts late finds no
  // chunk left and returns; the caller never waits for a task, only for the chunks.
  static const int64_t cpus = usable_cpus();
  const int64_t threads = pool.num_threads() > cpus ? pool.num_threads() : cpus;
  if (tiled) {
    gemm(pool, threads, chosen, static_cast<int>(format), x.typed_data(), w.typed_data(), wd[1], y->typed_data(),
         R, M, N);
    return ffi::Error::Success();
  }
  auto job = std::make_shared<Job>();
  job->fn = rows_for(chosen);
  job->format = static_cast<int>(format);
  job->w = w.typed_data();
  job->row_bytes = wd[1];
  job->M = M;
  job->N = N;
  job->x = x.typed_data();
  job->y = y->typed_data();
  job->R = R;
  const int64_t parts = threads * 4;
  job->chunk = (N + parts - 1) / parts < 8 ? 8 : (N + parts - 1) / parts;
  job->chunks = (N + job->chunk - 1) / job->chunk;
  const int64_t helpers = threads - 1 < job->chunks - 1 ? threads - 1 : job->chunks - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < job->chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DantinoxBlockMatmul, BlockMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("format")
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("tiled"));

#include "zero_pages.inc"

XLA_FFI_DEFINE_HANDLER_SYMBOL(DantinoxZeroPages, ZeroPagesImpl, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DantinoxDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("isa"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DantinoxPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("isa"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DantinoxPrefillAttention, PrefillAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("isa"));

namespace {

PyObject* py_handler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&DantinoxBlockMatmul), nullptr, nullptr);
}

PyObject* py_attention_handler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&DantinoxDecodeAttention), nullptr, nullptr);
}

PyObject* py_paged_attention_handler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&DantinoxPagedAttention), nullptr, nullptr);
}

PyObject* py_prefill_attention_handler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&DantinoxPrefillAttention), nullptr, nullptr);
}

PyObject* py_zero_pages_handler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&DantinoxZeroPages), nullptr, nullptr);
}

PyObject* py_isa(PyObject*, PyObject*) {
  static const char* names[] = {"auto", "scalar", "avx2", "avx512"};
  return PyUnicode_FromString(names[detected_isa()]);
}

PyMethodDef methods[] = {
    {"handler", py_handler, METH_NOARGS, "PyCapsule of the XLA FFI handler dantinox_block_matmul."},
    {"attention_handler", py_attention_handler, METH_NOARGS,
     "PyCapsule of the XLA FFI handler dantinox_decode_attention."},
    {"paged_attention_handler", py_paged_attention_handler, METH_NOARGS,
     "PyCapsule of the XLA FFI handler dantinox_paged_attention."},
    {"prefill_attention_handler", py_prefill_attention_handler, METH_NOARGS,
     "PyCapsule of the XLA FFI handler dantinox_prefill_attention."},
    {"zero_pages_handler", py_zero_pages_handler, METH_NOARGS,
     "PyCapsule of the XLA FFI handler dantinox_zero_pages."},
    {"isa", py_isa, METH_NOARGS, "The instruction set this CPU runs: 'avx512', 'avx2' or 'scalar'."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_block_matmul", "dantinox's block matrix product (XLA FFI).", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit__block_matmul() { return PyModule_Create(&module); }
