// Matrix-vector products for decode steps on x86 CPUs with AVX2 and FMA, and AVX-512 VNNI variants of the
// int8 and int4 kernels, chosen at run time where the CPU has them (below: the file is built for AVX2,
// so the same build runs on a CPU without AVX-512).
// One GEMM too: bf16 weights times many rows (a prefill) on a CPU without bf16 instructions (bf16_gemm).
//
// A decode step reads every weight once, so its speed is the speed at which weights stream from
// memory. Each kernel reads its weights in their stored width (bf16, int8, or two int4 per byte)
// and widens them in registers: no wider copy of a weight is ever written. bf16 weights meet fp32
// activations; int8 weights meet activations rounded to 16-bit integers per block, int4 weights
// activations rounded to 8-bit integers per 32 inputs (below).
//
// Shapes: x (M, K) fp32 contiguous, a few rows (a decode batch); weights (N, K); out (M, N) fp32.
// Four weight rows are processed together so each activation load feeds four FMAs, and a block of
// four rows stays in cache while every activation row is multiplied with it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t ROWS = 4;  // weight rows per block
// The int8 and int4 kernels read each row of a block 16 or 32 bytes at a time, four rows interleaved, a pattern
// the hardware prefetcher follows poorly: every 64 bytes, ask for the same bytes of the rows two blocks ahead.
constexpr int64_t PREFETCH_ROWS = 2 * ROWS;
constexpr int64_t PREFETCH_BYTES = 4096;  // the bf16 kernel's distance ahead in its one stream (dot_tile)

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 bf16 weights -> 8 fp32: bf16 is the top half of an fp32
inline __m256 widen(const at::BFloat16* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// bf16: out[m, n] = sum_k x[m, k] * w[n, k] for rows n0..n0+R-1 (R <= ROWS) and activation rows m0..m0+MT-1.
// The rows are read one after another, 64 bytes (32 weights) a step, so each thread walks one sequential stream
// of weights, and a software prefetch runs PREFETCH_BYTES ahead of it. Measured on a 2-core AMD EPYC VM held to
// AVX2, the 1.5B model's 113 bf16 matrices of one decode step (3.09 GB, cold): a standalone copy of both loops,
// interleaved in one run, 1.2 to 1.4x the bandwidth of four rows read side by side 16 bytes at a time with the
// rows two blocks ahead prefetched (this kernel's form until 2026-12-07); the engine's own layers, builds
// alternated, 38 to 44 GB/s against 33 to 38. Four rows side by side, each prefetched ahead in its own stream,
// ran at half the speed. (The int8 kernel, reordered the same way, streamed no faster in the engine, alternated,
// and its prefills slowed: it keeps its four rows side by side.)
// Each weight vector is widened once for MT activation rows; every (m, n) sum takes the same steps in the same
// order whatever MT is, so a row's result does not depend on the rows beside it.
template <typename W, int R, int MT>
inline void dot_tile(const W* w, int64_t K, const float* x, int64_t m0, float* out, int64_t N, int64_t n0) {
  const int64_t K32 = K / 32 * 32, K8 = K / 8 * 8;
  for (int r = 0; r < R; ++r) {
    const W* row = w + (n0 + r) * K;
    __m256 acc[MT][4];
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K32; k += 32) {
      if (m0 == 0) _mm_prefetch(reinterpret_cast<const char*>(row + k) + PREFETCH_BYTES, _MM_HINT_T0);
      __m256 wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = widen(row + k + 8 * j);
      for (int i = 0; i < MT; ++i)
        for (int j = 0; j < 4; ++j)
          acc[i][j] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(x + (m0 + i) * K + k + 8 * j), acc[i][j]);
    }
    for (int64_t k = K32; k < K8; k += 8) {
      const __m256 wv = widen(row + k);
      for (int i = 0; i < MT; ++i) acc[i][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (m0 + i) * K + k), acc[i][0]);
    }
    for (int i = 0; i < MT; ++i) {
      const float* xm = x + (m0 + i) * K;
      float s = hsum(_mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]), _mm256_add_ps(acc[i][2], acc[i][3])));
      for (int64_t k = K8; k < K; ++k) s += static_cast<float>(row[k]) * xm[k];
      out[(m0 + i) * N + n0 + r] = s;
    }
  }
}

// Two activation rows at a time. Measured on a 2-core AVX2 host (AMD EPYC), builds interleaved, the (8960,
// 1536) and (1536, 8960) layers at 2 to 16 rows: bf16 0.53-0.67 of the one-row form's time, int8 (int8_rows,
// the same pairing) 0.46-0.68; one row unchanged. int4's AVX2 kernel takes pairs too (int4_rows), its AVX-512
// VNNI form, whose products take fewer instructions, four (int4_tile_512).
template <typename W, int R>
inline void dot_rows(const W* w, int64_t K, const float* x, int64_t M, float* out, int64_t N, int64_t n0) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) dot_tile<W, R, 2>(w, K, x, m, out, N, n0);
  if (m < M) dot_tile<W, R, 1>(w, K, x, m, out, N, n0);
}

template <typename W>
void gemv(const W* w, int64_t N, int64_t K, const float* x, int64_t M, float* out) {
  const int64_t blocks = N / ROWS;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) dot_rows<W, ROWS>(w, K, x, M, out, N, b * ROWS);
  });
  for (int64_t n = blocks * ROWS; n < N; ++n) dot_rows<W, 1>(w, K, x, M, out, N, n);
}

void check(const at::Tensor& x, const at::Tensor& w, int64_t k_stored) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be (M, K) fp32 contiguous");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == k_stored, "weight must be (N, K) contiguous");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "CPU tensors only");
}

at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& w) {
  check(x, w, x.size(1));
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "weight must be bf16");
  auto out = at::empty({x.size(0), w.size(0)}, x.options());
  gemv(w.data_ptr<at::BFloat16>(), w.size(0), w.size(1), x.data_ptr<float>(), x.size(0), out.data_ptr<float>());
  return out;
}

// A whole bf16 layer for an eager decode step: x (..., K) bf16 -> x @ w^T + bias, (..., N) bf16. The activations are
// widened to fp32 (exact), summed as bf16_gemv sums them, the bias added in fp32 and each output rounded once to
// bf16 (nearest even): bit for bit bf16_gemv(x.float(), w) + bias.float(), then .bfloat16(). One call where the
// Python form takes five (the two conversions, the bias's, the add), which an eager step pays on every layer.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x must be (..., K) bf16 contiguous");
  const int64_t K = x.size(-1), M = x.numel() / std::max<int64_t>(K, 1), N = w.size(0);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(1) == K,
              "weight must be (N, K) bf16 contiguous");
  const at::BFloat16* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "bias must be (N,) bf16 contiguous");
    bp = bias->data_ptr<at::BFloat16>();
  }
  std::vector<float> xf(M * K);  // (M, K) fp32
  const at::BFloat16* xs = x.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xs[i]);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  auto out = at::empty(shape, x.options());
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  const at::BFloat16* wd = w.data_ptr<at::BFloat16>();
  // weight rows n0..n0+R-1: their (M, R) fp32 sums into `sums`, then plus the bias, rounded into out
  auto rows = [&](auto r_tag, int64_t n0, float* sums) {
    constexpr int R = decltype(r_tag)::value;
    dot_rows<at::BFloat16, R>(wd + n0 * K, K, xf.data(), M, sums, R, 0);
    for (int64_t m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r)
        o[m * N + n0 + r] = at::BFloat16(sums[m * R + r] + (bp ? static_cast<float>(bp[n0 + r]) : 0.0f));
  };
  const int64_t blocks = N / ROWS;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    std::vector<float> sums(M * ROWS);
    for (int64_t b = b0; b < b1; ++b) rows(std::integral_constant<int, ROWS>{}, b * ROWS, sums.data());
  });
  std::vector<float> sums(M);
  for (int64_t n = blocks * ROWS; n < N; ++n) rows(std::integral_constant<int, 1>{}, n, sums.data());
  return out;
}

// bf16 weights, many rows (a prefill on a CPU without bf16 instructions): out[m, n] = sum_k x[m, k] * w[n, k].
// A GEMM where the row kernel above is a matvec: a tile of GEMM_MR activation rows by GEMM_NR weight rows keeps
// its GEMM_MR * GEMM_NR sums in registers, so each weight vector widened feeds GEMM_MR FMAs and each activation
// vector GEMM_NR. bf16 widens to fp32 by interleaving 16 weights with zeros (vpunpcklwd / vpunpckhwd: two
// instructions for 16 weights, no shift); the interleave takes the weights of each 128-bit lane in the order
// [0-3, 8-11] and [4-7, 12-15], so the activations are reordered the same way once per call. A block of
// GEMM_NB weight rows by GEMM_KC inputs (400 KiB of bf16) stays in L2 while every activation tile passes over it.
// The weights are read in their stored width once: no fp32 copy is written (the alternative, fp32 blocks and
// oneDNN's fp32 GEMM, writes and reads one). Each sum takes the same steps whatever the number of rows.
// Measured on a 2-core Zen 4 held to AVX2, (8960, 1536) and (1536, 8960) at 35 and 128 rows, tiles of 2x4, 3x3,
// 4x2, 2x5, 3x4, 4x3 and 2x6: 2x5 was the fastest at each (185 to 210 GFLOP/s, 80% of the FMA peak measured
// there); 16 ymm registers hold its 10 sums, 4 activation vectors and the two widened weight vectors.
constexpr int GEMM_MR = 2, GEMM_NR = 5;
constexpr int64_t GEMM_NB = 100, GEMM_KC = 2048;

template <int NR>
inline void gemm_tile(const float* xp, int64_t K, const uint16_t* w, int64_t k0, int64_t kc, float* out, int64_t N,
                      int64_t m0, int64_t mr, int64_t n0) {
  __m256 acc[GEMM_MR][NR];
  for (int m = 0; m < GEMM_MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256();
  const float* x0 = xp + m0 * K + k0;
  const uint16_t* w0 = w + n0 * K + k0;
  for (int64_t k = 0; k < kc; k += 16) {
    __m256 xlo[GEMM_MR], xhi[GEMM_MR];  // loaded once for the NR weight rows
    for (int m = 0; m < GEMM_MR; ++m) {
      xlo[m] = _mm256_loadu_ps(x0 + m * K + k);
      xhi[m] = _mm256_loadu_ps(x0 + m * K + k + 8);
    }
    for (int n = 0; n < NR; ++n) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + n * K + k));
      const __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));  // weights k+0..3, k+8..11
      const __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));  // weights k+4..7, k+12..15
      for (int m = 0; m < GEMM_MR; ++m) {
        acc[m][n] = _mm256_fmadd_ps(lo, xlo[m], acc[m][n]);
        acc[m][n] = _mm256_fmadd_ps(hi, xhi[m], acc[m][n]);
      }
    }
  }
  for (int64_t m = 0; m < mr; ++m)
    for (int n = 0; n < NR; ++n) out[(m0 + m) * N + n0 + n] += hsum(acc[m][n]);
}

