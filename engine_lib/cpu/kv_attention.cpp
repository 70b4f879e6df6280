// Attention of a few query rows over an int8 (or bf16, or fp32) KV cache, on x86 CPUs with AVX2 and FMA (an AVX-512 form of the
// two inner loops is chosen at run time where the CPU has it; the file is built for AVX2, as gemv.cpp is).
//
// A decode step at long context reads the whole cache of every layer: at 4096 keys, 2 KV heads and head_dim
// 128 that is 2 MiB of K and V per layer in bf16 and 1 MiB in int8 (cache/quantized.py: one fp32 scale per
// token and KV head, x ~ q * scale). Dequantizing into a bf16 or fp32 copy first and then calling a float
// attention writes and reads more bytes than the int8 cache saved. Here each key and value row is read once,
// in int8, and widened to fp32 in registers, for every query row that uses it: the `groups` query heads of
// its KV head (GQA) times the q_len rows (1 in a decode step, a few in a speculative verify).
//
// A bf16 or fp32 cache (kv_attention) takes the same loops with its values widened in place of the integers and
// every scale 1: a half-precision model's decode step, where SDPA's set-up on every call costs more than the keys.
//
// Shapes: q (B, H, T, D) fp32 or bf16; k, v (B, KVH, S, D) int8 (or both bf16, or both fp32, with no scales); k_scale, v_scale (B, KVH, S) fp32; mask
// (B or 1, 1 or H, T or 1, S) bool, True = may attend. Only head_dim must be contiguous: the cache hands views
// (a slice of a (B, KVH, max_len, D) buffer, a paged gather (B, S, KVH, D) transposed). All arithmetic fp32:
//   score[s] = k_scale[s] * dot(q, k_int8[s]) * D^-0.5,   out = sum_s softmax(score)[s] * v_scale[s] * v_int8[s].
//
// Work: the keys of each (batch, KV head) are cut into chunks of CHUNK keys, and every (batch, KV head, chunk)
// is one task of at::parallel_for (so batch 1 with 2 KV heads still fills every core at long context). A task
// keeps its rows' scores in a small buffer (two passes: scores, then exp and the weighted values), and leaves
// a partial result per query row: its max score m, sum of exp(score - m) l, and unnormalized output o. A
// second pass merges a row's chunks (flash-decoding): out = sum_c o_c e^(m_c - M) / sum_c l_c e^(m_c - M),
// M = max_c m_c. The chunk size is fixed, so the sums, and the result, do not depend on the thread count.
// A row that sees no key gives zeros; a NaN score (a NaN or infinite query) makes its row NaN, as in torch.
//
// The work is the FMAs (2 per key, query row and dim), not the bytes: measured on a 2-core AMD EPYC (Zen 5) VM,
// 2 threads, batch 1, 12 query heads over 2 KV heads, one query row, 4096 keys, cache warm: 93 us with the
// AVX-512 loops, 153 us held to AVX2, against 293 us for PyTorch's SDPA over a bf16 cache of the same shape.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace {

constexpr int64_t CHUNK = 128;  // keys per task (a multiple of 8): 16 KiB of K and of V at D = 128, in L1
constexpr int ROW_BLOCK = 6;    // query rows whose sums stay in registers together
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// 8 cache values -> 8 fp32: int8 converted, bf16 the top half of an fp32, fp32 as it is
inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 widen8(const at::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }

// 8 accumulators -> one vector of their 8 horizontal sums (a[r]'s sum in lane r)
inline __m256 sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for x <= 0 (scores minus their max), 8 at a time: x = n ln2 + r, |r| <= ln2 / 2, e^r by Cephes' degree-5
// polynomial (about 2 ulp), 2^n put into the exponent bits. Below ln(2^-126) (and -inf, a masked key) gives 0;
// a NaN stays NaN (max and min return their second operand where one is NaN).
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3365447505531f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_NLT_UQ);  // x >= lo, or NaN
  x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), _mm256_max_ps(lo, x));
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
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
}

// ---- the two inner loops, AVX2 ----
// U (scores) and DI (values) give each row 2 or 4 independent sums, so that a block of few rows still has
// enough FMAs in flight (an FMA's latency is 4 cycles, two issue per cycle).