// items (rows, or blocks of inputs) per task when a prefill's activations are rounded or reordered on every core,
// each item holding `inputs`: at least 16K inputs a task, so a decode's few rows run inline
inline int64_t rounding_grain(int64_t inputs) { return std::max<int64_t>(1, 16384 / inputs); }

// x (M, K) -> (M rounded up to GEMM_MR, K), each 16 inputs in the interleave's order, padding rows zero
at::Tensor interleaved_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), Mp = (M + GEMM_MR - 1) / GEMM_MR * GEMM_MR;
  auto xp = at::empty({Mp, K}, x.options());
  const float* src = x.data_ptr<float>();
  float* dst = xp.data_ptr<float>();
  at::parallel_for(0, Mp, rounding_grain(K), [&](int64_t a, int64_t b) {
    for (int64_t m = a; m < b; ++m) {
      float* d = dst + m * K;
      if (m >= M) {
        std::fill(d, d + K, 0.0f);
        continue;
      }
      for (int64_t k = 0; k < K; k += 16) {
        const __m256 first = _mm256_loadu_ps(src + m * K + k), second = _mm256_loadu_ps(src + m * K + k + 8);
        _mm256_storeu_ps(d + k, _mm256_permute2f128_ps(first, second, 0x20));      // 0-3, 8-11
        _mm256_storeu_ps(d + k + 8, _mm256_permute2f128_ps(first, second, 0x31));  // 4-7, 12-15
      }
    }
  });
  return xp;
}

at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& w) {
  check(x, w, x.size(1));
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "weight must be bf16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 16 == 0, "bf16_gemm needs the input width to be a multiple of 16, got ", K);
  const at::Tensor xp = interleaved_rows(x);
  auto out = at::zeros({M, N}, x.options());
  const float* xd = xp.data_ptr<float>();
  const uint16_t* wd = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* o = out.data_ptr<float>();
  // at least 4 blocks a thread where the weight is short (a (256, 1536) projection: 3 blocks of 100 left one of
  // two cores idle a third of the time), in whole tiles
  const int64_t per = (N + 4 * at::get_num_threads() - 1) / (4 * at::get_num_threads());
  const int64_t nb = std::min(GEMM_NB, std::max<int64_t>(1, (per + GEMM_NR - 1) / GEMM_NR) * GEMM_NR);
  at::parallel_for(0, (N + nb - 1) / nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * nb, n1 = std::min(N, n0 + nb);
      for (int64_t k0 = 0; k0 < K; k0 += GEMM_KC) {
        const int64_t kc = std::min(GEMM_KC, K - k0);
        for (int64_t m0 = 0; m0 < M; m0 += GEMM_MR) {
          const int64_t mr = std::min<int64_t>(GEMM_MR, M - m0);
          int64_t n = n0;
          for (; n + GEMM_NR <= n1; n += GEMM_NR) gemm_tile<GEMM_NR>(xd, K, wd, k0, kc, o, N, m0, mr, n);
          for (; n < n1; ++n) gemm_tile<1>(xd, K, wd, k0, kc, o, N, m0, mr, n);
        }
      }
    }
  });
  return out;
}

// AVX-512 VNNI (run-time choice). These functions carry their own target attribute; the lambdas that
// call them (parallel_for) do not, so every intrinsic sits in an attributed function, never a lambda.
#define AVX512_VNNI __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")))

// ENGINE_LIB_CPU_ISA=avx2 (or set_isa("avx2")) keeps the AVX2 kernels on a CPU that has AVX-512 VNNI:
// tests run both paths and compare them, and the chapter can show what the wider one buys.
bool cpu_has_avx512_vnni() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  }();
  return has;
}

std::atomic<bool> avx2_forced{[] {
  const char* v = std::getenv("ENGINE_LIB_CPU_ISA");
  return v != nullptr && std::string(v) == "avx2";
}()};

bool use_avx512() { return cpu_has_avx512_vnni() && !avx2_forced.load(std::memory_order_relaxed); }

// The int8 kernel rounds the activations to 16-bit integers, one scale per block of B inputs (the
// largest of 128, 64, 32 dividing K), and multiplies them with the widened weights in integer
// arithmetic: vpmaddwd does 16 products and 8 pair sums in one instruction, where widening to fp32
// takes three per 8 weights. The rounding error is at most half a step of max|x| / 32767 per
// block, far below bf16's own (up to 2^-8 of each value): the sums match the fp32 matmul of the
// dequantized weights to about 1e-5 relative.
struct Activations {
  at::Tensor q;      // (M, K) int16
  at::Tensor scale;  // (M, K / B) fp32: x ~ q * scale
  // raw pointers, read once: data_ptr() checks the dtype on every call, too slow per block of rows
  const int16_t* qp = nullptr;
  const float* scalep = nullptr;
};

// The step that rounds a block of n activations to integers in [-levels, levels]: scale = max|x| /
// levels and its inverse. A NaN or an infinity has no integer: its block gets a NaN scale (and
// false back), so the sums it enters are NaN and the engine's check of the logits reports it, as a
// float matmul would. AVX2, 8 inputs at a time and scalar steps for a last few (the largest |x| is exact
// in any order). Against the scalar form (std::nearbyint per input), measured on a 2-core AVX2 host (AMD
// EPYC), builds interleaved: int8 products 10 to 13% faster at 1 and 36 rows, int4 0 to 6%. round8's
// vcvtps2dq rounds to nearest even under the default rounding mode, as nearbyint does.
inline bool block_step8(const float* xb, int64_t n, float levels, float& scale, float& inv) {
  const int64_t whole = n / 8 * 8;
  __m256 amax = _mm256_setzero_ps();
  __m256i bad = _mm256_setzero_si256();
  const __m256i exponent = _mm256_set1_epi32(0x7f800000);  // all ones: an infinity or a NaN
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256 v = _mm256_loadu_ps(xb + i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v, magnitude));
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), exponent), exponent));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  bool finite = _mm256_testz_si256(bad, bad);
  for (int64_t i = whole; i < n; ++i) {
    top = std::max(top, std::abs(xb[i]));
    finite = finite && std::isfinite(xb[i]);
  }
  scale = finite ? top / levels : NAN;
  inv = finite && top > 0.f ? levels / top : 0.f;
  return finite;
}

// 8 activations times inv, rounded to int32 (zero for a block that is not finite)
inline __m256i round8(const float* xb, float inv, bool finite) {
  return finite ? _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb), _mm256_set1_ps(inv))) : _mm256_setzero_si256();
}


inline int32_t level(float x, float inv, bool finite) {  // round8's step for one input
  return finite ? static_cast<int32_t>(std::nearbyint(x * inv)) : 0;
}

Activations quantize_activations(const at::Tensor& x, int64_t B) {
  const int64_t M = x.size(0), K = x.size(1), blocks = K / B;
  Activations a{at::empty({M, K}, x.options().dtype(at::kShort)), at::empty({M, blocks}, x.options())};
  const float* xp = x.data_ptr<float>();
  int16_t* qp = a.q.data_ptr<int16_t>();
  float* sp = a.scale.data_ptr<float>();
  // block j is inputs (j % blocks) * B.. of row j / blocks: a prefill's rows on every core (a decode's one
  // row, under the grain, runs inline)
  at::parallel_for(0, M * blocks, rounding_grain(B), [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const float* xb = xp + j * B;
      float scale, inv;
      const bool finite = block_step8(xb, B, 32767.f, scale, inv);
      int16_t* qb = qp + j * B;
      int64_t i = 0;
      for (; i + 8 <= B; i += 8) {
        const __m256i v = round8(xb + i, inv, finite);  // |v| <= 32767: the packing saturates nothing
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + i),
                         _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
      }
      for (; i < B; ++i) qb[i] = static_cast<int16_t>(level(xb[i], inv, finite));
      sp[j] = scale;
    }
  });
  a.qp = qp;
  a.scalep = sp;
  return a;
}

// The same rounding with AVX-512, 16 inputs at a time, for the AVX-512 kernels: every step is block_step8's
// and round8's (the largest |x| is exact in any order; x * inv is one fp32 product; vcvtps2dq rounds to
// nearest even), so the integers and scales are the same, bit for bit. n: a multiple of 16.
AVX512_VNNI inline bool block_step_512(const float* xb, int64_t n, float levels, float& scale, float& inv) {
  __m512 amax = _mm512_setzero_ps();
  __mmask16 bad = 0;
  const __m512i exponent = _mm512_set1_epi32(0x7f800000);  // all ones: an infinity or a NaN
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(xb + i);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), exponent), exponent);
  }
  const float top = _mm512_reduce_max_ps(amax);
  const bool finite = bad == 0;
  scale = finite ? top / levels : NAN;
  inv = finite && top > 0.f ? levels / top : 0.f;
  return finite;
}

// 16 activations times inv, rounded to int32 (zero for a block that is not finite)
AVX512_VNNI inline __m512i round16(const float* xb, float inv, bool finite) {
  return finite ? _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb), _mm512_set1_ps(inv))) : _mm512_setzero_si512();
}

// blocks j0..j1-1 (block j: inputs (j % blocks) * B.. of row j / blocks); its own function, since a lambda
// does not take the AVX-512 target of the function around it
AVX512_VNNI void round_blocks_512(const float* xp, int64_t B, int64_t j0, int64_t j1, int16_t* qp, float* sp) {
  for (int64_t j = j0; j < j1; ++j) {
    const float* xb = xp + j * B;
    float scale, inv;
    const bool finite = block_step_512(xb, B, 32767.f, scale, inv);
    int16_t* qb = qp + j * B;
    for (int64_t i = 0; i < B; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + i), _mm512_cvtepi32_epi16(round16(xb + i, inv, finite)));
    sp[j] = scale;
  }
}

Activations quantize_activations_512(const at::Tensor& x, int64_t B) {
  const int64_t M = x.size(0), K = x.size(1), blocks = K / B;
  Activations a{at::empty({M, K}, x.options().dtype(at::kShort)), at::empty({M, blocks}, x.options())};
  const float* xp = x.data_ptr<float>();
  int16_t* qp = a.q.data_ptr<int16_t>();
  float* sp = a.scale.data_ptr<float>();
  at::parallel_for(0, M * blocks, rounding_grain(B), [&](int64_t j0, int64_t j1) { round_blocks_512(xp, B, j0, j1, qp, sp); });
  a.qp = qp;
  a.scalep = sp;
  return a;
}

inline __m256i load16(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// int8 per output channel: out = (x @ q^T) * scales, for rows n0..n0+R-1 and activation rows m0..m0+MT-1
// (each weight vector widened once for MT rows; every sum's steps do not depend on MT, as in dot_tile)
template <int R, int MT>
inline void int8_tile(const int8_t* q, int64_t K, int64_t B, const Activations& a, int64_t m0, float* out, int64_t N,
                      int64_t n0, const float* scales) {
  const int64_t blocks = K / B;
  __m256 acc[MT][R];
  for (int i = 0; i < MT; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i isum[MT][R];
    for (int i = 0; i < MT; ++i)
      for (int r = 0; r < R; ++r) isum[i][r] = _mm256_setzero_si256();
    for (int64_t k = b * B; k < (b + 1) * B; k += 16) {
      for (int r = 0; r < R; ++r) {
        const int8_t* p = q + (n0 + r) * K + k;
        if (m0 == 0 && (k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_ROWS * K), _MM_HINT_T0);
        const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        for (int i = 0; i < MT; ++i)
          isum[i][r] = _mm256_add_epi32(isum[i][r], _mm256_madd_epi16(w, load16(a.qp + (m0 + i) * K + k)));
      }
    }
    for (int i = 0; i < MT; ++i) {
      const __m256 scale = _mm256_set1_ps(a.scalep[(m0 + i) * blocks + b]);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i][r]), scale, acc[i][r]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int r = 0; r < R; ++r) out[(m0 + i) * N + n0 + r] = hsum(acc[i][r]) * scales[n0 + r];
}

template <int R>
inline void int8_rows(const int8_t* q, int64_t K, int64_t B, const Activations& a, int64_t M, float* out, int64_t N,
                      int64_t n0, const float* scales) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) int8_tile<R, 2>(q, K, B, a, m, out, N, n0, scales);
  if (m < M) int8_tile<R, 1>(q, K, B, a, m, out, N, n0, scales);
}

// int8 with AVX-512 VNNI: vpdpwssd multiplies 32 int16 pairs and adds them into 16 int32 lanes in one
// instruction, where AVX2 needs vpmaddwd and vpaddd for 16; one vpmovsxbw widens 32 weights instead of 16.
// The sums are the AVX2 kernel's, bit for bit: lane j of the 512-bit sum covers the inputs k with
// k % 32 in {2j, 2j + 1}, so adding its upper half to its lower half gives AVX2's lane j (k % 16 in
// {2j, 2j + 1}) as the same int32; from there the float steps are AVX2's own. The rows ahead are
// prefetched into L2 (T1), not L1: on a 2-core AMX host that ran 1.17 to 1.20x the AVX2 kernel (cold
// weights of the real shapes), against 1.06 to 1.08x with AVX2's L1 prefetch (likely why: an L1
// prefetch holds one of L1's few fill buffers until its line arrives).
template <int R>
AVX512_VNNI void int8_rows_512(const int8_t* q, int64_t K, int64_t B, const Activations& a, int64_t M, float* out,
                               int64_t N, int64_t n0, const float* scales) {
  const int64_t blocks = K / B;
  for (int64_t m = 0; m < M; ++m) {
    const int16_t* xq = a.qp + m * K;
    const float* xs = a.scalep + m * blocks;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
      for (int64_t k = b * B; k < (b + 1) * B; k += 32) {
        const __m512i xv = _mm512_loadu_si512(xq + k);
        for (int r = 0; r < R; ++r) {
          const int8_t* p = q + (n0 + r) * K + k;
          if (m == 0 && (k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_ROWS * K), _MM_HINT_T1);
          const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
          isum[r] = _mm512_dpwssd_epi32(isum[r], w, xv);
        }
      }
      const __m256 scale = _mm256_set1_ps(xs[b]);
      for (int r = 0; r < R; ++r) {
        const __m256i s = _mm256_add_epi32(_mm512_castsi512_si256(isum[r]), _mm512_extracti64x4_epi64(isum[r], 1));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[m * N + n0 + r] = hsum(acc[r]) * scales[n0 + r];
  }
}

// The int8 and int4 kernels take a long prefill's activation rows KERNEL_CHUNK_ROWS at a time: each block of
// weight rows meets every row of a call, so the rounded rows of a whole call (int16 for int8, (rows, in)) would
// leave the caches: measured on a 2-core Zen 4 held to AVX2, one layer's four linears (the 1.5B shape) at 2,048
// rows took 1.17x the fp32 blocks' time in one call (int8), 0.80x (int4). Each row's sums are the same either way.
constexpr int64_t KERNEL_CHUNK_ROWS = 512;

template <typename F>
void by_row_chunks(int64_t M, F&& f) {
  for (int64_t c = 0; c < M; c += KERNEL_CHUNK_ROWS) f(c, std::min(KERNEL_CHUNK_ROWS, M - c));
}

int64_t block_for(int64_t K) {
  for (int64_t b : {128, 64, 32})
    if (K % b == 0) return b;
  return 0;
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  check(x, q, x.size(1));
  TORCH_CHECK(q.scalar_type() == at::kChar, "weight must be int8");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), B = block_for(K);
  TORCH_CHECK(B > 0, "int8_gemv needs in_features divisible by 32");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == N, "scales must be (N,)");
  const bool wide = use_avx512();  // read once: the rounding and the kernel of one call come from the same set
  auto a = wide ? quantize_activations_512(x, B) : quantize_activations(x, B);
  auto s = scales.to(at::kFloat).contiguous();
  auto out = at::empty({M, N}, x.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = N / ROWS;
  by_row_chunks(M, [&](int64_t c, int64_t mc) {
    Activations part = a;  // rows c.. of the rounded activations
    part.qp += c * K;
    part.scalep += c * (K / B);
    float* oc = op + c * N;
    if (wide) {
      at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) int8_rows_512<ROWS>(qp, K, B, part, mc, oc, N, b * ROWS, sp);
      });
      for (int64_t n = blocks * ROWS; n < N; ++n) int8_rows_512<1>(qp, K, B, part, mc, oc, N, n, sp);
      return;
    }
    at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) int8_rows<ROWS>(qp, K, B, part, mc, oc, N, b * ROWS, sp);
    });
    for (int64_t n = blocks * ROWS; n < N; ++n) int8_rows<1>(qp, K, B, part, mc, oc, N, n, sp);
  });
  return out;
}

// int4, two per byte (the even input in the low nibble), a scale and a zero per group of G inputs:
// w = (q - 8) * scale + zero. Per group, sum_k x_k w_k = scale * (sum x q) + (zero - 8 scale) * sum x.
// Here the activations are rounded to 8-bit integers, one scale per 32 inputs (as llama.cpp's
// Q8_0 does for its 4-bit dot products): vpmaddubsw multiplies 32 unsigned 4-bit weights with 32
// signed 8-bit activations and adds pairs in one instruction, twice the products of vpmaddwd,
// and the nibbles need no widening, only a mask and a shift. The rounding moves an activation by
// at most half a step of max|x| / 127 of its 32: on random rows the sums move by about 0.5% (in
// norm) of the dequantized matmul's, where the int4 weights themselves moved it by about 10%.
struct Activations8 {
  at::Tensor q;      // (M, K) int8, reordered per 64 inputs: the 32 even ones, then the 32 odd ones
                     // (a last 32 that fill no 64: its 16 even ones, then its 16 odd ones)
  at::Tensor scale;  // (M, K / 32) fp32: x ~ q * scale
  at::Tensor gsum;   // (M, K / G) fp32: the sum of the rounded activations of each weight group
  const int8_t* qp = nullptr;
  const float* scalep = nullptr;
  const float* gsump = nullptr;
};

// the tensors for x's rounding (the group sums start at zero) and their read pointers
Activations8 activations8_for(const at::Tensor& x, int64_t G) {
  const int64_t M = x.size(0), K = x.size(1);
  Activations8 a{at::empty({M, K}, x.options().dtype(at::kChar)), at::empty({M, K / 32}, x.options()),
                 at::zeros({M, K / G}, x.options())};
  a.qp = a.q.data_ptr<int8_t>();
  a.scalep = a.scale.data_ptr<float>();
  a.gsump = a.gsum.data_ptr<float>();
  return a;
}

Activations8 quantize_activations8(const at::Tensor& x, int64_t G) {
  const int64_t M = x.size(0), K = x.size(1), blocks = K / 32, groups = K / G;
  Activations8 a = activations8_for(x, G);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = a.q.data_ptr<int8_t>();
  float *sp = a.scale.data_ptr<float>(), *gp = a.gsum.data_ptr<float>();
  const int64_t full = K / 64 * 64;  // inputs in whole 64s
  at::parallel_for(0, M, rounding_grain(K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = xp + m * K + b * 32;
        float scale, inv;
        const bool finite = block_step8(xb, 32, 127.f, scale, inv);
        alignas(32) int32_t v[32];
        __m256i sum = _mm256_setzero_si256();
        for (int64_t i = 0; i < 32; i += 8) {
          const __m256i r = round8(xb + i, inv, finite);
          _mm256_store_si256(reinterpret_cast<__m256i*>(v + i), r);
          sum = _mm256_add_epi32(sum, r);
        }
        const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
        const int64_t total = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
        // input 2j of a 64 goes to j, input 2j + 1 to 32 + j (a last 32: to j and 16 + j)
        const int64_t first = b * 32, base = first < full ? first / 64 * 64 : full, span = first < full ? 32 : 16;
        int8_t* q = qp + m * K + base;
        for (int64_t i = 0, j = first - base; i < 32; ++i, ++j) q[(j % 2) * span + j / 2] = static_cast<int8_t>(v[i]);
        sp[m * blocks + b] = scale;
        gp[m * groups + b * 32 / G] += static_cast<float>(total) * scale;
      }
    }
  });
  return a;
}

AVX512_VNNI inline void store(int8_t* p, __m512i v) {  // 16 int32 in [-127, 127] -> 16 bytes
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v));
}

// quantize_activations8_512's rows m0..m1-1 (a function of its own for the AVX-512 target, as round_blocks_512)
AVX512_VNNI void round_rows8_512(const float* xp, int64_t K, int64_t G, int64_t m0, int64_t m1, int8_t* qp,
                                 float* sp, float* gp) {
  const int64_t blocks = K / 32, groups = K / G;
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t m = m0; m < m1; ++m) {
    __m512i v[4];  // the int32 levels of up to 64 inputs, in order
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = xp + m * K + b * 32;
      float scale, inv;
      const bool finite = block_step_512(xb, 32, 127.f, scale, inv);
      __m512i* vb = v + 2 * (b % 2);
      vb[0] = round16(xb, inv, finite);
      vb[1] = round16(xb + 16, inv, finite);
      sp[m * blocks + b] = scale;
      gp[m * groups + b * 32 / G] += static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(vb[0], vb[1]))) * scale;
      int8_t* q = qp + m * K + (b & ~int64_t{1}) * 32;  // where this 64 (or a last 32) starts
      if (b % 2 == 1) {  // a whole 64: its 32 even inputs, then its 32 odd ones
        store(q, _mm512_permutex2var_epi32(v[0], even, v[1]));
        store(q + 16, _mm512_permutex2var_epi32(v[2], even, v[3]));
        store(q + 32, _mm512_permutex2var_epi32(v[0], odd, v[1]));
        store(q + 48, _mm512_permutex2var_epi32(v[2], odd, v[3]));
      } else if (b == blocks - 1) {  // a last 32 that fills no 64: its 16 even inputs, then its 16 odd ones
        store(q, _mm512_permutex2var_epi32(v[0], even, v[1]));
        store(q + 16, _mm512_permutex2var_epi32(v[0], odd, v[1]));
      }
    }
  }
}