// sc[r * CHUNK + s] = dot(q row r, k row s) (int8 widened) for NR query rows (row stride D) and n keys
template <int NR, typename T>
void scores_avx2(const float* q, int64_t D, const T* k, int64_t kst, int64_t n, float* sc) {
  constexpr int U = NR <= 2 ? 4 : 2;
  const int64_t DU = D / (8 * U) * (8 * U);
  for (int64_t s = 0; s < n; ++s) {
    const T* kp = k + s * kst;
    __m256 acc[NR][U];
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < U; ++u) acc[r][u] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i < DU; i += 8 * U) {
      for (int u = 0; u < U; ++u) {
        const __m256 kf = widen8(kp + i + 8 * u);
        for (int r = 0; r < NR; ++r) acc[r][u] = _mm256_fmadd_ps(kf, _mm256_loadu_ps(q + r * D + i + 8 * u), acc[r][u]);
      }
    }
    for (; i < D; i += 8) {
      const __m256 kf = widen8(kp + i);
      for (int r = 0; r < NR; ++r) acc[r][0] = _mm256_fmadd_ps(kf, _mm256_loadu_ps(q + r * D + i), acc[r][0]);
    }
    __m256 rows[8];
    for (int r = 0; r < 8; ++r) {
      rows[r] = _mm256_setzero_ps();
      if (r < NR)
        for (int u = 0; u < U; ++u) rows[r] = _mm256_add_ps(rows[r], acc[r][u]);
    }
    alignas(32) float sums[8];
    _mm256_store_ps(sums, sum8(rows));
    for (int r = 0; r < NR; ++r) sc[r * CHUNK + s] = sums[r];
  }
}