// The same with AVX-512 (the scalar steps, as quantize_activations_512): 32 inputs per scale, and the
// even/odd order per 64 made by two-source permutes of the int32 lanes before they are narrowed to bytes.
Activations8 quantize_activations8_512(const at::Tensor& x, int64_t G) {
  const int64_t M = x.size(0), K = x.size(1);
  Activations8 a = activations8_for(x, G);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = a.q.data_ptr<int8_t>();
  float *sp = a.scale.data_ptr<float>(), *gp = a.gsum.data_ptr<float>();
  at::parallel_for(0, M, rounding_grain(K), [&](int64_t m0, int64_t m1) { round_rows8_512(xp, K, G, m0, m1, qp, sp, gp); });
  return a;
}

inline float as_float(float v) { return v; }
inline float as_float(at::BFloat16 v) { return static_cast<float>(v); }

// 64 weights of one row (32 bytes) against 64 reordered activations: 8 int32 lanes, the first
// four summing the first 32 inputs, the last four the next 32
inline void nibbles(const uint8_t* p, __m256i nib, __m256i& lo, __m256i& hi) {  // 32 bytes -> the even inputs, the odd
  const __m256i b = load16(p);
  lo = _mm256_and_si256(b, nib);
  hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
}
inline __m256i dot_nibbles(__m256i lo, __m256i hi, __m256i xe, __m256i xo, __m256i ones) {
  // each 16-bit lane: two products of at most 15 * 127, then two such lanes: fits in 16 bits
  const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
  return _mm256_madd_epi16(s16, ones);
}
inline __m256i dot64(const uint8_t* p, __m256i xe, __m256i xo, __m256i nib, __m256i ones) {
  __m256i lo, hi;
  nibbles(p, nib, lo, hi);
  return dot_nibbles(lo, hi, xe, xo, ones);
}

// the last 32 weights of a row whose K is 32 past a multiple of 64: every lane sums the same 32 inputs
inline __m256i dot32(const uint8_t* p, __m256i x, __m256i nib, __m256i ones) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), nib);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
}

// four weight rows' scales and zeros of one group, (scale, zero) pairs as 8 fp32 lanes: s0 z0 s1 z1 s2 z2 s3 z3
inline __m256 load_pairs4(const float* s) { return _mm256_loadu_ps(s); }
inline __m256 load_pairs4(const at::BFloat16* s) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))), 16));
}

// The zero points' share of R weight rows' sums with one activation row: (zero - 8 scale) * the group's sum of
// activations, summed over the groups. Four rows take one vector (even lanes) where they were four scalar
// loops: on a 2-core Zen 4 held to AVX2, the scalar form took about a third of a 35-row int4 prefill's kernel
// time. Each lane takes the steps GCC gives the scalar form (an fnmadd, then an fma): the int4 sums matched the
// scalar form's bit for bit at 1 to 35 rows. A weight row takes the same form whatever the call's rows.
template <int R, typename S>
inline void zero_terms(const S* sz, int64_t N, int64_t n0, const float* gsum, int64_t groups, float* offset) {
  if constexpr (R == 4) {
    __m256 off = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 v = load_pairs4(sz + (g * N + n0) * 2);  // s0 z0 s1 z1 s2 z2 s3 z3
      const __m256 z = _mm256_castsi256_ps(_mm256_srli_epi64(_mm256_castps_si256(v), 32));  // z0 0 z1 0 ...
      off = _mm256_fmadd_ps(_mm256_fnmadd_ps(_mm256_set1_ps(8.f), v, z), _mm256_set1_ps(gsum[g]), off);
    }
    alignas(32) float o[8];
    _mm256_store_ps(o, off);
    for (int r = 0; r < R; ++r) offset[r] = o[2 * r];
  } else {
    for (int r = 0; r < R; ++r) {
      offset[r] = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const S* s = sz + (g * N + n0 + r) * 2;
        offset[r] += (as_float(s[1]) - 8.0f * as_float(s[0])) * gsum[g];
      }
    }
  }
}

// int4, groups of whole 64s (the real model's 128), for weight rows n0..n0+R-1 and activation rows
// m0..m0+MT-1: each 64 weights of a row are loaded and split into nibbles once for the MT rows. A group's
// 64s are summed in lanes, then its scale is applied once; every (row, weight row) sum takes the same steps
// in the same order whatever MT is, so a row's result does not depend on the rows beside it, bit for bit.
template <int R, int MT, typename S>
inline void int4_tile(const uint8_t* q, const S* sz, int64_t N, int64_t K, int64_t G, const Activations8& a,
                      int64_t m0, float* out, int64_t n0) {
  const int64_t groups = K / G, half = K / 2;
  const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 acc[MT][R];  // the scaled sums, kept in lanes until the end
  for (int t = 0; t < MT; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 part[MT][R];
    for (int t = 0; t < MT; ++t)
      for (int r = 0; r < R; ++r) part[t][r] = _mm256_setzero_ps();
    for (int64_t k = g * G; k < (g + 1) * G; k += 64) {
      __m256 sx[MT];
      for (int t = 0; t < MT; ++t) {
        const float* xs = a.scalep + (m0 + t) * (K / 32) + k / 32;
        sx[t] = _mm256_set_m128(_mm_set1_ps(xs[1]), _mm_set1_ps(xs[0]));
      }
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = q + (n0 + r) * half + k / 2;
        if (m0 == 0 && (k & 127) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_ROWS * half), _MM_HINT_T0);
        __m256i lo, hi;
        nibbles(p, nib, lo, hi);
        for (int t = 0; t < MT; ++t) {
          const int8_t* xq = a.qp + (m0 + t) * K + k;
          const __m256i d = dot_nibbles(lo, hi, load16(xq), load16(xq + 32), ones);
          part[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sx[t], part[t][r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_set1_ps(as_float(sz[(g * N + n0 + r) * 2]));  // (groups, N, 2): scale, zero
      for (int t = 0; t < MT; ++t) acc[t][r] = _mm256_fmadd_ps(part[t][r], scale, acc[t][r]);
    }
  }
  for (int t = 0; t < MT; ++t) {
    float offset[R];
    zero_terms<R>(sz, N, n0, a.gsump + (m0 + t) * groups, groups, offset);
    for (int r = 0; r < R; ++r) out[(m0 + t) * N + n0 + r] = hsum(acc[t][r]) + offset[r];
  }
}

// groups of 32, 96, ...: a 64 may span two groups, one scale per half of the lanes; one activation row m
template <int R, typename S>
inline void int4_row_spanning(const uint8_t* q, const S* sz, int64_t N, int64_t K, int64_t G, const Activations8& a,
                              int64_t m, float* out, int64_t n0) {
  const int64_t groups = K / G, half = K / 2, full = K / 64 * 64;
  const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const int8_t* xq = a.qp + m * K;
  const float* xs = a.scalep + m * (K / 32);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 64) {
    const bool tail = k == full;  // the last 32 of a K that is 32 past a multiple of 64
    const __m256i xe = load16(xq + k), xo = tail ? xe : load16(xq + k + 32);
    const int64_t b = k / 32, b2 = tail ? b : b + 1;  // the activations' 32s
    const int64_t ga = k / G, gb = (b2 * 32) / G;  // the weights' groups
    const __m256 sx = _mm256_set_m128(_mm_set1_ps(xs[b2]), _mm_set1_ps(xs[b]));
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = q + (n0 + r) * half + k / 2;
      if (m == 0 && (k & 127) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_ROWS * half), _MM_HINT_T0);
      const __m256i d = tail ? dot32(p, xe, nib, ones) : dot64(p, xe, xo, nib, ones);
      const __m256 ws = _mm256_set_m128(_mm_set1_ps(as_float(sz[(gb * N + n0 + r) * 2])),
                                        _mm_set1_ps(as_float(sz[(ga * N + n0 + r) * 2])));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(sx, ws), acc[r]);
    }
  }
  float offset[R];
  zero_terms<R>(sz, N, n0, a.gsump + m * groups, groups, offset);
  for (int r = 0; r < R; ++r) out[m * N + n0 + r] = hsum(acc[r]) + offset[r];
}

// Activation rows two at a time where groups are whole 64s. Measured on a 2-core Zen 4 held to AVX2, the
// 1.5B shape's (8960, 1536), (1536, 8960) and (2048, 1536) int4 layers (groups of 128) at 35 rows, medians
// of 15 interleaved, kernel time: pairs with the four-row zero terms 0.62 to 0.75 of the time of one row at
// a time with scalar zero terms (the form before), one row with the four-row terms 0.71 to 0.87; tiles of
// 3 rows no faster than pairs.
template <int R, typename S>
inline void int4_rows(const uint8_t* q, const S* sz, int64_t N, int64_t K, int64_t G, const Activations8& a,
                      int64_t M, float* out, int64_t n0) {
  if (G % 64 != 0) {
    for (int64_t m = 0; m < M; ++m) int4_row_spanning<R>(q, sz, N, K, G, a, m, out, n0);
    return;
  }
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) int4_tile<R, 2>(q, sz, N, K, G, a, m, out, n0);
  if (m < M) int4_tile<R, 1>(q, sz, N, K, G, a, m, out, n0);
}

// int4 with AVX-512 VNNI, for groups that are whole 64s (the real model's 128): vpdpbusd multiplies 64
// unsigned 4-bit weights with 64 signed 8-bit activations and adds each four into an int32 lane, where
// AVX2 takes vpmaddubsw, vpaddw and vpmaddwd for half as many. 128 inputs per step: the 16 lanes hold the
// integer sums of four 32s, each turned to float and scaled by its activation scale times its group's
// weight scale in one multiply and one fma; the zero-point terms are summed for the four rows at once.
// The weights stream from memory, and on a 2-core AMX host the instructions per byte set how much of
// that stream the kernel keeps busy: this form ran 1.16 to 1.29x the AVX2 kernel at the model's shapes
// (cold weights), where an AVX-512 form that kept AVX2's order of float operations (bit for bit AVX2's
// sums) ran 1.00 to 1.14x. The sums are AVX2's integers and scales added in another order: within fp32
// rounding of AVX2's (the rounded activations are the same, bit for bit).
// A last 64 of K (K 64 past a multiple of 128) takes the 256-bit form of the same instruction.
AVX512_VNNI inline __m512 bcast_scale(const float* s) { return _mm512_set1_ps(*s); }
AVX512_VNNI inline __m512 bcast_scale(const at::BFloat16* s) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_set1_epi16(reinterpret_cast<const int16_t&>(*s)), 16));
}

// Activation rows are taken four at a time (a last 3, 2 or 1 together): each 128 weights of a row are
// loaded and split into nibbles once for the tile, where the unpacking (a load, a shift and two masks)
// cost nearly as much as a row's own products (two vpdpbusd, a convert, a multiply and an fma). Measured
// on a 2-core AVX-512 host without AMX (AMD EPYC, Zen 4), the model's four int4 weight shapes (warm, groups
// of 128), interleaved medians of 15 against one row at a time: 1.19 to 1.43x at 8 rows, 1.25 to 1.41x at 35; tiles
// of 3 were as fast or slower. Every (row, weight row) sum takes the same steps in the same order whatever
// the tile, so a row's result does not depend on the rows beside it, bit for bit.
template <int R, int MT, typename S>
AVX512_VNNI void int4_tile_512(const uint8_t* q, const S* sz, int64_t N, int64_t K, int64_t G, const Activations8& a,
                               int64_t m0, float* out, int64_t n0) {
  const int64_t groups = K / G, half = K / 2, K128 = K / 128 * 128;
  const __m512i nib = _mm512_set1_epi8(15);
  const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  __m512 acc[MT][R], ws[R];
  for (int t = 0; t < MT; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K128; k += 128) {
    if (k % G == 0 || G % 128 != 0) {  // the weight scales: per group, or per half of the lanes
      const int64_t ga = k / G, gb = (k + 64) / G;
      for (int r = 0; r < R; ++r) {
        ws[r] = bcast_scale(sz + (ga * N + n0 + r) * 2);
        if (gb != ga)
          ws[r] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(ws[r]),
                      _mm256_castps_pd(_mm512_castps512_ps256(bcast_scale(sz + (gb * N + n0 + r) * 2))), 1));
      }
    }
    __m512i xe[MT], xo[MT];
    __m512 sx[MT];
    for (int t = 0; t < MT; ++t) {
      const int8_t* xq = a.qp + (m0 + t) * K;
      xe[t] = _mm512_inserti64x4(_mm512_castsi256_si512(load16(xq + k)), load16(xq + k + 64), 1);
      xo[t] = _mm512_inserti64x4(_mm512_castsi256_si512(load16(xq + k + 32)), load16(xq + k + 96), 1);
      sx[t] = _mm512_permutexvar_ps(quarter, _mm512_castps128_ps512(_mm_loadu_ps(a.scalep + (m0 + t) * (K / 32) + k / 32)));
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = q + (n0 + r) * half + k / 2;
      if (m0 == 0) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_ROWS * half), _MM_HINT_T1);
      const __m512i b = _mm512_loadu_si512(p);
      const __m512i lo = _mm512_and_si512(b, nib), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), nib);
      for (int t = 0; t < MT; ++t) {
        const __m512 d = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe[t]), hi, xo[t]));
        acc[t][r] = _mm512_fmadd_ps(d, _mm512_mul_ps(sx[t], ws[r]), acc[t][r]);
      }
    }
  }
  for (int t = 0; t < MT; ++t) {
    const int64_t m = m0 + t;
    const int8_t* xq = a.qp + m * K;
    const float* xs = a.scalep + m * (K / 32);
    float tail[R] = {};
    if (K128 < K) {  // a last 64 (K = 64 past a multiple of 128): the 256-bit form
      const int64_t k = K128, g = k / G;
      const __m256i nib256 = _mm256_set1_epi8(15);
      const __m256i xe = load16(xq + k), xo = load16(xq + k + 32);
      const __m256 sx = _mm256_set_m128(_mm_set1_ps(xs[k / 32 + 1]), _mm_set1_ps(xs[k / 32]));
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = q + (n0 + r) * half + k / 2;
        const __m256i b = load16(p);
        const __m256i lo = _mm256_and_si256(b, nib256), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib256);
        const __m256i d = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xe), hi, xo);
        tail[r] = hsum(_mm256_mul_ps(_mm256_cvtepi32_ps(d), sx)) * as_float(sz[(g * N + n0 + r) * 2]);
      }
    }
    float offset[R];
    zero_terms<R>(sz, N, n0, a.gsump + m * groups, groups, offset);
    for (int r = 0; r < R; ++r) out[m * N + n0 + r] = _mm512_reduce_add_ps(acc[t][r]) + tail[r] + offset[r];
  }
}

template <int R, typename S>
AVX512_VNNI void int4_rows_512(const uint8_t* q, const S* sz, int64_t N, int64_t K, int64_t G, const Activations8& a,
                                int64_t M, float* out, int64_t n0) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) int4_tile_512<R, 4>(q, sz, N, K, G, a, m, out, n0);
  if (M - m == 3) int4_tile_512<R, 3>(q, sz, N, K, G, a, m, out, n0);
  if (M - m == 2) int4_tile_512<R, 2>(q, sz, N, K, G, a, m, out, n0);
  if (M - m == 1) int4_tile_512<R, 1>(q, sz, N, K, G, a, m, out, n0);
}

void check_int4(const at::Tensor& q, const at::Tensor& sz, int64_t K, int64_t G) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.size(1) * 2 == K, "weight must be (N, K / 2) contiguous");
  TORCH_CHECK(q.scalar_type() == at::kByte, "weight must be uint8 (two int4 per byte)");
  TORCH_CHECK(G % 32 == 0 && K % G == 0, "group size must be a multiple of 32 dividing K");
  TORCH_CHECK(sz.dim() == 3 && sz.size(0) == K / G && sz.size(1) == q.size(0) && sz.size(2) == 2 && sz.is_contiguous(),
              "scales_and_zeros must be (K / G, N, 2) contiguous");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 || sz.scalar_type() == at::kFloat, "scales must be bf16 or fp32");
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales_and_zeros, int64_t G) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  check(x, q, K / 2);
  check_int4(q, scales_and_zeros, K, G);
  const bool wide = use_avx512();  // read once, as in int8_gemv
  auto a = wide ? quantize_activations8_512(x, G) : quantize_activations8(x, G);
  auto out = at::empty({M, N}, x.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = N / ROWS;
  auto run = [&](auto* szp, const Activations8& part, int64_t mc, float* oc) {
    if (wide && G % 64 == 0) {  // groups of 32, 96, ...: the AVX2 kernel (after the AVX-512 rounding)
      at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) int4_rows_512<ROWS>(qp, szp, N, K, G, part, mc, oc, b * ROWS);
      });
      for (int64_t n = blocks * ROWS; n < N; ++n) int4_rows_512<1>(qp, szp, N, K, G, part, mc, oc, n);
      return;
    }
    at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) int4_rows<ROWS>(qp, szp, N, K, G, part, mc, oc, b * ROWS);
    });
    for (int64_t n = blocks * ROWS; n < N; ++n) int4_rows<1>(qp, szp, N, K, G, part, mc, oc, n);
  };
  by_row_chunks(M, [&](int64_t c, int64_t mc) {
    Activations8 part = a;  // rows c.. of the rounded activations
    part.qp += c * K;
    part.scalep += c * (K / 32);
    part.gsump += c * (K / G);
    if (scales_and_zeros.scalar_type() == at::kFloat) run(scales_and_zeros.data_ptr<float>(), part, mc, op + c * N);
    else run(scales_and_zeros.data_ptr<at::BFloat16>(), part, mc, op + c * N);
  });
  return out;
}

// 16 int4 values (8 bytes) -> 16 fp32 values w = q * s + z (z already holds zero - 8 scale), in order
inline void dequantize16(const uint8_t* p, __m256 s, __m256 z, __m256& first, __m256& second) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), nib = _mm_set1_epi8(15);
  // the low nibble of byte j is input 2j, the high one 2j + 1: interleaving the two puts them in order
  const __m128i v = _mm_unpacklo_epi8(_mm_and_si128(b, nib), _mm_and_si128(_mm_srli_epi16(b, 4), nib));
  first = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), s, z);
  second = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))), s, z);
}

inline void store8(float* o, __m256 v) { _mm256_storeu_ps(o, v); }

// fp32 -> bf16, rounded to nearest even (finite values: these are weights)
inline void store8(at::BFloat16* o, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), packed);
}

// The same with AVX-512, 32 values per step: the 16 bytes widened to 16 lanes, each lane's two nibbles
// set side by side as two 16-bit values (the inputs in order), widened again to two sets of 16. The
// arithmetic and the rounding to bf16 are the AVX2 steps, so the values are the same, bit for bit; measured
// on a 2-core AMX host, the AVX2 form took 40% of an int4 prefill (35 tokens, 4-layer checkpoint).
AVX512_VNNI inline void dequantize32(const uint8_t* p, __m512 s, __m512 z, __m512& first, __m512& second) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i pairs = _mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi32(15)),
                                        _mm512_slli_epi32(_mm512_srli_epi32(b, 4), 16));
  first = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(pairs))), s, z);
  second = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(pairs, 1))), s, z);
}

AVX512_VNNI inline void store16(float* o, __m512 v) { _mm512_storeu_ps(o, v); }

AVX512_VNNI inline void store16(at::BFloat16* o, __m512 v) {  // store8's rounding to nearest even, 16 at a time
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(r));
}

template <typename S, typename O>
AVX512_VNNI void dequantize_rows_512(const uint8_t* qp, const S* sz, int64_t N, int64_t K, int64_t G, int64_t a,
                                     int64_t r0, int64_t r1, O* op) {
  for (int64_t n = r0; n < r1; ++n) {
    O* o = op + (n - a) * K;
    const uint8_t* p = qp + n * (K / 2);
    for (int64_t g = 0; g < K / G; ++g) {
      const float scale = as_float(sz[(g * N + n) * 2]), zero = as_float(sz[(g * N + n) * 2 + 1]) - 8.0f * scale;
      const __m512 s = _mm512_set1_ps(scale), z = _mm512_set1_ps(zero);
      for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
        __m512 first, second;
        dequantize32(p + k / 2, s, z, first, second);
        store16(o + k, first);
        store16(o + k + 16, second);
      }
    }
  }
}