// o[r * D + i ..] = sum_s w[r * CHUNK + s] * v row s (int8 widened), dims i .. i + 8 DI - 1
template <int NR, int DI, typename T>
inline void values_avx2_dims(const float* w, const T* v, int64_t vst, int64_t n, float* o, int64_t D, int64_t i) {
  __m256 acc[NR][DI];
  for (int r = 0; r < NR; ++r)
    for (int d = 0; d < DI; ++d) acc[r][d] = _mm256_setzero_ps();
  for (int64_t s = 0; s < n; ++s) {
    const T* vp = v + s * vst + i;
    __m256 vf[DI];
    for (int d = 0; d < DI; ++d) vf[d] = widen8(vp + 8 * d);
    for (int r = 0; r < NR; ++r) {
      const __m256 p = _mm256_broadcast_ss(w + r * CHUNK + s);
      for (int d = 0; d < DI; ++d) acc[r][d] = _mm256_fmadd_ps(vf[d], p, acc[r][d]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int d = 0; d < DI; ++d) _mm256_storeu_ps(o + r * D + i + 8 * d, acc[r][d]);
}

template <int NR, typename T>
void values_avx2(const float* w, const T* v, int64_t vst, int64_t n, float* o, int64_t D) {
  constexpr int DI = NR <= 2 ? 4 : 2;
  int64_t i = 0;
  for (; i + 8 * DI <= D; i += 8 * DI) values_avx2_dims<NR, DI, T>(w, v, vst, n, o, D, i);
  for (; i < D; i += 8) values_avx2_dims<NR, 1, T>(w, v, vst, n, o, D, i);
}

// ---- the same loops, AVX-512 (16 dims a vector; D a multiple of 16). Every intrinsic sits in a function with
// the target attribute, never in the lambda of parallel_for (which has none), as in gemv.cpp.
#define KV_AVX512 __attribute__((target("avx2,fma,avx512f")))

KV_AVX512 inline __m512 widen16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
KV_AVX512 inline __m512 widen16(const at::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
KV_AVX512 inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }

KV_AVX512 inline __m256 fold(__m512 a) {  // 16 lanes -> 8: lane j + lane j + 8
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

template <int NR, typename T>
KV_AVX512 void scores_avx512(const float* q, int64_t D, const T* k, int64_t kst, int64_t n, float* sc) {
  constexpr int U = NR <= 2 ? 4 : 2;
  const int64_t DU = D / (16 * U) * (16 * U);
  for (int64_t s = 0; s < n; ++s) {
    const T* kp = k + s * kst;
    __m512 acc[NR][U];
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i < DU; i += 16 * U) {
      for (int u = 0; u < U; ++u) {
        const __m512 kf = widen16(kp + i + 16 * u);
        for (int r = 0; r < NR; ++r) acc[r][u] = _mm512_fmadd_ps(kf, _mm512_loadu_ps(q + r * D + i + 16 * u), acc[r][u]);
      }
    }
    for (; i < D; i += 16) {
      const __m512 kf = widen16(kp + i);
      for (int r = 0; r < NR; ++r) acc[r][0] = _mm512_fmadd_ps(kf, _mm512_loadu_ps(q + r * D + i), acc[r][0]);
    }
    __m256 rows[8];
    for (int r = 0; r < 8; ++r) {
      rows[r] = _mm256_setzero_ps();
      if (r < NR) {
        __m512 t = acc[r][0];
        for (int u = 1; u < U; ++u) t = _mm512_add_ps(t, acc[r][u]);
        rows[r] = fold(t);
      }
    }
    alignas(32) float sums[8];
    _mm256_store_ps(sums, sum8(rows));
    for (int r = 0; r < NR; ++r) sc[r * CHUNK + s] = sums[r];
  }
}

template <int NR, int DI, typename T>
KV_AVX512 inline void values_avx512_dims(const float* w, const T* v, int64_t vst, int64_t n, float* o,
                                         int64_t D, int64_t i) {
  __m512 acc[NR][DI];
  for (int r = 0; r < NR; ++r)
    for (int d = 0; d < DI; ++d) acc[r][d] = _mm512_setzero_ps();
  for (int64_t s = 0; s < n; ++s) {
    const T* vp = v + s * vst + i;
    __m512 vf[DI];
    for (int d = 0; d < DI; ++d) vf[d] = widen16(vp + 16 * d);
    for (int r = 0; r < NR; ++r) {
      const __m512 p = _mm512_set1_ps(w[r * CHUNK + s]);
      for (int d = 0; d < DI; ++d) acc[r][d] = _mm512_fmadd_ps(vf[d], p, acc[r][d]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int d = 0; d < DI; ++d) _mm512_storeu_ps(o + r * D + i + 16 * d, acc[r][d]);
}

template <int NR, typename T>
KV_AVX512 void values_avx512(const float* w, const T* v, int64_t vst, int64_t n, float* o, int64_t D) {
  constexpr int DI = NR <= 2 ? 4 : 2;
  int64_t i = 0;
  for (; i + 16 * DI <= D; i += 16 * DI) values_avx512_dims<NR, DI, T>(w, v, vst, n, o, D, i);
  for (; i < D; i += 16) values_avx512_dims<NR, 1, T>(w, v, vst, n, o, D, i);
}

// rows r0 .. r0 + nr - 1 (nr <= ROW_BLOCK) through one of the loops above, by their compile-time count
template <template <int> class F, typename... A>
void by_rows(int nr, A... a) {
  switch (nr) {
    case 1: F<1>::run(a...); break;
    case 2: F<2>::run(a...); break;
    case 3: F<3>::run(a...); break;
    case 4: F<4>::run(a...); break;
    case 5: F<5>::run(a...); break;
    default: F<6>::run(a...); break;
  }
}
template <int NR> struct ScoresAvx2 { template <typename... A> static void run(A... a) { scores_avx2<NR>(a...); } };
template <int NR> struct ScoresAvx512 { template <typename... A> static void run(A... a) { scores_avx512<NR>(a...); } };
template <int NR> struct ValuesAvx2 { template <typename... A> static void run(A... a) { values_avx2<NR>(a...); } };
template <int NR> struct ValuesAvx512 { template <typename... A> static void run(A... a) { values_avx512<NR>(a...); } };

// One call's operands: raw pointers and element strides (0 along a broadcast dim of the mask).
struct Problem {
  int64_t B, KVH, G, T, S, D, R, chunks;  // R = G * T query rows per (batch, KV head)
  const float* q;                         // (B, KVH, R, D) fp32 contiguous: q's (B, H, T, D), H = KVH * G
  const void *k, *v;      // int8, bf16 or fp32 (run_task's T)
  int64_t ks[3], vs[3];  // strides of k, v (batch, head, key)
  const float *k_scale, *v_scale;  // nullptr for a float cache: every scale 1
  int64_t kss[3], vss[3];
  const bool* mask;  // nullptr: every key visible
  int64_t ms[4];
  float inv_sqrt_d;
  bool wide;                     // the AVX-512 loops
  float *part_m, *part_l, *part_o;  // per task: (R,), (R,), (R, D)
};

// One task: (batch b, KV head h, chunk c) -> the partial results of its R rows. T: the cache's element type.
template <typename T>
void run_task(const Problem& P, int64_t task, float* sc, float* coef, float* vsc) {
  const int64_t c = task % P.chunks, bh = task / P.chunks, b = bh / P.KVH, h = bh % P.KVH;
  const int64_t s0 = c * CHUNK, n = std::min(CHUNK, P.S - s0), n8 = (n + 7) / 8 * 8, R = P.R, D = P.D;
  const float* q = P.q + bh * R * D;
  const T* k = static_cast<const T*>(P.k) + b * P.ks[0] + h * P.ks[1] + s0 * P.ks[2];
  const T* v = static_cast<const T*>(P.v) + b * P.vs[0] + h * P.vs[1] + s0 * P.vs[2];
  for (int64_t r0 = 0; r0 < R; r0 += ROW_BLOCK) {
    const int nr = static_cast<int>(std::min<int64_t>(ROW_BLOCK, R - r0));
    if (P.wide) by_rows<ScoresAvx512>(nr, q + r0 * D, D, k, P.ks[2], n, sc + r0 * CHUNK);
    else by_rows<ScoresAvx2>(nr, q + r0 * D, D, k, P.ks[2], n, sc + r0 * CHUNK);
  }
  if (P.k_scale != nullptr) {
    const float* ksp = P.k_scale + b * P.kss[0] + h * P.kss[1] + s0 * P.kss[2];
    const float* vsp = P.v_scale + b * P.vss[0] + h * P.vss[1] + s0 * P.vss[2];
    for (int64_t s = 0; s < n; ++s) {
      coef[s] = ksp[s * P.kss[2]] * P.inv_sqrt_d;
      vsc[s] = vsp[s * P.vss[2]];
    }
  } else {
    std::fill(coef, coef + n, P.inv_sqrt_d);
    std::fill(vsc, vsc + n, 1.0f);
  }
  for (int64_t s = n; s < n8; ++s) coef[s] = NEG_INF, vsc[s] = 0.0f;  // padding keys: weight 0
  float* pm = P.part_m + task * R;
  float* pl = P.part_l + task * R;
  for (int64_t r = 0; r < R; ++r) {
    float* x = sc + r * CHUNK;
    for (int64_t s = n; s < n8; ++s) x[s] = 1.0f;  // times coef -inf
    __m256 mx = _mm256_set1_ps(NEG_INF), nan = _mm256_setzero_ps();
    for (int64_t s = 0; s < n8; s += 8) {
      const __m256 xs = _mm256_mul_ps(_mm256_loadu_ps(x + s), _mm256_loadu_ps(coef + s));
      _mm256_storeu_ps(x + s, xs);
      mx = _mm256_max_ps(mx, xs);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(xs, xs, _CMP_UNORD_Q));
    }
    float m = hmax(mx);
    bool any_nan = _mm256_movemask_ps(nan) != 0;
    if (P.mask != nullptr) {
      const int64_t g = r / P.T, t = r % P.T;
      const bool* mrow = P.mask + b * P.ms[0] + (h * P.G + g) * P.ms[1] + t * P.ms[2] + s0 * P.ms[3];
      m = NEG_INF, any_nan = false;
      for (int64_t s = 0; s < n; ++s) {
        if (!mrow[s * P.ms[3]]) x[s] = NEG_INF;
        any_nan |= std::isnan(x[s]);
        m = std::max(m, x[s]);
      }
    }
    // a NaN score (a NaN or infinite query) makes its row NaN, as a float attention would: the engine's check
    // of the logits then reports it, where dropping the key would hide it
    if (any_nan) m = std::numeric_limits<float>::quiet_NaN();
    pm[r] = m;
    if (m == NEG_INF) {  // no visible key in this chunk
      std::fill(x, x + n8, 0.0f);
      pl[r] = 0.0f;
      continue;
    }
    const __m256 mv = _mm256_set1_ps(m);
    __m256 l = _mm256_setzero_ps();
    for (int64_t s = 0; s < n8; s += 8) {
      const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + s), mv));
      l = _mm256_add_ps(l, p);
      _mm256_storeu_ps(x + s, _mm256_mul_ps(p, _mm256_loadu_ps(vsc + s)));  // the value rows' weights
    }
    pl[r] = hsum(l);
  }
  float* o = P.part_o + task * R * D;
  for (int64_t r0 = 0; r0 < R; r0 += ROW_BLOCK) {
    const int nr = static_cast<int>(std::min<int64_t>(ROW_BLOCK, R - r0));
    if (P.wide) by_rows<ValuesAvx512>(nr, sc + r0 * CHUNK, v, P.vs[2], n, o + r0 * D, D);
    else by_rows<ValuesAvx2>(nr, sc + r0 * CHUNK, v, P.vs[2], n, o + r0 * D, D);
  }
}