// rows a..b-1 of an int4 weight, dequantized into out (b - a, K), fp32 (a prefill's fp32 block on a
// CPU without bf16 instructions) or bf16 (for the half GEMM of a CPU that has them: AMX, AVX-512 BF16)
void int4_dequantize(const at::Tensor& q, const at::Tensor& scales_and_zeros, int64_t G, int64_t a, int64_t b,
                     at::Tensor out) {
  const int64_t N = q.size(0), K = q.size(1) * 2;
  check_int4(q, scales_and_zeros, K, G);
  TORCH_CHECK(0 <= a && a <= b && b <= N, "rows out of range");
  TORCH_CHECK((out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16) && out.is_contiguous() &&
              out.numel() == (b - a) * K, "out must be fp32 or bf16 (b - a, K), contiguous");
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const bool wide = use_avx512();
  auto run = [&](auto* sz, auto* op) {
    at::parallel_for(a, b, 8, [&](int64_t r0, int64_t r1) {
      if (wide) {
        dequantize_rows_512(qp, sz, N, K, G, a, r0, r1, op);
        return;
      }
      for (int64_t n = r0; n < r1; ++n) {
        auto* o = op + (n - a) * K;
        const uint8_t* p = qp + n * (K / 2);
        for (int64_t g = 0; g < K / G; ++g) {
          const float scale = as_float(sz[(g * N + n) * 2]), zero = as_float(sz[(g * N + n) * 2 + 1]) - 8.0f * scale;
          const __m256 s = _mm256_set1_ps(scale), z = _mm256_set1_ps(zero);
          for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
            __m256 first, second;
            dequantize16(p + k / 2, s, z, first, second);
            store8(o + k, first);
            store8(o + k + 8, second);
          }
        }
      }
    });
  };
  auto with_out = [&](auto* sz) {
    if (out.scalar_type() == at::kFloat) run(sz, out.data_ptr<float>());
    else run(sz, out.data_ptr<at::BFloat16>());
  };
  if (scales_and_zeros.scalar_type() == at::kFloat) with_out(scales_and_zeros.data_ptr<float>());
  else with_out(scales_and_zeros.data_ptr<at::BFloat16>());
}

// Prefills of a few rows with int8 weights, on a CPU with an int8 matrix unit (AMX): the rows are written
// as 24-bit integers, one scale per row (x ~ scale * (65536 hi + 256 mid + lo), each part an int8), so that
// one int8 x int8 -> int32 GEMM (torch._int_mm, oneDNN) of the 3M rows of parts with the int8 weight gives
// exact integer sums, combined here in fp32. 23 bits per row's largest value hold every bf16 activation
// within 2^15 of it exactly, so a massive activation (Qwen's rows reach 1e4 times their typical value)
// costs the rest of its row nothing; the error is fp32 rounding. The integer sums do not depend on the
// GEMM's blocking, so a row's result does not depend on the other rows in the call.
constexpr float INT24_LEVELS = 8355711.f;  // 0x7F7F7F: 127 * 65536 + 127 * 256 + 127

// 8 int32 in [-128, 127] -> 8 bytes
inline void store_bytes8(int8_t* p, __m256i v) {
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
}

// the low byte of v as a signed value, and (v - it) / 256
inline __m256i low_byte(__m256i v, __m256i& rest) {
  const __m256i b = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(v, _mm256_set1_epi32(128)),
                                                      _mm256_set1_epi32(255)), _mm256_set1_epi32(128));
  rest = _mm256_srai_epi32(_mm256_sub_epi32(v, b), 8);
  return b;
}

void int24_row(const float* x, int64_t K, int8_t* hi, int8_t* mid, int8_t* lo, float& scale) {
  // the largest |x| and whether all are finite, as block_step8 decides them
  __m256 amax = _mm256_setzero_ps();
  __m256i bad = _mm256_setzero_si256();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i exponent = _mm256_set1_epi32(0x7f800000);
  const int64_t K8 = K / 8 * 8;
  for (int64_t k = 0; k < K8; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v, abs_mask));
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), exponent), exponent));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  float top = *std::max_element(lanes, lanes + 8);
  bool finite = _mm256_testz_si256(bad, bad);
  for (int64_t k = K8; k < K; ++k) {
    top = std::max(top, std::abs(x[k]));
    finite = finite && std::isfinite(x[k]);
  }
  if (!finite || top == 0.f) {  // NaN: the row's sums come out NaN (as block_step8); zero: zero
    std::fill(hi, hi + K, 0), std::fill(mid, mid + K, 0), std::fill(lo, lo + K, 0);
    scale = finite ? 0.f : NAN;
    return;
  }
  scale = top / INT24_LEVELS;
  const float inv = INT24_LEVELS / top;
  const __m256i most = _mm256_set1_epi32(0x7F7F7F), least = _mm256_set1_epi32(-0x7F7F7F);
  for (int64_t k = 0; k < K8; k += 8) {
    __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), _mm256_set1_ps(inv)));
    q = _mm256_min_epi32(_mm256_max_epi32(q, least), most);  // x * inv may round one past the range
    __m256i r1, r2;
    store_bytes8(lo + k, low_byte(q, r1));
    store_bytes8(mid + k, low_byte(r1, r2));
    store_bytes8(hi + k, r2);
  }
  for (int64_t k = K8; k < K; ++k) {
    const int32_t q = std::clamp(static_cast<int32_t>(std::nearbyint(x[k] * inv)), -0x7F7F7F, 0x7F7F7F);
    const int32_t l = ((q + 128) & 255) - 128, r = (q - l) >> 8, m = ((r + 128) & 255) - 128;
    lo[k] = static_cast<int8_t>(l), mid[k] = static_cast<int8_t>(m), hi[k] = static_cast<int8_t>((r - m) >> 8);
  }
}

// x (M, K) -> the parts (3M, K) int8: rows 0..M-1 the high bytes, then the middle ones, then the low ones;
// and the scale of each row (M,) fp32
std::tuple<at::Tensor, at::Tensor> int24_split(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu(), "x must be (M, K) on the CPU");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto parts = at::empty({3 * M, K}, x.options().dtype(at::kChar));
  auto scale = at::empty({M}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* pp = parts.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      int24_row(xp + m * K, K, pp + m * K, pp + (M + m) * K, pp + (2 * M + m) * K, sp[m]);
  });
  return {parts, scale};
}

// the int32 sums (3M, N) of the parts -> out (M, N) fp32: (65536 hi + 256 mid + lo) * row scale * column scale
at::Tensor int24_combine(const at::Tensor& sums, const at::Tensor& scale, const at::Tensor& col_scales) {
  const int64_t M = scale.size(0), N = sums.size(1);
  TORCH_CHECK(sums.dim() == 2 && sums.scalar_type() == at::kInt && sums.is_contiguous() && sums.size(0) == 3 * M,
              "sums must be (3M, N) int32 contiguous");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "scale must be (M,) fp32");
  TORCH_CHECK(col_scales.dim() == 1 && col_scales.size(0) == N && col_scales.scalar_type() == at::kFloat &&
              col_scales.is_contiguous(), "col_scales must be (N,) fp32");
  auto out = at::empty({M, N}, scale.options());
  const int32_t* rp = sums.data_ptr<int32_t>();
  const float *sp = scale.data_ptr<float>(), *cp = col_scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t N8 = N / 8 * 8;
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int32_t *h = rp + m * N, *md = rp + (M + m) * N, *l = rp + (2 * M + m) * N;
      const __m256 s = _mm256_set1_ps(sp[m]);
      auto cvt = [](const int32_t* p) { return _mm256_cvtepi32_ps(load16(p)); };
      for (int64_t n = 0; n < N8; n += 8) {
        const __m256 v = _mm256_fmadd_ps(cvt(h + n), _mm256_set1_ps(65536.f),
                                         _mm256_fmadd_ps(cvt(md + n), _mm256_set1_ps(256.f), cvt(l + n)));
        _mm256_storeu_ps(op + m * N + n, _mm256_mul_ps(v, _mm256_mul_ps(s, _mm256_loadu_ps(cp + n))));
      }
      for (int64_t n = N8; n < N; ++n)
        op[m * N + n] = (65536.f * h[n] + 256.f * md[n] + l[n]) * (sp[m] * cp[n]);
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------
// int8 weights packed once into AMX tiles, for CPUs with AMX (Intel Xeon from Sapphire Rapids on).
//
// PyTorch's int8 GEMM (torch._int_mm, oneDNN) rearranges the whole weight into the matrix unit's tile
// layout on every call, so a prefill spent more time rearranging than multiplying. Here the weight is
// stored in that layout once, at load time, in place of the plain one (no second copy): tile (nb, kb)
// holds output columns nb*16..+15 and inputs kb*64..+63 as 16 rows of 64 bytes, row r holding, for each
// of the 16 columns, the 4 inputs kb*64 + 4r..+3 (P[nb][kb][r][c][j] = W[nb*16 + c][kb*64 + 4r + j]).
// Activations are the 24-bit rows of int24_split: the integer sums are exact, whichever kernel makes them.
// - many rows (a prefill, a batch): AMX, `tdpbssd` on 32 x 32 blocks of the output;
// - one row (a decode step): AVX-512 VNNI reads the same tiles, `vpdpbusd` on each 64-byte row gives 16
//   columns' sums at once; it wants unsigned activations, so it adds 128 to each and takes 128 times the
//   column's sum of weights off at the end.

#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define ENGINE_LIB_AMX 1
#define AMX_TARGET __attribute__((target("amx-tile,amx-int8,avx512f")))
#endif

constexpr int64_t TILE_BYTES = 1024;
// the one-row kernel reads this many column blocks side by side: on a 2-core AMX host, one stream per thread
// read the LM head's tiles at 18-21 GB/s, four at 26 GB/s (the plain int8 kernel: 23 GB/s)
constexpr int VNNI_STREAMS = 4;

// W (N, K) int8 -> (the packed tiles (N/16, K/64, 16, 16, 4), the column sums (N,) int32)
std::tuple<at::Tensor, at::Tensor> int8_tiles_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() && w.device().is_cpu(),
              "w must be a contiguous (N, K) int8 CPU tensor");
  const int64_t N = w.size(0), K = w.size(1), KB = K / 64;
  TORCH_CHECK(N % 32 == 0 && K % 64 == 0, "AMX tiles need N % 32 == 0 and K % 64 == 0, got ", N, " x ", K);
  auto packed = at::empty({N / 16, KB, 16, 16, 4}, w.options());
  auto colsum = at::empty({N}, w.options().dtype(at::kInt));
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* cs = colsum.data_ptr<int32_t>();
  at::parallel_for(0, N / 16, 1, [&](int64_t a, int64_t b) {
    for (int64_t nb = a; nb < b; ++nb) {
      for (int64_t kb = 0; kb < KB; ++kb) {
        int8_t* t = dst + (nb * KB + kb) * TILE_BYTES;
        for (int r = 0; r < 16; ++r)
          for (int c = 0; c < 16; ++c) std::memcpy(t + r * 64 + c * 4, src + (nb * 16 + c) * K + kb * 64 + r * 4, 4);
      }
      for (int64_t n = nb * 16; n < nb * 16 + 16; ++n) {  // no int32 copy of the weight (the LM head's: 0.9 GB)
        int32_t sum = 0;
        for (int64_t k = 0; k < K; ++k) sum += src[n * K + k];
        cs[n] = sum;
      }
    }
  });
  return {packed, colsum};
}

#ifdef ENGINE_LIB_AMX
bool amx_permitted() {  // Linux hands out the tile registers' state only on request, once per process
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// output columns of the 32-column blocks n0..n1-1, for all Mp rows (a multiple of 32) of the parts
AMX_TARGET void amx_block(const int8_t* A, const int8_t* P, int32_t* C, int64_t Mp, int64_t K, int64_t N,
                          int64_t n0, int64_t n1) {
  const int64_t KB = K / 64;
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;  // 0-3: sums, 4-5: activations, 6-7: weights
  _tile_loadconfig(&cfg);
  for (int64_t nb2 = n0; nb2 < n1; ++nb2) {
    const int8_t *B0 = P + 2 * nb2 * KB * TILE_BYTES, *B1 = B0 + KB * TILE_BYTES;
    for (int64_t m = 0; m < Mp; m += 32) {
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t kb = 0; kb < KB; ++kb) {
        _tile_loadd(4, A + m * K + kb * 64, K);
        _tile_loadd(5, A + (m + 16) * K + kb * 64, K);
        _tile_loadd(6, B0 + kb * TILE_BYTES, 64);
        _tile_loadd(7, B1 + kb * TILE_BYTES, 64);
        _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7); _tile_dpbssd(2, 5, 6); _tile_dpbssd(3, 5, 7);
      }
      int32_t* c = C + m * N + nb2 * 32;
      _tile_stored(0, c, N * 4); _tile_stored(1, c + 16, N * 4);
      _tile_stored(2, c + 16 * N, N * 4); _tile_stored(3, c + 16 * N + 16, N * 4);
    }
  }
  _tile_release();
}
#endif

AVX512_VNNI inline __m512i bcast4(const uint8_t* p) {  // 4 bytes, in every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// one row's three parts (u: each + 128) against column blocks nb .. nb + S - 1 read side by side (S streams
// of tiles) -> out (N,) fp32, combined as int24_combine does (the same operations in the same order: a row's
// result does not depend on the kernel)
template <int S>
AVX512_VNNI inline void vnni_blocks(const uint8_t* u, int64_t K, const int8_t* P, const int32_t* colsum, float scale,
                                    const float* col_scales, float* out, int64_t nb) {
  const int64_t KB = K / 64;
  const uint8_t *x0 = u, *x1 = u + K, *x2 = u + 2 * K;
  __m512i h[S], m[S], l[S];
  for (int s = 0; s < S; ++s) h[s] = m[s] = l[s] = _mm512_setzero_si512();
  for (int64_t kb = 0; kb < KB; ++kb) {
    const int64_t k = kb * 64;
    for (int s = 0; s < S; ++s) {  // the tile 32 ahead of each stream, into L2
      const int8_t* t = P + ((nb + s) * KB + kb + 32) * TILE_BYTES;
      for (int q = 0; q < 16; ++q) _mm_prefetch(reinterpret_cast<const char*>(t + q * 64), _MM_HINT_T1);
    }
    for (int r = 0; r < 16; ++r) {
      const __m512i a0 = bcast4(x0 + k + 4 * r), a1 = bcast4(x1 + k + 4 * r), a2 = bcast4(x2 + k + 4 * r);
      for (int s = 0; s < S; ++s) {
        const __m512i w = _mm512_loadu_si512(P + ((nb + s) * KB + kb) * TILE_BYTES + r * 64);
        h[s] = _mm512_dpbusd_epi32(h[s], a0, w);
        m[s] = _mm512_dpbusd_epi32(m[s], a1, w);
        l[s] = _mm512_dpbusd_epi32(l[s], a2, w);
      }
    }
  }
  for (int s = 0; s < S; ++s) {
    const int64_t c = (nb + s) * 16;
    const __m512i shift = _mm512_slli_epi32(_mm512_loadu_si512(colsum + c), 7);  // 128 * the column sums
    const __m512 hv = _mm512_cvtepi32_ps(_mm512_sub_epi32(h[s], shift));
    const __m512 mv = _mm512_cvtepi32_ps(_mm512_sub_epi32(m[s], shift));
    const __m512 lv = _mm512_cvtepi32_ps(_mm512_sub_epi32(l[s], shift));
    const __m512 v = _mm512_fmadd_ps(hv, _mm512_set1_ps(65536.f), _mm512_fmadd_ps(mv, _mm512_set1_ps(256.f), lv));
    _mm512_storeu_ps(out + c, _mm512_mul_ps(v, _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_loadu_ps(col_scales + c))));
  }
}

AVX512_VNNI void vnni_tiles(const uint8_t* u, int64_t K, const int8_t* P, const int32_t* colsum, float scale,
                            const float* col_scales, float* out, int64_t n0, int64_t n1) {
  int64_t nb = n0;
  for (; nb + VNNI_STREAMS <= n1; nb += VNNI_STREAMS)
    vnni_blocks<VNNI_STREAMS>(u, K, P, colsum, scale, col_scales, out, nb);
  for (; nb < n1; ++nb) vnni_blocks<1>(u, K, P, colsum, scale, col_scales, out, nb);
}

// output rows a..b-1 (multiples of 16) of a packed int8 weight, as bf16 (exact: |q| <= 127) -> out (b - a, K):
// for a prefill longer than the tiles pay for, which takes the bf16 GEMM on blocks of the weight
AVX512_VNNI void tiles_to_bf16_rows(const int8_t* P, int64_t KB, int64_t nb0, int64_t nb1, int64_t a,
                                    at::BFloat16* out) {
  const int64_t K = KB * 64;
  for (int64_t nb = nb0; nb < nb1; ++nb)
    for (int64_t kb = 0; kb < KB; ++kb) {
      const int8_t* t = P + (nb * KB + kb) * TILE_BYTES;
      for (int r = 0; r < 16; ++r)
        for (int c4 = 0; c4 < 4; ++c4) {  // 4 columns x their 4 inputs: 16 bytes -> 16 bf16
          const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(t + r * 64 + c4 * 16))));
          // fp32 -> bf16 by its top 16 bits: exact for these small integers
          const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(f), 16));
          for (int c = 0; c < 4; ++c) {
            const int64_t row = nb * 16 + c4 * 4 + c - a;
            const __m128i four = c < 2 ? _mm256_castsi256_si128(h) : _mm256_extracti128_si256(h, 1);
            _mm_storel_epi64(reinterpret_cast<__m128i*>(out + row * K + kb * 64 + 4 * r),
                             (c & 1) ? _mm_unpackhi_epi64(four, four) : four);
          }
        }
    }
}

void int8_tiles_rows(const at::Tensor& packed, int64_t a, int64_t b, at::Tensor& out) {
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "packed must come from int8_tiles_pack");
  const int64_t KB = packed.size(1);
  TORCH_CHECK(a % 16 == 0 && b % 16 == 0 && 0 <= a && a < b && b <= packed.size(0) * 16, "rows a..b must be whole 16s");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.numel() >= (b - a) * KB * 64,
              "out must be contiguous bf16 with room for (b - a) x K");
  TORCH_CHECK(cpu_has_avx512_vnni(), "int8_tiles_rows needs AVX-512");
  const int8_t* P = packed.data_ptr<int8_t>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  at::parallel_for(a / 16, b / 16, 1, [&](int64_t n0, int64_t n1) { tiles_to_bf16_rows(P, KB, n0, n1, a, o); });
}

// x (M, K) @ W^T * col_scales for W packed by int8_tiles_pack -> (M, N) fp32
at::Tensor int8_tiles_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& colsum,
                             const at::Tensor& col_scales) {
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "packed must come from int8_tiles_pack");
  const int64_t N = packed.size(0) * 16, K = packed.size(1) * 64, M = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be (M, ", K, ")");
  TORCH_CHECK(cpu_has_avx512_vnni(), "int8_tiles_linear needs AVX-512 VNNI");
  auto [parts, scale] = int24_split(x);  // (3M, K) int8, (M,) fp32
  const at::Tensor cols = col_scales.to(at::kFloat).contiguous();
  if (M == 1) {
    std::vector<uint8_t> u(3 * K);  // vpdpbusd multiplies unsigned bytes: each part + 128
    const int8_t* pp = parts.data_ptr<int8_t>();
    for (int64_t i = 0; i < 3 * K; ++i) u[i] = static_cast<uint8_t>(pp[i] + 128);
    auto out = at::empty({1, N}, x.options().dtype(at::kFloat));
    const int8_t* P = packed.data_ptr<int8_t>();
    const int32_t* cs = colsum.data_ptr<int32_t>();
    const float *cp = cols.data_ptr<float>(), s0 = scale.data_ptr<float>()[0];
    float* o = out.data_ptr<float>();
    at::parallel_for(0, N / 16, 16, [&](int64_t n0, int64_t n1) { vnni_tiles(u.data(), K, P, cs, s0, cp, o, n0, n1); });
    return out;
  }
#ifdef ENGINE_LIB_AMX
  TORCH_CHECK(amx_permitted(), "the kernel did not get the AMX tile registers from the OS");
  // rows in chunks whose int32 sums stay under 32 MiB (a long prompt, or every position's logits)
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(M, (int64_t(32) << 20) / (12 * N)));
  const int8_t* P = packed.data_ptr<int8_t>();
  at::Tensor out = M <= chunk ? at::Tensor() : at::empty({M, N}, x.options().dtype(at::kFloat));
  for (int64_t r0 = 0; r0 < M; r0 += chunk) {
    const int64_t rc = std::min(chunk, M - r0), rows = 3 * rc, padded = (rows + 31) / 32 * 32;
    auto a = at::zeros({padded, K}, parts.options());  // the chunk's high, middle and low parts, then zero rows
    for (int part = 0; part < 3; ++part) a.narrow(0, part * rc, rc).copy_(parts.narrow(0, part * M + r0, rc));
    // the int32 sums in this thread's reused buffer: a fresh allocation this large is fresh pages from the
    // OS every call, and touching them cost more than the multiplies (measured: 192 rows of (17920, 1536))
    static thread_local std::vector<int32_t> sums_buffer;
    if (sums_buffer.size() < static_cast<size_t>(padded * N)) sums_buffer.resize(padded * N);
    auto c = at::from_blob(sums_buffer.data(), {padded, N}, x.options().dtype(at::kInt));
    const int8_t* A = a.data_ptr<int8_t>();
    int32_t* C = c.data_ptr<int32_t>();
    at::parallel_for(0, N / 32, 1, [&](int64_t n0, int64_t n1) { amx_block(A, P, C, padded, K, N, n0, n1); });
    auto y = int24_combine(c.narrow(0, 0, rows), scale.narrow(0, r0, rc).contiguous(), cols);
    if (M <= chunk) return y;
    out.narrow(0, r0, rc).copy_(y);
  }
  return out;