// the AVX-512 loops where the CPU has AVX-512 and the int8 and int4 matvecs use it: ENGINE_LIB_CPU_ISA=avx2
// and set_isa("avx2") (gemv.cpp) hold this kernel to AVX2 too, so the tests can compare the two
bool wide_isa() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("engine_lib_cpu::kernel_isa", "")
                             .typed<std::string()>();
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return has && op.call() == "avx512_vnni";
}

int64_t stride_of(const at::Tensor& t, int64_t d) { return t.size(d) == 1 ? 0 : t.stride(d); }

// The two ops' shared body: k_scale and v_scale are nullptr for a float cache (bf16 or fp32 keys and values).
at::Tensor attend(const char* name, const at::Tensor& q, const at::Tensor& k, const at::Tensor* k_scale,
                  const at::Tensor& v, const at::Tensor* v_scale, const c10::optional<at::Tensor>& mask) {
  TORCH_CHECK(q.dim() == 4, name, ": q must be (batch, heads, q_len, head_dim), got ", q.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              name, ": q must be fp32 or bf16, got ", q.scalar_type());
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4, name, ": k and v must be (batch, kv_heads, S, head_dim), got ",
              k.sizes(), " and ", v.sizes());
  if (k_scale != nullptr) {
    TORCH_CHECK(k.scalar_type() == at::kChar && v.scalar_type() == at::kChar,
                name, ": k and v must be int8, got ", k.scalar_type(), " and ", v.scalar_type());
  } else {
    TORCH_CHECK((k.scalar_type() == at::kBFloat16 || k.scalar_type() == at::kFloat) && v.scalar_type() == k.scalar_type(),
                name, ": k and v must both be bf16 or both fp32, got ", k.scalar_type(), " and ", v.scalar_type());
  }
  TORCH_CHECK(k.sizes() == v.sizes(), name, ": k ", k.sizes(), " and v ", v.sizes(), " differ in shape");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t KVH = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B, name, ": q has batch ", B, ", k and v ", k.size(0));
  TORCH_CHECK(k.size(3) == D, name, ": q has head_dim ", D, ", k and v ", k.size(3));
  TORCH_CHECK(D > 0 && D % 8 == 0, name, ": head_dim must be a positive multiple of 8, got ", D);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, name, ": q's ", H, " heads are not a multiple of the ", KVH,
              " KV heads");
  TORCH_CHECK(q.stride(3) == 1, name, ": q's head_dim must be contiguous (stride 1), got stride ",
              q.stride(3));
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1,
              name, ": k's and v's head_dim must be contiguous (stride 1), got strides ", k.stride(3),
              " and ", v.stride(3));
  for (const at::Tensor* s : {k_scale, v_scale}) {
    if (s == nullptr) continue;
    TORCH_CHECK(s->scalar_type() == at::kFloat, name, ": k_scale and v_scale must be fp32, got ",
                s->scalar_type());
    TORCH_CHECK(s->dim() == 3 && s->size(0) == B && s->size(1) == KVH && s->size(2) == S,
                name, ": k_scale and v_scale must be (batch, kv_heads, S) = (", B, ", ", KVH, ", ", S,
                "), got ", s->sizes());
  }
  const bool has_mask = mask.has_value() && mask->defined();
  if (has_mask) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool, name, ": mask must be bool (True = may attend), got ",
                m.scalar_type());
    TORCH_CHECK(m.dim() == 4 && (m.size(0) == B || m.size(0) == 1) && (m.size(1) == 1 || m.size(1) == H) &&
                    (m.size(2) == T || m.size(2) == 1) && m.size(3) == S,
                name, ": mask must be (batch or 1, 1, q_len, S) = (", B, ", 1, ", T, ", ", S, "), got ",
                m.sizes());
  }
  for (const at::Tensor* t : {&q, &k, &v, k_scale, v_scale})
    if (t != nullptr) {
      TORCH_CHECK(t->device().is_cpu(), name, ": CPU tensors only, got one on ", t->device());
    }
  if (has_mask) TORCH_CHECK(mask->device().is_cpu(), name, ": CPU tensors only, got a mask on ",
                            mask->device());

  auto out = at::empty({B, H, T, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  if (S == 0) return out.zero_();  // no key: every row sees nothing

  const int64_t G = H / KVH, R = G * T, rows = B * H * T;
  // q as (B, KVH, R, D) fp32 contiguous: q's own (B, H, T, D) order, head h = kv head * G + g
  std::vector<float> qf(rows * D);
  {
    const int64_t s0 = q.stride(0), s1 = q.stride(1), s2 = q.stride(2);
    const bool bf16 = q.scalar_type() == at::kBFloat16;
    const float* qp32 = bf16 ? nullptr : q.data_ptr<float>();
    const at::BFloat16* qp16 = bf16 ? q.data_ptr<at::BFloat16>() : nullptr;
    for (int64_t b = 0, row = 0; b < B; ++b)
      for (int64_t hh = 0; hh < H; ++hh)
        for (int64_t t = 0; t < T; ++t, ++row) {
          const int64_t off = b * s0 + hh * s1 + t * s2;
          float* dst = qf.data() + row * D;
          if (bf16) for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(qp16[off + d]);
          else std::copy(qp32 + off, qp32 + off + D, dst);
        }
  }

  Problem P;
  P.B = B, P.KVH = KVH, P.G = G, P.T = T, P.S = S, P.D = D, P.R = R, P.chunks = (S + CHUNK - 1) / CHUNK;
  P.q = qf.data();
  P.k = k.data_ptr(), P.v = v.data_ptr();
  P.k_scale = k_scale ? k_scale->data_ptr<float>() : nullptr, P.v_scale = v_scale ? v_scale->data_ptr<float>() : nullptr;
  for (int d = 0; d < 3; ++d) {
    P.ks[d] = stride_of(k, d), P.vs[d] = stride_of(v, d);
    P.kss[d] = k_scale ? stride_of(*k_scale, d) : 0, P.vss[d] = v_scale ? stride_of(*v_scale, d) : 0;
  }
  P.mask = has_mask ? mask->data_ptr<bool>() : nullptr;
  for (int d = 0; d < 4; ++d) P.ms[d] = has_mask ? stride_of(*mask, d) : 0;
  P.inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(D));
  P.wide = D % 16 == 0 && wide_isa();
  const int64_t tasks = B * KVH * P.chunks;
  const at::ScalarType kind = k.scalar_type();
  std::vector<float> part_m(tasks * R), part_l(tasks * R), part_o(tasks * R * D);
  P.part_m = part_m.data(), P.part_l = part_l.data(), P.part_o = part_o.data();

  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> sc(R * CHUNK), coef(CHUNK), vsc(CHUNK);
    for (int64_t t = t0; t < t1; ++t) {
      if (kind == at::kChar) run_task<int8_t>(P, t, sc.data(), coef.data(), vsc.data());
      else if (kind == at::kBFloat16) run_task<at::BFloat16>(P, t, sc.data(), coef.data(), vsc.data());
      else run_task<float>(P, t, sc.data(), coef.data(), vsc.data());
    }
  });

  // merge each row's chunks: row (b, kv head, r) is out's row (b * KVH + kv head) * R + r
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  float* out32 = bf16 ? nullptr : out.data_ptr<float>();
  at::BFloat16* out16 = bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  const int64_t C = P.chunks, grain = std::max<int64_t>(1, 16384 / (C * D));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> acc(D);
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t bh = row / R, r = row % R;
      float M = NEG_INF;
      bool nan = false;
      for (int64_t c = 0; c < C; ++c) {
        const float m = part_m[(bh * C + c) * R + r];
        nan |= std::isnan(m);
        M = std::max(M, m);
      }
      std::fill(acc.begin(), acc.end(), nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f);
      float L = nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
      if (M != NEG_INF && !nan) {
        for (int64_t c = 0; c < C; ++c) {
          const int64_t task = bh * C + c;
          const float m = part_m[task * R + r];
          if (m == NEG_INF) continue;
          const float e = std::exp(m - M);
          L += part_l[task * R + r] * e;
          const float* o = part_o.data() + (task * R + r) * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += o[d] * e;
        }
      }
      const float inv = L > 0.0f || std::isnan(L) ? 1.0f / L : 0.0f;  // a row with no visible key: zeros
      if (bf16) for (int64_t d = 0; d < D; ++d) out16[row * D + d] = static_cast<at::BFloat16>(acc[d] * inv);
      else for (int64_t d = 0; d < D; ++d) out32[row * D + d] = acc[d] * inv;
    }
  });
  return out;
}

at::Tensor int8_kv_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& k_scale, const at::Tensor& v,
                             const at::Tensor& v_scale, const c10::optional<at::Tensor>& mask) {
  return attend("int8_kv_attention", q, k, &k_scale, v, &v_scale, mask);
}

// The same attention over a cache in bf16 or fp32 (every scale 1): a decode step of a half-precision model on a
// CPU, where PyTorch's SDPA pays more in its own set-up than the few keys of a short context cost.
at::Tensor kv_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const c10::optional<at::Tensor>& mask) {
  return attend("kv_attention", q, k, nullptr, v, nullptr, mask);
}

// One row of head_dim values -> int8 and its scale, as cache/quantized.py's ``quantize`` computes them in torch:
// scale = amax / 127, q = sign(x) * min(floor(|x| * (127 / amax) + 0.5), 127), each step rounded to fp32 on its
// own (no fused multiply-add: the two must agree bit for bit).
__attribute__((optimize("fp-contract=off"))) void quantize_row(const float* x, int64_t D, int8_t* q, float* scale) {
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  *scale = amax / 127.0f;
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int64_t d = 0; d < D; ++d) {
    const float scaled = std::fabs(x[d]) * inv;
    const float mag = std::min(std::floor(scaled + 0.5f), 127.0f);
    q[d] = static_cast<int8_t>(x[d] < 0.0f ? -mag : mag);
  }
}