#else
  TORCH_CHECK(false, "this build has no AMX (GCC 11 or clang 12 and later)");
#endif
}

// Prefills of int4 weights on a CPU with AMX's bf16 unit. The plain path dequantizes a block of weight rows
// into bf16 (int4_dequantize), and the bf16 GEMM then rearranges that block into its own tile layout before
// it multiplies: two full-width copies of the weight written and read again per call. Here each thread
// takes 32 weight rows at a time and dequantizes them into a buffer that stays in its L2 (32 x K bf16:
// 96 KB at K = 1536, 573 KB at K = 8960), in the layout AMX reads as is: the weight rows are the tiles'
// rows (the left operand), so the rows come out of the dequantizer in order and need no transpose. The
// activations are the right operand: pairs of inputs side by side per row, 32-bit words laid out as
// (rows / 32, K / 2, 32), written once per call. Each 32 x 32 block of the output takes `tdpbf16ps` on four 16 x 16 fp32 sums.
//
// The weights are the bf16 values int4_dequantize writes, bit for bit: per group, the 16 values
// q * scale + zero are computed with its arithmetic and rounding, and each nibble picks its value from
// that table (vpermw, 32 weights per instruction). The sums are fp32, as the bf16 GEMM's; only their
// order differs. A row's sums do not depend on the other rows of the call: every output is its own
// fp32 sum over K in the same order.

#ifdef ENGINE_LIB_AMX
#define AMX_BF16 __attribute__((target("amx-tile,amx-bf16,avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")))

bool cpu_has_amx_bf16() {
  static const bool has = [] {
    unsigned a, b, c, d;
    // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1) && ((d >> 24) & 1) && cpu_has_avx512_vnni();
  }();
  return has;
}

// the 16 values of one group's nibbles, q * scale + zero for q = 0..15 (zero already holds zero - 8 scale),
// as bf16 in the low 16 words: dequantize32's fma and store16's rounding
AMX_BF16 inline __m512i group_table(float scale, float zero) {
  const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                                         13, 14, 15)),
                                   _mm512_set1_ps(scale), _mm512_set1_ps(zero));
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_castsi256_si512(_mm512_cvtepi32_epi16(r));
}

// weight rows n0..n0+31 -> strip (32, K) bf16
template <typename S>
AMX_BF16 void dequantize_strip(const uint8_t* qp, const S* sz, int64_t N, int64_t K, int64_t G, int64_t n0,
                               at::BFloat16* strip) {
  const __m512i nib = _mm512_set1_epi32(15);
  for (int64_t r = 0; r < 32; ++r) {
    const int64_t n = n0 + r;
    const uint8_t* p = qp + n * (K / 2);
    at::BFloat16* o = strip + r * K;
    for (int64_t g = 0; g < K / G; ++g) {
      const float scale = as_float(sz[(g * N + n) * 2]), zero = as_float(sz[(g * N + n) * 2 + 1]) - 8.0f * scale;
      const __m512i table = group_table(scale, zero);
      for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k / 2)));
        // byte j holds inputs 2j (low nibble) and 2j + 1 (high): as two 16-bit indices, the inputs in order
        const __m512i idx = _mm512_or_si512(_mm512_and_si512(b, nib), _mm512_slli_epi32(_mm512_srli_epi32(b, 4), 16));
        _mm512_storeu_si512(o + k, _mm512_permutexvar_epi16(idx, table));
      }
    }
  }
}

// a 16 x 16 block of sums (rows: weight rows, columns: activation rows) -> out rows m0.. (< M), columns n0..n0+15
AMX_BF16 inline void store_block(const float* c, int64_t m0, int64_t M, int64_t N, int64_t n0, at::BFloat16* out) {
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  for (int64_t j = 0; j < 16 && m0 + j < M; ++j)
    store16(out + (m0 + j) * N + n0, _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(j)), c, 4));
}

// strips s0..s1-1 (32 weight rows each) for all rows of X: X (Mp / 32, K / 2, 32) pairs of inputs, each block of
// 32 rows contiguous (its tiles are 128 bytes apart, a stream the prefetcher follows); Mp a multiple of 16
template <typename S>
AMX_BF16 void int4_amx_strips(const int32_t* X, int64_t Mp, int64_t M, const uint8_t* qp, const S* sz, int64_t N,
                              int64_t K, int64_t G, int64_t s0, int64_t s1, at::BFloat16* out) {
  static thread_local std::vector<at::BFloat16> strip_buffer;
  if (strip_buffer.size() < static_cast<size_t>(32 * K)) strip_buffer.resize(32 * K);
  at::BFloat16 *W0 = strip_buffer.data(), *W1 = W0 + 16 * K;
  alignas(64) float c[4][256];
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;  // 0-3: sums, 4-5: weights, 6-7: activations
  _tile_loadconfig(&cfg);
  for (int64_t s = s0; s < s1; ++s) {
    dequantize_strip(qp, sz, N, K, G, s * 32, W0);
    for (int64_t m = 0; m < Mp; m += 32) {
      const bool two = m + 32 <= Mp;  // a last block of 16 rows takes half the tiles
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t k = 0; k < K; k += 32) {
        const int32_t* xb = X + ((m / 32) * (K / 2) + k / 2) * 32;
        _tile_loadd(4, W0 + k, K * 2);
        _tile_loadd(5, W1 + k, K * 2);
        _tile_loadd(6, xb, 128);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(2, 5, 6);
        if (two) {
          _tile_loadd(7, xb + 16, 128);
          _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c[0], 64); _tile_stored(2, c[2], 64);
      store_block(c[0], m, M, N, s * 32, out);
      store_block(c[2], m, M, N, s * 32 + 16, out);
      if (two) {
        _tile_stored(1, c[1], 64); _tile_stored(3, c[3], 64);
        store_block(c[1], m + 16, M, N, s * 32, out);
        store_block(c[3], m + 16, M, N, s * 32 + 16, out);
      }
    }
  }
  _tile_release();
}
#endif

bool amx_bf16() {
#ifdef ENGINE_LIB_AMX
  return cpu_has_amx_bf16() && amx_permitted();
#else
  return false;
#endif
}

// x (M, K) bf16 @ the int4 weight's bf16 values^T -> (M, N) bf16, on AMX
at::Tensor int4_amx_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales_and_zeros, int64_t G) {
  const int64_t N = q.size(0), K = q.size(1) * 2, M = x.size(0);
  check_int4(q, scales_and_zeros, K, G);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be contiguous bf16 (M, ", K, ")");
  TORCH_CHECK(N % 32 == 0 && G % 32 == 0, "int4_amx_linear needs N % 32 == 0 and the group size % 32 == 0, got N = ",
              N, ", group ", G);
  TORCH_CHECK(amx_bf16(), "int4_amx_linear needs AMX-BF16 (and the tile registers from the OS)");
#ifdef ENGINE_LIB_AMX
  const int64_t Mp = (M + 15) / 16 * 16, blocks = (M + 31) / 32;
  auto X = at::empty({blocks, K / 2, 32}, x.options().dtype(at::kInt));  // pairs of inputs, a column per row of x
  auto padded = at::zeros({blocks * 32, K / 2}, X.options());
  padded.narrow(0, 0, M).copy_(x.view(at::kInt));
  X.copy_(padded.view({blocks, 32, K / 2}).transpose(1, 2));
  auto out = at::empty({M, N}, x.options());
  const int32_t* xp = X.data_ptr<int32_t>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  auto run = [&](auto* sz) {
    at::parallel_for(0, N / 32, 1, [&](int64_t s0, int64_t s1) { int4_amx_strips(xp, Mp, M, qp, sz, N, K, G, s0, s1, op); });
  };
  if (scales_and_zeros.scalar_type() == at::kFloat) run(scales_and_zeros.data_ptr<float>());
  else run(scales_and_zeros.data_ptr<at::BFloat16>());
  return out;
#else
  return at::Tensor();
#endif
}

// which kernels int8_gemv and int4_gemv run: "avx512_vnni" or "avx2"
std::string kernel_isa() { return use_avx512() ? "avx512_vnni" : "avx2"; }

// "avx2": the AVX2 kernels from the next call on, even where AVX-512 VNNI is present; "auto": the widest
// this CPU has. Returns the kernels now in use.
std::string set_isa(std::string isa) {
  TORCH_CHECK(isa == "avx2" || isa == "auto", "set_isa: choose 'avx2' or 'auto', not '", isa, "'");
  avx2_forced.store(isa == "avx2");
  return kernel_isa();
}

}  // namespace

TORCH_LIBRARY(engine_lib_cpu, m) {
  m.def("bf16_gemv(Tensor x, Tensor w) -> Tensor");
  m.def("bf16_gemm(Tensor x, Tensor w) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("int8_gemv(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.def("int4_gemv(Tensor x, Tensor q, Tensor scales_and_zeros, int group_size) -> Tensor");
  m.def("int4_dequantize(Tensor q, Tensor scales_and_zeros, int group_size, int a, int b, Tensor(a!) out) -> ()");
  m.def("int24_split(Tensor x) -> (Tensor, Tensor)");
  m.def("int24_combine(Tensor sums, Tensor scale, Tensor col_scales) -> Tensor");
  m.def("int8_tiles_pack(Tensor w) -> (Tensor, Tensor)");
  m.def("int8_tiles_linear(Tensor x, Tensor packed, Tensor colsum, Tensor col_scales) -> Tensor");
  m.def("int8_tiles_rows(Tensor packed, int a, int b, Tensor(a!) out) -> ()");
  m.def("int4_amx_linear(Tensor x, Tensor q, Tensor scales_and_zeros, int group_size) -> Tensor");
  m.def("amx_bf16() -> bool", &amx_bf16);
  m.def("kernel_isa() -> str", &kernel_isa);
  m.def("set_isa(str isa) -> str", &set_isa);
}

TORCH_LIBRARY_IMPL(engine_lib_cpu, CPU, m) {
  m.impl("bf16_gemv", bf16_gemv);
  m.impl("bf16_gemm", bf16_gemm);
  m.impl("bf16_linear", bf16_linear);
  m.impl("int8_gemv", int8_gemv);
  m.impl("int4_gemv", int4_gemv);
  m.impl("int4_dequantize", int4_dequantize);
  m.impl("int24_split", int24_split);
  m.impl("int24_combine", int24_combine);
  m.impl("int8_tiles_pack", int8_tiles_pack);
  m.impl("int8_tiles_linear", int8_tiles_linear);
  m.impl("int8_tiles_rows", int8_tiles_rows);
  m.impl("int4_amx_linear", int4_amx_linear);
}