// x (..., head_dim) fp32 or bf16 -> (int8 (..., head_dim), fp32 scale (...)): the int8 cache's write in one call,
// where torch takes a dozen small ops (a decode step writes 2 x 28 of these on the real model)
std::tuple<at::Tensor, at::Tensor> quantize_kv(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "quantize_kv: x must have a last (head_dim) axis, got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quantize_kv: x must be fp32 or bf16, got ", x.scalar_type());
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // (rows, head_dim)
  const int64_t D = x.size(-1), rows = xf.numel() / D;
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  at::Tensor scale = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  const float* src = xf.data_ptr<float>();
  int8_t* dst = q.data_ptr<int8_t>();
  float* sc = scale.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) quantize_row(src + r * D, D, dst + r * D, sc + r);
  });
  return {q, scale};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(engine_lib_cpu, m) {
  m.def("int8_kv_attention(Tensor q, Tensor k, Tensor k_scale, Tensor v, Tensor v_scale, Tensor? mask) -> Tensor");
  m.def("kv_attention(Tensor q, Tensor k, Tensor v, Tensor? mask) -> Tensor");
  m.def("quantize_kv(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(engine_lib_cpu, CPU, m) {
  m.impl("int8_kv_attention", int8_kv_attention);
  m.impl("kv_attention", kv_attention);
  m.impl("quantize_kv", quantize_kv);
}
