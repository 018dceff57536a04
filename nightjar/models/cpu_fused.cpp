// Fused CPU ops for the decoder step (nightjar/models/cpu_fused.py builds and loads this file).
//
// At one to a few rows per step a decoder layer is ~50 small aten calls, each a few to tens of µs of
// dispatch and allocation around almost no arithmetic; these ops do the same arithmetic in one call each:
//   rms_norm        x [T, h] -> [T, h]
//   add_rms_norm    (a, x) [T, h] -> (x + a, rms_norm(x + a)); the sum is rounded to the dtype first
//   silu_mul        gate_up [T, 2I] -> silu(gate) * up [T, I]
//   rope_store      qkv [T, (nh + 2 nkv) d] -> roped q [T, nh, d]; roped k and v written to cache slots
//   paged_attention q [T, nh, d] over a head-major paged cache, causal within each row's query chunk (rows of
//                   at most max_query queries), in tasks of (row, kv head, 64 positions) merged in order: a query's
//                   numbers depend only on its own row's positions, never on the step's other rows or queries
//   int4_weight_t   torch's packed int4 weight + group scales -> W^T [k, n] (a quantized layer's long chunks)
//   argmax_rows     x [N, V] fp32 -> argmax [N] int64 as torch.argmax (greedy verification over the vocabulary)
//   int8_linear     x [M, K] @ (int8 q [N, K] * scales [N])^T -> [M, N] fp32 or x's dtype (an int8 LM head or layer)
//   int8_linear_tiled  int8_linear's fp32 path with q in tiles of 4 rows -> [M, N] fp32 (an LM head where this
//                   build has no bf16 arithmetic: AVX2)
//   int4_linear     x [M, K] @ W^T, W in torch's int4 pack + group scales -> [M, N] (an int4 layer's short calls)
//   int4_linear_a8  the same with x rounded to int8 per group (--quantization w4a8: integer dot products), the
//                   codes in int4_a8_pack's order
//   int4_a8_pack    torch's int4 pack -> the same bytes in the order int4_linear_a8 reads
//   int8_linear_a8  int8_linear with x rounded to int8 per group, q in tiles of 4 rows -> [M, N] fp32 (a w4a8
//                   model's LM head)
//   bf16_panels     bf16 W [N, K] -> panels of 16 output columns (a bf16 layer on a CPU without bf16 arithmetic)
//   bf16_linear     x [M, K] @ W^T, W as bf16_panels -> [M, N] in x's dtype (models/cpu_linear.py PANELS)
//   (int8_linear and int4_linear take bf16 x on AMX tiles where the CPU has them and Linux grants them;
//   use_amx(False) turns that off)
// Every op that computes values accumulates in fp32 and rounds once to the tensor dtype (float or bfloat16).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define NIGHTJAR_AMX 1  // AMX tile code is built (the bf16 int4/int8 kernels, when Linux grants the tiles)
#include <sys/syscall.h>
#include <unistd.h>
#else
#define NIGHTJAR_AMX 0
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <limits>
#include <tuple>
#include <vector>

namespace {

template <typename T>
inline float f32(T v) { return static_cast<float>(v); }

template <typename T>
float sum_squares(const T* x, int64_t h) {
  float acc[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= h; i += 16)
    for (int l = 0; l < 16; ++l) { float v = f32(x[i + l]); acc[l] += v * v; }
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += acc[l];
  for (; i < h; ++i) { float v = f32(x[i]); s += v * v; }
  return s;
}

template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t h, float eps) {
  const float r = 1.f / std::sqrt(sum_squares(x, h) / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) out[i] = static_cast<T>(f32(x[i]) * r * f32(w[i]));
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "expected a contiguous [T, h] tensor");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous() && w.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [h] tensor of the input's dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w);
  auto out = at::empty_like(x);
  const int64_t T = x.size(0), h = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t *px = x.data_ptr<scalar_t>(), *pw = w.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 8, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) norm_row(px + t * h, pw, po + t * h, h, static_cast<float>(eps));
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& a, const at::Tensor& x, const at::Tensor& w,
                                                double eps) {
  check_rows(x, w);
  TORCH_CHECK(a.sizes() == x.sizes() && a.is_contiguous() && a.scalar_type() == x.scalar_type(),
              "the addend must match x");
  auto sum = at::empty_like(x);
  auto out = at::empty_like(x);
  const int64_t T = x.size(0), h = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t *pa = a.data_ptr<scalar_t>(), *px = x.data_ptr<scalar_t>(), *pw = w.data_ptr<scalar_t>();
    scalar_t *ps = sum.data_ptr<scalar_t>(), *po = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 8, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        for (int64_t i = 0; i < h; ++i) ps[t * h + i] = static_cast<scalar_t>(f32(px[t * h + i]) + f32(pa[t * h + i]));
        norm_row(ps + t * h, pw, po + t * h, h, static_cast<float>(eps));
      }
    });
  });
  return {sum, out};
}

// fp32 vectors of 16 lanes (GCC/Clang vector extensions: AVX-512 where built with it, split otherwise), and of 8
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef int32_t i8x8 __attribute__((vector_size(32)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

// a vector type's lane count and integer twins (GCC drops vector_size on typedefs that depend on a template)
template <typename V> struct Lanes;
template <> struct Lanes<v16> {
  static constexpr int64_t n = 16;
  typedef i16 i32;
  typedef u16x16 u16;
  typedef u32x16 u32;
};
template <> struct Lanes<v8> {
  static constexpr int64_t n = 8;
  typedef i8x8 i32;
  typedef u16x8 u16;
  typedef u32x8 u32;
};

inline float hsum(v8 b) {
  v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
}

inline float hsum(v16 a) {
  return hsum(v8(__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15)));
}

// e^x: Cody-Waite reduction and Cephes' expf polynomial, within ~2 ulp of std::exp; x is clamped to
// [-87, 88] (e^-87 ~ 1.6e-38 stands for 0, callers mask what must be exactly 0)
template <typename V>
inline V vexp(V x) {
  typedef typename Lanes<V>::i32 I;
  x = x < -87.f ? V{} - 87.f : x;
  x = x > 88.f ? V{} + 88.f : x;
  const V t = x * 1.44269504088896341f + 12582912.f;  // round(x / ln 2) in the low mantissa bits
  const V n = t - 12582912.f;
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const I e = (__builtin_convertvector(n, I) + 127) << 23;
  return p * reinterpret_cast<const V&>(e);
}

// Lanes<V>::n values from src as fp32 lanes (bf16: the 16 bits are the high half of an fp32); fewer n zero-fill
template <typename V, typename T>
inline V load_lanes(const T* src, int64_t n) {
  constexpr int64_t W = Lanes<V>::n;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {  // whole vectors stay in registers (no store and reload)
    if (n >= W) {
      typename Lanes<V>::u16 raw;
      std::memcpy(&raw, src, sizeof raw);
      return __builtin_bit_cast(V, __builtin_convertvector(raw, typename Lanes<V>::u32) << 16);
    }
  } else if constexpr (std::is_same_v<T, float>) {
    if (n >= W) {
      V out;
      std::memcpy(&out, src, sizeof out);
      return out;
    }
  }
  V out{};
  for (int64_t i = 0; i < std::min<int64_t>(n, W); ++i) out[i] = f32(src[i]);
  return out;
}

// one head vector src [d] -> dst [C] fp32 vectors (C = d rounded up to the lanes, zero past d)
template <typename V, typename T>
inline void widen(const T* src, V* dst, int64_t d, int64_t C, float scale = 1.f) {
  constexpr int64_t W = Lanes<V>::n;
  for (int64_t c = 0; c < C; ++c) dst[c] = load_lanes<V>(src + W * c, d - W * c) * scale;
}

// The machine's register width in fp32 lanes (AVX-512: 16; else 8, as AVX2 holds them): GCC keeps a 16-lane vector
// that the CPU has no register for in memory, and attention on v16 ran ~5x slower on an AVX2 EPYC. Attention and SiLU
// run on va: SiLU's numbers do not depend on the width; attention's sums are ordered by it, so an AVX-512 build and an
// AVX2 build round differently, while within one build a query's numbers still depend only on its own row.
#if defined(__AVX512F__)
constexpr int64_t AL = 16;
#else
constexpr int64_t AL = 8;
#endif
typedef std::conditional_t<AL == 16, v16, v8> va;

at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0, "expected a contiguous [T, 2I] tensor");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto out = at::empty({T, I}, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gu.scalar_type(), "silu_mul", [&] {
    const scalar_t* pg = gu.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    const int64_t chunks = (I + AL - 1) / AL;
    at::parallel_for(0, T * chunks, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t k = lo; k < hi; ++k) {
        const int64_t t = k / chunks, i0 = (k % chunks) * AL, m = std::min<int64_t>(AL, I - i0);
        const va g = load_lanes<va>(pg + t * 2 * I + i0, m), u = load_lanes<va>(pg + t * 2 * I + I + i0, m);
        const va y = g / (1.f + vexp(-g)) * u;
        for (int64_t i = 0; i < m; ++i) po[t * I + i0 + i] = static_cast<scalar_t>(y[i]);
      }
    });
  });
  return out;
}

// One layer's K and V by slot: [2, nkv, S, d], each slot's d values contiguous (heads and K/V may be strided:
// the layer can be a view of a larger reserve)
void check_cache(const at::Tensor& c) {
  TORCH_CHECK(c.dim() == 4 && c.size(0) == 2 && c.stride(3) == 1 && c.stride(2) == c.size(3),
              "cache must be a [2, nkv, S, d] view with contiguous slots");
}

// y = x * cos + roll(x, d/2) * sin_signed, for one head vector of d values
template <typename T>
inline void rope_vec(const T* x, const T* c, const T* s, T* y, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const int64_t j = i < half ? i + half : i - half;
    y[i] = static_cast<T>(f32(x[i]) * f32(c[i]) + f32(x[j]) * f32(s[i]));
  }
}

at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin_signed,
                      const at::Tensor& cache, const at::Tensor& slots, int64_t nh) {
  // qkv [T, (nh + 2 nkv) d]; cos, sin_signed [T, d] (any row stride); cache [2, nkv, S, d] (one layer by slot)
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv must be a contiguous [T, (nh + 2 nkv) d] tensor");
  check_cache(cache);
  const int64_t T = qkv.size(0), nkv = cache.size(1), S = cache.size(2), d = cache.size(3);
  const int64_t kv_stride = cache.stride(0), head_stride = cache.stride(1);
  TORCH_CHECK(qkv.size(1) == (nh + 2 * nkv) * d, "qkv width does not match the heads");
  TORCH_CHECK(cos.size(0) == T && cos.size(-1) == d && cos.stride(-1) == 1 && sin_signed.sizes() == cos.sizes() &&
                  sin_signed.strides() == cos.strides(), "cos and sin_signed must be [T, d] with unit stride");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == T && slots.scalar_type() == at::kLong, "slots must be [T] int64");
  TORCH_CHECK(qkv.scalar_type() == cache.scalar_type() && cos.scalar_type() == qkv.scalar_type() &&
                  sin_signed.scalar_type() == qkv.scalar_type(), "qkv, cos, sin and cache must share a dtype");
  auto sl = slots.contiguous();
  const int64_t* ps = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ps[t] >= 0 && ps[t] < S, "cache slot out of range");
  auto q = at::empty({T, nh, d}, qkv.options());
  const int64_t cs = cos.stride(0), W = qkv.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rope_store", [&] {
    const scalar_t *px = qkv.data_ptr<scalar_t>(), *pc = cos.data_ptr<scalar_t>(), *pn = sin_signed.data_ptr<scalar_t>();
    scalar_t *pq = q.data_ptr<scalar_t>(), *pk = cache.data_ptr<scalar_t>(), *pv = pk + kv_stride;
    at::parallel_for(0, T, 4, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const scalar_t *x = px + t * W, *c = pc + t * cs, *s = pn + t * cs;
        for (int64_t h = 0; h < nh; ++h) rope_vec(x + h * d, c, s, pq + (t * nh + h) * d, d);
        for (int64_t h = 0; h < nkv; ++h) {
          rope_vec(x + (nh + h) * d, c, s, pk + h * head_stride + ps[t] * d, d);
          std::copy(x + (nh + nkv + h) * d, x + (nh + nkv + h + 1) * d, pv + h * head_stride + ps[t] * d);
        }
      }
    });
  });
  return q;
}

// a[16] -> their lane sums (lane i: the sum of a[i]'s lanes); halving shuffles, so every sum is formed in
// the same order whichever slot its vector holds
inline v16 reduce16(const v16* a) {
  v16 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// tile(std::integral_constant<int, mt>) for 1 <= mt <= Max <= 6 (the rows of a tile, as a compile-time count)
template <int Max, typename Tile>
inline void by_rows(int64_t mt, Tile&& tile) {
  auto run = [&](auto r) {
    if constexpr (decltype(r)::value <= Max) tile(r);
  };
  switch (mt) {
    case 1: run(std::integral_constant<int, 1>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 3: run(std::integral_constant<int, 3>{}); break;
    case 4: run(std::integral_constant<int, 4>{}); break;
    case 5: run(std::integral_constant<int, 5>{}); break;
    default: run(std::integral_constant<int, Max>{});
  }
}

// a[8] -> their lane sums (lane i: the sum of a[i]'s lanes), as reduce16
inline v8 reduce8(const v8* a) {
  v8 b[4], c[2];
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

// a[AL] -> their lane sums (lane i: the sum of a[i]'s lanes), as reduce16
inline va reduce_a(const va* a) {
#if defined(__AVX512F__)
  return reduce16(a);
#else
  return reduce8(a);
#endif
}

inline va lane_index_a() {
  va v;
  for (int64_t i = 0; i < AL; ++i) v[i] = static_cast<float>(i);
  return v;
}

// Positions per attention task. Fixed, so that a query's numbers depend only on its own row's positions: not on
// the step's other rows, how many queries its row verifies, or the thread count.
constexpr int64_t kChunk = 64;
constexpr int64_t kMaxD = 256;           // head_dim <= 256
constexpr int64_t kMaxC = kMaxD / AL;

// One (row, kv head, chunk of positions [p0, p0 + kChunk) within the row's L): for each of the row's n = Q * gq
// queries (token-major, then head within the group) the chunk's largest score m, z = sum of e^(s - m) and
// acc = sum of e^(s - m) v [d], written to part[r * (d + 2) ...] as (m, z, acc). Query r sees the positions before
// L - Q + r / gq + 1 (causal within the row's query chunk); one that sees none of the chunk gets m = -inf, z = 0.
// CC > 0: the head's AL-lane vector count (d / AL) known at compile time, so the inner loops unroll and the
// accumulators stay in registers; CC = 0: any d up to kMaxD.
template <typename T, int64_t CC>
void attend_chunk(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t bs, int64_t L, int64_t Q,
                  int64_t gq, int64_t dd, int64_t nh, int64_t h, float scale, int64_t p0, float* part) {
  constexpr float ninf = -std::numeric_limits<float>::infinity();
  constexpr int64_t S = kChunk / AL;                                 // vectors of scores per query
  constexpr int64_t R = CC > 0 ? std::max<int64_t>(1, AL / CC) : 4;  // queries per pass over V
  static_assert(R <= 5, "by_rows dispatches passes of up to 5 queries");
  const int64_t d = CC > 0 ? AL * CC : dd, C = CC > 0 ? CC : (d + AL - 1) / AL;
  const int64_t n = Q * gq, P = std::min(kChunk, L - p0);
  thread_local std::vector<va> qf, kv, sc;                           // per thread, reused across tasks
  qf.resize(n * C);
  kv.resize(kChunk * C);                                              // AL keys, then the chunk's values
  sc.assign(n * S, va{});
  int64_t off[kChunk];  // offset of position p0 + j in a head's cache (one division per chunk, not per position)
  for (int64_t j = 0, blk = p0 / bs, i = p0 % bs; j < P; ++j) {
    off[j] = (table[blk] * bs + i) * d;
    if (++i == bs) i = 0, ++blk;
  }
  for (int64_t tq = 0; tq < Q; ++tq)  // query vectors, pre-scaled
    for (int64_t g = 0; g < gq; ++g) widen(q + (tq * nh + h * gq + g) * d, &qf[(tq * gq + g) * C], d, C, scale);
  for (int64_t j0 = 0; j0 < P; j0 += AL) {  // scores of AL positions at a time: [AL positions] x [C] -> lanes
    for (int64_t j = 0; j < AL; ++j) {
      if (j0 + j < P) widen(kc + off[j0 + j], &kv[j * C], d, C);
      else std::fill(&kv[j * C], &kv[j * C] + C, va{});
    }
    for (int64_t r = 0; r < n; ++r) {
      va a[AL];
      for (int64_t j = 0; j < AL; ++j) {
        va s = qf[r * C] * kv[j * C];
        for (int64_t c = 1; c < C; ++c) s += qf[r * C + c] * kv[j * C + c];
        a[j] = s;
      }
      sc[r * S + j0 / AL] = reduce_a(a);
    }
  }
  const va lanes = lane_index_a();
  for (int64_t r = 0; r < n; ++r) {  // e^(s - m) over the visible positions, 0 past them
    const int64_t vis = std::clamp<int64_t>(L - Q + r / gq + 1 - p0, 0, P);
    float* s = reinterpret_cast<float*>(&sc[r * S]);
    float* out = part + r * (d + 2);
    va mv = va{} + ninf;                             // the visible maximum, AL lanes at a time
    for (int64_t p = 0; p < kChunk; p += AL) {
      va x = *reinterpret_cast<va*>(s + p);
      x = (lanes + static_cast<float>(p)) < static_cast<float>(vis) ? x : va{} + ninf;
      *reinterpret_cast<va*>(s + p) = x;
      mv = x > mv ? x : mv;
    }
    float mx = ninf;
    for (int64_t l = 0; l < AL; ++l) mx = std::max(mx, mv[l]);
    va z{};
    for (int64_t p = 0; p < kChunk; p += AL) {
      const va x = *reinterpret_cast<va*>(s + p);
      va e = vis ? vexp(x - mx) : va{};
      e = x == ninf ? va{} : e;
      *reinterpret_cast<va*>(s + p) = e;
      z += e;
    }
    out[0] = mx;
    out[1] = hsum(z);
  }
  const float* w = reinterpret_cast<const float*>(sc.data());
  const bool once = n > R;                 // several passes: the chunk's values widened once, for all of them
  for (int64_t p = 0; once && p < P; ++p) widen(vc + off[p], &kv[p * C], d, C);
  auto pass = [&](auto rc, int64_t r0) {  // acc = sum_p e_p v_p for RR queries per pass over V (in registers)
    constexpr int64_t RR = decltype(rc)::value;
    va acc[RR * (CC > 0 ? CC : kMaxC)] = {};
    for (int64_t p = 0; p < P; ++p) {
      const va* v = once ? &kv[p * C] : kv.data();
      if (!once) widen(vc + off[p], kv.data(), d, C);
      for (int64_t rr = 0; rr < RR; ++rr) {
        const float e = w[(r0 + rr) * kChunk + p];
        for (int64_t c = 0; c < C; ++c) acc[rr * C + c] += e * v[c];
      }
    }
    for (int64_t rr = 0; rr < RR; ++rr) std::memcpy(part + (r0 + rr) * (d + 2) + 2, &acc[rr * C], d * sizeof(float));
  };
  for (int64_t r0 = 0; r0 < n; r0 += R)   // the last pass takes only the queries left
    by_rows<R>(std::min<int64_t>(R, n - r0), [&](auto rc) { pass(rc, r0); });
}

// One (row, kv head): each query's chunks merged in order, out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) z_c
// (M the largest m_c), rounded once to the dtype.
template <typename T>
void merge_chunks(const float* part, int64_t nc, int64_t Q, int64_t gq, int64_t d, int64_t nh, int64_t h, T* out) {
  const int64_t n = Q * gq, stride = n * (d + 2);
  std::vector<float> acc(d);
  for (int64_t r = 0; r < n; ++r) {
    float M = part[r * (d + 2)];
    for (int64_t c = 1; c < nc; ++c) M = std::max(M, part[c * stride + r * (d + 2)]);
    float z = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t c = 0; c < nc; ++c) {
      const float* pc = part + c * stride + r * (d + 2);
      if (pc[0] == -std::numeric_limits<float>::infinity()) continue;  // the query sees none of this chunk
      const float f = std::exp(pc[0] - M);
      z += f * pc[1];
      for (int64_t i = 0; i < d; ++i) acc[i] += f * pc[2 + i];
    }
    const float iz = 1.f / z;
    T* o = out + ((r / gq) * nh + h * gq + r % gq) * d;
    for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(acc[i] * iz);
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_tables,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens, int64_t block_size,
                           double scale, int64_t max_query) {
  // q [T, nh, d]; cache [2, nkv, S, d] (one layer by slot, head-major); block_tables [B, nb] int64;
  // query_start_loc [B+1], seq_lens [B] int64: row b's queries are the last Q_b of its seq_lens[b] positions.
  // Rows with more than max_query queries are skipped: their output rows are left for the caller to fill.
  // Tasks are (row, kv head, chunk of kChunk positions), then one merge per (row, kv head).
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [T, nh, d] tensor");
  check_cache(cache);
  TORCH_CHECK(cache.size(3) == q.size(2) && cache.scalar_type() == q.scalar_type(), "cache and q disagree");
  const int64_t nh = q.size(1), d = q.size(2), nkv = cache.size(1), S = cache.size(2);
  TORCH_CHECK(nh % nkv == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(d <= kMaxD, "head_dim above ", kMaxD, " is not supported");
  auto bt = block_tables.contiguous();
  auto qsl = query_start_loc.contiguous();
  auto sl = seq_lens.contiguous();
  TORCH_CHECK(bt.scalar_type() == at::kLong && qsl.scalar_type() == at::kLong && sl.scalar_type() == at::kLong,
              "block tables, query starts and lengths must be int64");
  const int64_t B = sl.size(0), nb = bt.size(1);
  TORCH_CHECK(bt.size(0) == B && qsl.size(0) == B + 1, "block tables, query starts and lengths disagree on rows");
  const int64_t *pt = bt.data_ptr<int64_t>(), *pq = qsl.data_ptr<int64_t>(), *pl = sl.data_ptr<int64_t>();
  TORCH_CHECK(pq[B] == q.size(0), "query starts do not cover q");
  const int64_t gq = nh / nkv;
  std::vector<int64_t> first(B + 1, 0), base(B + 1, 0);  // row b: its tasks from first[b], its partials from base[b]
  for (int64_t b = 0; b < B; ++b) {
    const int64_t Q = pq[b + 1] - pq[b];
    TORCH_CHECK(Q >= 0 && pl[b] >= Q && (pl[b] + block_size - 1) / block_size <= nb, "bad row ", b);
    for (int64_t j = 0; j < (pl[b] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(pt[b * nb + j] >= 0 && (pt[b * nb + j] + 1) * block_size <= S, "block id out of range in row ", b);
    const int64_t nc = (Q == 0 || Q > max_query) ? 0 : (pl[b] + kChunk - 1) / kChunk;
    first[b + 1] = first[b] + nkv * nc;
    base[b + 1] = base[b] + nkv * nc * Q * gq * (d + 2);
  }
  auto out = at::empty_like(q);
  auto part = at::empty({base[B]}, q.options().dtype(at::kFloat));
  float* pp = part.data_ptr<float>();
  auto chunks = [&](int64_t b) { return (first[b + 1] - first[b]) / nkv; };
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_attention", [&] {
    const scalar_t *pqv = q.data_ptr<scalar_t>(), *pk = cache.data_ptr<scalar_t>();
    const scalar_t* pv = pk + cache.stride(0);
    const int64_t hs = cache.stride(1);
    scalar_t* po = out.data_ptr<scalar_t>();
    auto* attend = d == 64    ? attend_chunk<scalar_t, 64 / AL>
                   : d == 128 ? attend_chunk<scalar_t, 128 / AL>
                              : attend_chunk<scalar_t, 0>;
    at::parallel_for(0, first[B], 1, [&](int64_t lo, int64_t hi) {
      for (int64_t task = lo; task < hi; ++task) {
        const int64_t b = std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
        const int64_t nc = chunks(b), h = (task - first[b]) / nc, c = (task - first[b]) % nc;
        const int64_t t0 = pq[b], Q = pq[b + 1] - t0;
        attend(pqv + t0 * nh * d, pk + h * hs, pv + h * hs, pt + b * nb, block_size, pl[b], Q, gq, d, nh, h,
               static_cast<float>(scale), c * kChunk, pp + base[b] + (h * nc + c) * Q * gq * (d + 2));
      }
    });
    at::parallel_for(0, B * nkv, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t task = lo; task < hi; ++task) {
        const int64_t b = task / nkv, h = task % nkv, nc = chunks(b), t0 = pq[b], Q = pq[b + 1] - t0;
        if (nc == 0) continue;
        merge_chunks(pp + base[b] + h * nc * Q * gq * (d + 2), nc, Q, gq, d, nh, h, po + t0 * nh * d);
      }
    });
  });
  return out;
}

// a vector's fp32 lanes -> dst (bf16: round to nearest even; finite values: dequantized weights, outputs)
template <typename V, typename T>
inline void store_lanes(V v, T* dst) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    typename Lanes<V>::u32 u;
    std::memcpy(&u, &v, sizeof u);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const typename Lanes<V>::u16 half = __builtin_convertvector(u, typename Lanes<V>::u16);
    std::memcpy(dst, &half, sizeof half);
  } else if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, &v, sizeof v);
  } else {
    for (int64_t i = 0; i < Lanes<V>::n; ++i) dst[i] = static_cast<T>(v[i]);
  }
}

// torch's CPU int4 pack (inner k tiles 2) goes in blocks of 64 rows where torch runs its AVX-512 kernels and of 32
// on AVX2: 4 AL rows either way, where this build's vectors have AL lanes (quant._fused_int4_layout checks that the
// two agree before the int4 ops below serve). A block's column is 2 AL bytes; byte j holds row j in its low nibble
// and row 2 AL + j in its high one.
constexpr int64_t I4B = 4 * AL;

// one column of a block (2 AL bytes at src) -> w[0..3]: the codes of rows [0, AL), [AL, 2 AL) (low nibbles),
// [2 AL, 3 AL), [3 AL, 4 AL) (high) as fp32 lanes
inline void codes_a(const uint8_t* src, va* w) {
#if defined(__AVX512F__)
  const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16)));
  const __m512i m = _mm512_set1_epi32(15);
  w[0] = (va)_mm512_cvtepi32_ps(_mm512_and_si512(a, m));
  w[1] = (va)_mm512_cvtepi32_ps(_mm512_and_si512(b, m));
  w[2] = (va)_mm512_cvtepi32_ps(_mm512_srli_epi32(a, 4));
  w[3] = (va)_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
#else
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8)));
  const __m256i m = _mm256_set1_epi32(15);
  w[0] = (va)_mm256_cvtepi32_ps(_mm256_and_si256(a, m));
  w[1] = (va)_mm256_cvtepi32_ps(_mm256_and_si256(b, m));
  w[2] = (va)_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
  w[3] = (va)_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
#endif
}

// torch's CPU int4 pack (_convert_weight_to_int4pack_for_cpu, inner k tiles 2) of W [n, k]: bytes [n / I4B, k,
// 2 AL] (codes_a). With scales_zeros [k/g, n, 2] (scale s, zero z; w = (q - 8) s + z) -> W^T [k, n] in the scales'
// dtype, each value z - 8 s (rounded to the dtype) + q s in fp32, rounded once: what QuantLinear.weight_t computes.
at::Tensor int4_weight_t(const at::Tensor& qweight, const at::Tensor& sz, int64_t group) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous(), "qweight must be contiguous uint8");
  TORCH_CHECK(sz.dim() == 3 && sz.size(2) == 2 && sz.is_contiguous(), "scales must be a contiguous [k/g, n, 2] tensor");
  const int64_t G = sz.size(0), n = sz.size(1), k = G * group;
  TORCH_CHECK(group > 0 && n % I4B == 0 && qweight.numel() == n * k / 2, "qweight does not match the scales");
  auto out = at::empty({k, n}, sz.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, sz.scalar_type(), "int4_weight_t", [&] {
    const uint8_t* pq = qweight.data_ptr<uint8_t>();
    const scalar_t* ps = sz.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, G, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> s(n), z(n);
      for (int64_t gi = lo; gi < hi; ++gi) {
        for (int64_t r = 0; r < n; ++r) {
          const float sc = f32(ps[(gi * n + r) * 2]);
          s[r] = sc;
          z[r] = f32(static_cast<scalar_t>(f32(ps[(gi * n + r) * 2 + 1]) - 8.f * sc));
        }
        for (int64_t c = gi * group; c < (gi + 1) * group; ++c) {
          scalar_t* row = po + c * n;
          for (int64_t b = 0; b < n / I4B; ++b) {
            va w[4];
            codes_a(pq + (b * k + c) * 2 * AL, w);
            for (int r = 0; r < 4; ++r) {
              const int64_t r0 = b * I4B + AL * r;
              store_lanes(load_lanes<va>(&z[r0], AL) + w[r] * load_lanes<va>(&s[r0], AL), row + r0);
            }
          }
        }
      }
    });
  });
  return out;
}

// ---- AMX tiles (Sapphire Rapids and later): bf16 dot products off the vector ports ---------------------------
#if NIGHTJAR_AMX
// Linux grants a process the tile state on request (arch_prctl); where it refuses, the vector kernels serve.
bool amx_granted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

std::atomic<bool> amx_wanted{true};     // use_amx(False): the vector kernels serve (benchmarks, tests)

bool amx_serves() { return amx_wanted && amx_granted(); }

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
#endif

// use_amx(on) -> whether int4_linear's and int8_linear's bf16 calls run on AMX tiles from now on (False where
// the machine, the build or Linux cannot)
bool use_amx(bool on) {
#if NIGHTJAR_AMX
  amx_wanted = on;
  return amx_serves();
#else
  (void)on;
  return false;
#endif
}

// whether int4_linear's and int8_linear's bf16 calls run on AMX tiles now
bool uses_amx() {
#if NIGHTJAR_AMX
  return amx_serves();
#else
  return false;
#endif
}

// the fp32 lanes of this build's vectors (AL): 16 with AVX-512, else 8; int4 blocks are 4 AL rows (I4B)
int64_t lanes() { return AL; }

// ---- int8_linear: y = x @ (q * scale)^T, int8 weight rows with one scale each -----------------------------
// Tiles of NT weight rows x up to MT rows of x: in fp32, each tile widens the weight rows' codes as it reads them;
// the AVX512-BF16 path widens a weight tile once into a small bf16 buffer that every row of x reuses. The tile's
// MT x NT = AL accumulators stay in registers and are summed together by reduce_a. An output is the same sequence
// of operations whatever M, the tiling or the threads: a row's numbers never depend on the step's other rows (the
// sums are ordered by AL, so AVX-512 and AVX2 builds round differently).
constexpr int NT = 4, MT = AL / NT;        // AVX-512: 4 x 4 accumulators of 16 lanes; AVX2: 2 x 4 of 8
static_assert(MT * NT == AL, "one reduce_a sums a tile");
constexpr int64_t A8_TILES_AHEAD = 8;   // weight tiles of NT rows from a read to its prefetch (18 KB at K = 576)

// AL int8 codes from q as fp32 lanes; fewer n zero-fill
inline va widen_a(const int8_t* q, int64_t n) {
  if (n >= AL) {
#if defined(__AVX512F__)
    return (va)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
#else
    return (va)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
#endif
  }
  va out{};
  for (int64_t i = 0; i < n; ++i) out[i] = q[i];
  return out;
}

// R rows of fp32 x (rows of C va chunks) against the NT weight rows at q[j] (K codes each) -> acc[R * NT]
// (row-major)
template <int R>
inline void tile_f32(const va* x, const int8_t* const* q, int64_t K, int64_t C, va* acc) {
  va a[R][NT] = {};
  for (int64_t c = 0; c < C; ++c) {
    va w[NT];
    // the next tile's rows, a line at a time: NT interleaved streams of K bytes defeat the hardware prefetcher
    // (an LM head of 49152 x 576 at one row took 6.0 ms without this, 2.0 with it, on an AVX2 EPYC)
    if ((AL * c) % 64 == 0)
      for (int j = 0; j < NT; ++j) __builtin_prefetch(q[j] + NT * K + AL * c);
    for (int j = 0; j < NT; ++j) w[j] = widen_a(q[j] + AL * c, K - AL * c);
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < NT; ++j) a[i][j] += x[i * C + c] * w[j];
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NT; ++j) acc[i * NT + j] = a[i][j];
}

#if defined(__AVX512BF16__)
// the same with bf16 x (rows of K) and bf16 weights: one vdpbf16ps per 32 inputs (int8 codes are exact in bf16)
template <int R>
inline void tile_bf16(const c10::BFloat16* x, int64_t K, const __m512bh* w, int64_t C, v16* acc) {
  __m512 a[R][NT];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NT; ++j) a[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c)
    for (int i = 0; i < R; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * K + 32 * c);
      for (int j = 0; j < NT; ++j) a[i][j] = _mm512_dpbf16_ps(a[i][j], xv, w[j * C + c]);
    }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NT; ++j) acc[i * NT + j] = (v16)a[i][j];
}

inline __m512bh widen32_bf16(const int8_t* q) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw)));
  const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1)));
  return _mm512_cvtne2ps_pbh(b, a);                               // elements 0..15 from a, 16..31 from b
}
#endif

// Every (tile t of NT weight rows, tile of mt <= Rows rows of x from m0) of an [M, N] output, the weight tiles split
// among threads: run(mt as a compile-time count, t, m0, mt)
template <int Rows, typename Run>
void each_tile(int64_t M, int64_t N, Run&& run) {
  at::parallel_for(0, (N + NT - 1) / NT, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t)
      for (int64_t m0 = 0; m0 < M; m0 += Rows) {
        const int64_t mt = std::min<int64_t>(Rows, M - m0);
        by_rows<Rows>(mt, [&](auto r) { run(r, t, m0, mt); });
      }
  });
}

// one NT x (up to MT) output tile: acc [MT * NT] -> y rows m0.., columns n0.. scaled by the rows' scales
template <typename S, typename Y>
inline void store_tile(const va* acc, const S* sc, Y* y, int64_t m0, int64_t mt, int64_t n0, int64_t nt,
                       int64_t N) {
  const va sums = reduce_a(acc);
  for (int64_t i = 0; i < mt; ++i)
    for (int64_t j = 0; j < nt; ++j) y[(m0 + i) * N + n0 + j] = static_cast<Y>(sums[i * NT + j] * f32(sc[n0 + j]));
}

// xf [M, C] fp32 chunks of AL lanes (rows zero-padded to C * AL); a last tile of nt < NT weight rows reads row N - 1
// in the missing rows' places and drops their outputs
template <typename S, typename Y>
void int8_linear_f32(const va* xf, const int8_t* q, const S* sc, Y* y, int64_t M, int64_t N, int64_t K) {
  const int64_t C = (K + AL - 1) / AL;
  each_tile<MT>(M, N, [&](auto r, int64_t t, int64_t m0, int64_t mt) {
    const int64_t n0 = t * NT;
    const int8_t* rows[NT];
    for (int64_t j = 0; j < NT; ++j) rows[j] = q + std::min(n0 + j, N - 1) * K;
    va acc[MT * NT] = {};                     // a tile of mt < MT rows leaves the last ones zero for reduce_a
    tile_f32<decltype(r)::value>(xf + m0 * C, rows, K, C, acc);
    store_tile(acc, sc, y, m0, mt, n0, std::min<int64_t>(NT, N - n0), N);
  });
}

#if defined(__AVX512BF16__)
// int8_linear_bf16's tiling: NT weight rows widened once into w (element c of row j: widen(j < nt, n0 + j, c)),
// then every tile of up to MT rows of x against them (tile(r, m0, w, acc)), scaled and stored.
template <typename W, typename S, typename Y, typename Widen, typename Tile>
void int8_tiles(const S* sc, Y* y, int64_t M, int64_t N, int64_t C, Widen&& widen, Tile&& tile) {
  at::parallel_for(0, (N + NT - 1) / NT, 16, [&](int64_t lo, int64_t hi) {
    std::vector<W> w(NT * C);
    va acc[MT * NT];
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t n0 = t * NT, nt = std::min<int64_t>(NT, N - n0);
      for (int64_t j = 0; j < NT; ++j)
        for (int64_t c = 0; c < C; ++c) w[j * C + c] = widen(j < nt, n0 + j, c);
      for (int64_t m0 = 0; m0 < M; m0 += MT) {
        const int64_t mt = std::min<int64_t>(MT, M - m0);
        std::fill(acc, acc + MT * NT, va{});
        by_rows<MT>(mt, [&](auto r) { tile(r, m0, w.data(), acc); });
        store_tile(acc, sc, y, m0, mt, n0, nt, N);
      }
    }
  });
}

template <typename S, typename Y>
void int8_linear_bf16(const c10::BFloat16* x, const int8_t* q, const S* sc, Y* y, int64_t M, int64_t N,
                      int64_t K) {
  const int64_t C = K / 32;
  int8_tiles<__m512bh>(
      sc, y, M, N, C,
      [&](bool ok, int64_t n, int64_t c) {
        return ok ? widen32_bf16(q + n * K + 32 * c) : (__m512bh)_mm512_setzero_si512();
      },
      [&](auto r, int64_t m0, const __m512bh* w, v16* acc) {
        tile_bf16<decltype(r)::value>(x + m0 * K, K, w, C, acc);
      });
}
#endif

#if NIGHTJAR_AMX
// ---- int8_linear on AMX tiles (bf16 x, K % 32 == 0): the weight is the A side ------------------------------
// 16 weight rows at a time are widened to bf16 (as int8_linear_bf16 does) into A tiles of 16 outputs x 32
// inputs; x, transposed once per call into B tiles (16 input pairs x up to 16 rows of x), stays beside them; C
// holds y^T (16 outputs x the rows), summed over all K, then scaled. A row's numbers depend only on its own x.

// x [M, K] -> xt: per tile of 16 rows of x and chunk of 32 inputs, 16 pairs x 16 columns of (x[m][2p], x[m][2p + 1])
// as 32-bit words (columns past M zero)
std::vector<uint32_t> int8_amx_b_tiles(const c10::BFloat16* x, int64_t M, int64_t K) {
  const int64_t tiles = (M + 15) / 16, chunks = K / 32;
  std::vector<uint32_t> xt(tiles * chunks * 256, 0u);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < chunks; ++k)
      for (int64_t p = 0; p < 16; ++p)
        std::memcpy(&xt[((m / 16) * chunks + k) * 256 + p * 16 + m % 16], x + m * K + 32 * k + 2 * p, 4);
  return xt;
}

// tiles 0-1: C (16 outputs x cols fp32), 2-3: A (16 outputs x 32 bf16), 4: B (16 pairs x cols pairs)
void int8_amx_configure(int cols) {
  TileConfig c;
  for (int t = 0; t < 5; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = (t == 2 || t == 3) ? 64 : cols * 4;
  }
  _tile_loadconfig(&c);
}

// chunk k (32 inputs) of 32 weight rows from n0 (zeros past N) in bf16 -> a[j * stride] for row j
inline void int8_amx_widen(const int8_t* q, int64_t n0, int64_t N, int64_t K, int64_t k, __m512bh* a,
                           int64_t stride) {
  for (int64_t j = 0; j < 32; ++j)
    a[j * stride] = n0 + j < N ? widen32_bf16(q + (n0 + j) * K + 32 * k) : (__m512bh)_mm512_setzero_si512();
}

// C tile ct [16 outputs x 16 rows] -> y rows m0.. (up to M), columns n0.. (up to N), scaled
template <typename S, typename Y>
inline void int8_amx_store(const float* ct, const S* sc, Y* y, int64_t m0, int64_t M, int64_t n0, int64_t N) {
  for (int64_t i = 0; i < 16 && m0 + i < M; ++i)
    for (int64_t j = 0; j < 16 && n0 + j < N; ++j)
      y[(m0 + i) * N + n0 + j] = static_cast<Y>(ct[j * 16 + i] * f32(sc[n0 + j]));
}

// 32 outputs at a time, two independent accumulators, so that the tile dot products do not wait on each other.
// With one tile of x (M <= 16, decode and verify steps) the weight is widened chunk by chunk into a buffer that
// stays in L1; with more, all 32 rows' chunks once, for every tile of x. The sums are the same either way.
template <typename S, typename Y>
void int8_linear_amx(const c10::BFloat16* x, const int8_t* q, const S* sc, Y* y, int64_t M, int64_t N,
                     int64_t K) {
  const int64_t chunks = K / 32, cols = std::min<int64_t>(M, 16);
  const bool whole = M > 16;
  const std::vector<uint32_t> xt = int8_amx_b_tiles(x, M, K);
  at::parallel_for(0, (N + 31) / 32, 8, [&](int64_t lo, int64_t hi) {
    std::vector<__m512bh> a(whole ? 32 * chunks : 2 * 32);       // row j, chunk k at j * chunks + k (whole)
    alignas(64) float ct[2][16 * 16];
    int8_amx_configure(static_cast<int>(cols));
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t n0 = t * 32, stride = whole ? chunks : 1;
      for (int64_t k = 0; whole && k < chunks; ++k) int8_amx_widen(q, n0, N, K, k, a.data() + k, chunks);
      for (int64_t m0 = 0; m0 < M; m0 += 16) {
        _tile_zero(0); _tile_zero(1);
        for (int64_t k = 0; k < chunks; ++k) {
          __m512bh* ak = whole ? a.data() + k : a.data() + (k & 1) * 32;
          if (!whole) int8_amx_widen(q, n0, N, K, k, ak, 1);
          _tile_loadd(4, xt.data() + ((m0 / 16) * chunks + k) * 256, 64);
          _tile_loadd(2, ak, stride * 64);
          _tile_loadd(3, ak + 16 * stride, stride * 64);
          _tile_dpbf16ps(0, 2, 4); _tile_dpbf16ps(1, 3, 4);
        }
        _tile_stored(0, ct[0], 64); _tile_stored(1, ct[1], 64);
        int8_amx_store(ct[0], sc, y, m0, M, n0, N);
        int8_amx_store(ct[1], sc, y, m0, M, n0 + 16, N);
      }
    }
    _tile_release();
  });
}
#endif

// tile_f32 with the NT weight rows in one tile of tile_int8_rows's layout (w: the tile; row j's inputs
// 32 k..32 k + 31 at w + 128 k + 32 j): the same multiply-adds in the same order, the tile read as one stream.
// ahead: prefetch the tile A8_TILES_AHEAD on (the first pass over a tile; the others find it in L1).
template <int R>
inline void tile_f32_tiled(const va* x, const int8_t* w, int64_t K, int64_t C, bool ahead, va* acc) {
  constexpr int64_t S = 32 / AL;                                  // AL-lane steps per chunk of 32 inputs
  va a[R][NT] = {};
  for (int64_t k = 0; k < K / 32; ++k) {
    const int8_t* chunk = w + k * 32 * NT;
    if (ahead) {
      __builtin_prefetch(chunk + A8_TILES_AHEAD * NT * K);
      __builtin_prefetch(chunk + A8_TILES_AHEAD * NT * K + 64);
    }
    for (int64_t u = 0; u < S; ++u) {
      va wv[NT];
      for (int j = 0; j < NT; ++j) wv[j] = widen_a(chunk + 32 * j + AL * u, AL);
      for (int i = 0; i < R; ++i)
        for (int j = 0; j < NT; ++j) a[i][j] += x[i * C + k * S + u] * wv[j];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NT; ++j) acc[i * NT + j] = a[i][j];
}

// int8_linear's fp32 path (x widened to fp32, no bf16 or AMX path) with q in tiles of NT rows whose 32-byte chunks
// alternate (tile_int8_rows), as int8_linear_a8 reads them: NT row streams 576 bytes apart ran at ~0.55x the copy
// rate on an AVX2 EPYC, one stream at ~0.9x. x [M, K] (float or bfloat16, K % 32 == 0), q int8 [ceil(N / NT) NT,
// K], scales fp32 [N] -> [M, N] fp32: the same numbers as int8_linear's fp32 path gives for q in row order.
at::Tensor int8_linear_tiled(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float or bfloat16");
  TORCH_CHECK(scales.dim() == 1 && scales.is_contiguous() && scales.scalar_type() == at::kFloat,
              "scales must be a float [N] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = scales.size(0), C = K / AL;
  TORCH_CHECK(K % 32 == 0, "x's columns must be whole chunks of 32");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar && q.size(1) == K &&
              q.size(0) == (N + NT - 1) / NT * NT, "q must be a contiguous int8 [N rounded up to 4, K] tensor");
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y;
  std::vector<va> xf(M * C);                                    // x widened to fp32
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "int8_linear_tiled", [&] {
    const scalar_t* px = x.data_ptr<scalar_t>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < C; ++c) xf[m * C + c] = load_lanes<va>(px + m * K + AL * c, AL);
  });
  const int8_t* pq = q.data_ptr<int8_t>();
  const float* ps = scales.data_ptr<float>();
  float* py = y.data_ptr<float>();
  each_tile<MT>(M, N, [&](auto r, int64_t t, int64_t m0, int64_t mt) {
    va acc[MT * NT] = {};                     // a tile of mt < MT rows leaves the last ones zero for reduce_a
    tile_f32_tiled<decltype(r)::value>(xf.data() + m0 * C, pq + t * NT * K, K, C, m0 == 0, acc);
    store_tile(acc, ps, py, m0, mt, t * NT, std::min<int64_t>(NT, N - t * NT), N);
  });
  return y;
}

// x [M, K] (float or bfloat16) @ (q [N, K] int8 * scales [N])^T -> [M, N] fp32, or in x's dtype with like_x (each
// output rounded once from the same fp32 value)
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, bool like_x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar && q.size(1) == x.size(1),
              "q must be a contiguous int8 [N, K] tensor");
  TORCH_CHECK(scales.dim() == 1 && scales.is_contiguous() && scales.size(0) == q.size(0), "scales must be [N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float or bfloat16");
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kBFloat16,
              "scales must be float or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  auto y = at::empty({M, N}, like_x ? x.options() : x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y;
  const int8_t* pq = q.data_ptr<int8_t>();
  auto run = [&](auto* ps, auto* py) {
#if NIGHTJAR_AMX
    if (x.scalar_type() == at::kBFloat16 && K % 32 == 0 && amx_serves()) {
      int8_linear_amx(x.data_ptr<c10::BFloat16>(), pq, ps, py, M, N, K);
      return;
    }
#endif
#if defined(__AVX512BF16__)
    if (x.scalar_type() == at::kBFloat16 && K % 32 == 0) {
      int8_linear_bf16(x.data_ptr<c10::BFloat16>(), pq, ps, py, M, N, K);
      return;
    }
#endif
    const int64_t C = (K + AL - 1) / AL;
    std::vector<va> xf(M * C);                                    // x widened to fp32, rows zero-padded
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "int8_linear", [&] {
      const scalar_t* px = x.data_ptr<scalar_t>();
      for (int64_t m = 0; m < M; ++m)
        for (int64_t c = 0; c < C; ++c) xf[m * C + c] = load_lanes<va>(px + m * K + AL * c, K - AL * c);
    });
    int8_linear_f32(xf.data(), pq, ps, py, M, N, K);
  };
  auto out = [&](auto* ps) {
    if (y.scalar_type() == at::kBFloat16) run(ps, y.data_ptr<c10::BFloat16>());
    else run(ps, y.data_ptr<float>());
  };
  if (scales.scalar_type() == at::kBFloat16) out(scales.data_ptr<c10::BFloat16>());
  else out(scales.data_ptr<float>());
  return y;
}

// ---- int4_linear: y = x @ W^T with W in torch's CPU int4 pack (see int4_weight_t) and group scales/zeros -----
// One column of a block (2 AL bytes) holds that input's codes for all 4 AL rows, so a block is read once per tile
// of up to MT4 rows of x: per group, codes (exact small integers in fp32) times x accumulate in registers, then
// y += s * acc + (z - 8 s) * (the group's sum of x). An output is the same sequence of operations whatever M, the
// tiling or the threads: a row's numbers never depend on the step's other rows.
constexpr int MT4 = AL == 16 ? 6 : 2;      // rows of x per int4 tile: MT4 x 4 accumulators + 4 code vectors

// a vector's lanes of (scale, zero) pairs at p -> s and z - 8 s as fp32 lanes
template <typename V, typename S>
inline void load_scales(const S* p, V& s, V& zp) {
  const V a = load_lanes<V>(p, Lanes<V>::n), b = load_lanes<V>(p + Lanes<V>::n, Lanes<V>::n);
  if constexpr (Lanes<V>::n == 16) {
    s = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    zp = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31) - 8.f * s;
  } else {
    s = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14);
    zp = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15) - 8.f * s;
  }
}

// one group's sums of x times codes (acc) into an output: y += s * acc + (z - 8 s) * (the group's sum of x); the
// one place this is written, so that every int4 path rounds it alike
inline void group_out(va& y, va acc, va s, float xsum, va zp) { y += acc * s + xsum * zp; }

// R rows of fp32 x [R, K] (group sums xs [R, G]) against one block (bytes [K, 2 AL]) -> y [R, 4 AL] fp32
template <int R, typename S>
inline void int4_tile(const float* x, const float* xs, const uint8_t* blk, const S* sz, int64_t K, int64_t G,
                      int64_t g, int64_t N, va (*y)[4]) {
  for (int i = 0; i < R; ++i)
    for (int r = 0; r < 4; ++r) y[i][r] = va{};
  for (int64_t gi = 0; gi < G; ++gi) {
    va acc[R][4] = {};
    for (int64_t c = gi * g; c < (gi + 1) * g; ++c) {
      va w[4];
      codes_a(blk + c * 2 * AL, w);
      for (int i = 0; i < R; ++i) {
        const float xv = x[i * K + c];
        for (int r = 0; r < 4; ++r) acc[i][r] += xv * w[r];
      }
    }
    for (int r = 0; r < 4; ++r) {
      va s, zp;
      load_scales(sz + (gi * N + AL * r) * 2, s, zp);
      for (int i = 0; i < R; ++i) group_out(y[i][r], acc[i][r], s, xs[i * G + gi], zp);
    }
  }
}

#if !defined(__AVX512F__)
// AVX2 has 16 vector registers: past 2 rows, 4 accumulators a row and the 4 code vectors no longer fit. Calls of
// more rows decode a block's group once into fp32 columns (buf [g][4]: codes_a's vectors) that tiles of up to MT4W
// rows then read half a block (2 accumulators a row) at a time. Each output is the same sequence of operations as
// int4_tile's, so a row's numbers do not depend on which of the two served it.
constexpr int MT4W = 6;

// R rows of fp32 x (columns c0 .. c0 + g) against half h of a decoded group -> acc[R][2]
template <int R>
inline void int4_half_tile(const float* x, int64_t K, const va* buf, int64_t c0, int64_t g, int h, va (*acc)[2]) {
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = va{};
  for (int64_t c = 0; c < g; ++c) {
    const va w0 = buf[c * 4 + 2 * h], w1 = buf[c * 4 + 2 * h + 1];
    for (int i = 0; i < R; ++i) {
      const float xv = x[i * K + c0 + c];
      acc[i][0] += xv * w0;
      acc[i][1] += xv * w1;
    }
  }
}

// all M rows of fp32 x [M, K] (group sums xs [M, G]) against one block -> y [M][4] fp32 (buf: g x 4 vectors)
template <typename S>
void int4_block_wide(const float* x, const float* xs, const uint8_t* blk, const S* sz, int64_t M, int64_t K,
                     int64_t G, int64_t g, int64_t N, va* buf, va (*y)[4]) {
  for (int64_t i = 0; i < M; ++i)
    for (int r = 0; r < 4; ++r) y[i][r] = va{};
  for (int64_t gi = 0; gi < G; ++gi) {
    for (int64_t c = 0; c < g; ++c) codes_a(blk + (gi * g + c) * 2 * AL, buf + c * 4);
    va s[4], zp[4];
    for (int r = 0; r < 4; ++r) load_scales(sz + (gi * N + AL * r) * 2, s[r], zp[r]);
    for (int64_t m0 = 0; m0 < M; m0 += MT4W)
      for (int h = 0; h < 2; ++h)
        by_rows<MT4W>(std::min<int64_t>(MT4W, M - m0), [&](auto rc) {
          constexpr int R = decltype(rc)::value;
          va acc[R][2];
          int4_half_tile<R>(x + m0 * K, K, buf, gi * g, g, h, acc);
          for (int i = 0; i < R; ++i)
            for (int q = 0; q < 2; ++q)
              group_out(y[m0 + i][2 * h + q], acc[i][q], s[2 * h + q], xs[(m0 + i) * G + gi], zp[2 * h + q]);
        });
  }
}
#endif

#if defined(__AVX512BF16__)
// The same for bf16 x, two inputs per vdpbf16ps: a column pair's codes q become the bf16 numbers 128 + q (bits
// 0x4300 | q, exact), interleaved per row; then y += s * acc + (z - 8 s - 128 s) * (the group's sum of x).
// Lanes of the four accumulators hold rows {0-7, 16-23}, {8-15, 24-31}, {32-39, 48-55}, {40-47, 56-63}.

// columns c, c + 1 of a block (64 bytes at src) -> w[r]: (128 + q[c], 128 + q[c + 1]) as bf16 pairs, one per
// output row of accumulator r's lanes
inline void codes_pair_bf16(const uint8_t* src, __m512bh* w) {
  const __m512i m = _mm512_set1_epi8(15), bias = _mm512_set1_epi16(0x4300);
  const __m512i raw = _mm512_loadu_si512(src);
  const __m512i lo = _mm512_and_si512(raw, m), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m);
  const __m256i l0 = _mm512_castsi512_si256(lo), l1 = _mm512_extracti64x4_epi64(lo, 1);
  const __m256i h0 = _mm512_castsi512_si256(hi), h1 = _mm512_extracti64x4_epi64(hi, 1);
  w[0] = (__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_unpacklo_epi8(l0, l1)), bias);
  w[1] = (__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_unpackhi_epi8(l0, l1)), bias);
  w[2] = (__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_unpacklo_epi8(h0, h1)), bias);
  w[3] = (__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_unpackhi_epi8(h0, h1)), bias);
}

// one group's four accumulators (a[r]: lanes as above) -> y[r] += rows * s + xsum * zp, rows in output order
inline void int4_group_out(const v16* a, const v16* s, const v16* zp, float xsum, v16* y) {
  const v16 rows[4] = {
      __builtin_shufflevector(a[0], a[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
      __builtin_shufflevector(a[0], a[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31),
      __builtin_shufflevector(a[2], a[3], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
      __builtin_shufflevector(a[2], a[3], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31)};
  for (int r = 0; r < 4; ++r) y[r] += rows[r] * s[r] + xsum * zp[r];
}

// group gi's scales of a block as s and z - 8 s - 128 s (the codes are 128 + q)
template <typename S>
inline void bf16_scales(const S* sz, int64_t gi, int64_t N, v16* s, v16* zp) {
  for (int r = 0; r < 4; ++r) {
    load_scales(sz + (gi * N + 16 * r) * 2, s[r], zp[r]);
    zp[r] -= 128.f * s[r];
  }
}

template <int R, typename S>
inline void int4_tile_bf16(const c10::BFloat16* x, const float* xs, const uint8_t* blk, const S* sz, int64_t K,
                           int64_t G, int64_t g, int64_t N, v16 (*y)[4]) {
  for (int i = 0; i < R; ++i)
    for (int r = 0; r < 4; ++r) y[i][r] = v16{};
  for (int64_t gi = 0; gi < G; ++gi) {
    __m512 acc[R][4];
    for (int i = 0; i < R; ++i)
      for (int r = 0; r < 4; ++r) acc[i][r] = _mm512_setzero_ps();
    for (int64_t c = gi * g; c < (gi + 1) * g; c += 2) {
      __m512bh w[4];
      codes_pair_bf16(blk + c * 32, w);                                  // columns c, c + 1
      for (int i = 0; i < R; ++i) {
        int32_t pair;
        std::memcpy(&pair, x + i * K + c, sizeof pair);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        for (int r = 0; r < 4; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv, w[r]);
      }
    }
    v16 s[4], zp[4];
    bf16_scales(sz, gi, N, s, zp);
    for (int i = 0; i < R; ++i) {
      const v16 a[4] = {(v16)acc[i][0], (v16)acc[i][1], (v16)acc[i][2], (v16)acc[i][3]};
      int4_group_out(a, s, zp, xs[i * G + gi], y[i]);
    }
  }
}
#endif

#if NIGHTJAR_AMX
// ---- the same on AMX tiles (bf16 x, groups of 32k inputs): the dot products leave the vector ports ----------
// Per block and group the codes are widened once, as int4_tile_bf16 does, into B tiles (16 column pairs x 16
// outputs, one tile per accumulator r); every 16-row tile of x (A) then takes four tdpbf16ps into C tiles that
// hold int4_tile_bf16's accumulators (the same sums; the tiles round differently from vdpbf16ps in the last bit of
// a few outputs), and the same per-group epilogue. A row's numbers depend only on its own x, never on M or the
// other rows (rows past M in the last tile are zeros, computed and dropped).

// tiles 0-3: C (rows x 16 fp32), 4: A (rows x 32 bf16), 5-6: B (16 pairs x 16 outputs x 2 bf16)
void amx_configure(int rows) {
  TileConfig c;
  for (int t = 0; t < 7; ++t) {
    c.rows[t] = t < 5 ? rows : 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// group gi's codes of a block -> its B tiles at bg (per 32-input chunk k, accumulator r: 16 pairs x 64 bytes)
inline void int4_b_tiles(const uint8_t* blk, int64_t gi, int64_t g, uint16_t* bg) {
  for (int64_t k = 0; k < g / 32; ++k)
    for (int64_t p = 0; p < 16; ++p) {
      __m512bh w[4];
      codes_pair_bf16(blk + (gi * g + 32 * k + 2 * p) * 32, w);
      for (int r = 0; r < 4; ++r) _mm512_storeu_si512(bg + ((k * 4 + r) * 16 + p) * 32, (__m512i)w[r]);
    }
}

// tiles 0-3 = the rows of x at xr (row stride K) times one group's B tiles at bg (chunks of 32 inputs)
inline void int4_tile_dots(const c10::BFloat16* xr, int64_t K, const uint16_t* bg, int64_t chunks) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t k = 0; k < chunks; ++k) {
    const uint16_t* b = bg + k * 4 * 16 * 32;
    _tile_loadd(4, xr + 32 * k, K * 2);
    _tile_loadd(5, b, 64); _tile_loadd(6, b + 16 * 32, 64);
    _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, b + 2 * 16 * 32, 64); _tile_loadd(6, b + 3 * 16 * 32, 64);
    _tile_dpbf16ps(2, 4, 5); _tile_dpbf16ps(3, 4, 6);
  }
}

// One 64-output block over all groups for x [Mp, K] (Mp a multiple of rows, or rows = Mp) -> yacc [M, 64].
// The next group's codes are widened (into the other half of bt) after this group's tile dot products are issued,
// so that the two may overlap (measured no faster than widening first, within noise).
template <typename S>
void int4_block_amx(const c10::BFloat16* x, const float* xs, const uint8_t* blk, const S* sz, int64_t M,
                    int64_t rows, int64_t K, int64_t G, int64_t g, int64_t N, uint16_t* bt, float* ct, v16* yacc) {
  const int64_t chunks = g / 32, half = chunks * 4 * 16 * 32;
  for (int64_t i = 0; i < M * 4; ++i) yacc[i] = v16{};
  int4_b_tiles(blk, 0, g, bt);
  for (int64_t gi = 0; gi < G; ++gi) {
    const uint16_t* bg = bt + (gi & 1) * half;
    v16 s[4], zp[4];
    bf16_scales(sz, gi, N, s, zp);
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
      int4_tile_dots(x + m0 * K + gi * g, K, bg, chunks);
      if (m0 == 0 && gi + 1 < G) int4_b_tiles(blk, gi + 1, g, bt + ((gi + 1) & 1) * half);
      _tile_stored(0, ct, 64); _tile_stored(1, ct + 256, 64);
      _tile_stored(2, ct + 512, 64); _tile_stored(3, ct + 768, 64);
      for (int64_t i = 0; i < rows && m0 + i < M; ++i) {
        v16 a[4];
        for (int r = 0; r < 4; ++r) std::memcpy(&a[r], ct + r * 256 + i * 16, sizeof(v16));
        int4_group_out(a, s, zp, xs[(m0 + i) * G + gi], yacc + (m0 + i) * 4);
      }
    }
  }
}

// int4_linear for bf16 x on AMX: y [M, N] bf16
template <typename S>
void int4_linear_amx(const c10::BFloat16* px, const float* xs, const uint8_t* pq, const S* sz, c10::BFloat16* py,
                     int64_t M, int64_t K, int64_t G, int64_t g, int64_t N) {
  const int64_t rows = std::min<int64_t>(M, 16), Mp = (M + rows - 1) / rows * rows;
  std::vector<c10::BFloat16> padded;
  const c10::BFloat16* x = px;
  if (Mp != M) {                                                 // the last tile's missing rows: zeros
    padded.assign(Mp * K, c10::BFloat16(0.f));
    std::memcpy(padded.data(), px, M * K * sizeof(c10::BFloat16));
    x = padded.data();
  }
  at::parallel_for(0, N / 64, 1, [&](int64_t lo, int64_t hi) {
    std::vector<uint16_t> bt(2 * g / 32 * 4 * 16 * 32);
    std::vector<float> ct(4 * 256);
    std::vector<v16> yacc(M * 4);
    amx_configure(static_cast<int>(rows));
    for (int64_t b = lo; b < hi; ++b) {
      int4_block_amx(x, xs, pq + b * K * 32, sz + b * 64 * 2, M, rows, K, G, g, N, bt.data(), ct.data(), yacc.data());
      for (int64_t i = 0; i < M; ++i)
        for (int r = 0; r < 4; ++r) store_lanes(yacc[i * 4 + r], py + i * N + b * 64 + 16 * r);
    }
    _tile_release();
  });
}
#endif

// the checks int4_linear and int4_linear_a8 share (the group a multiple of `step`)
void check_int4_args(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, int64_t group,
                     int64_t step) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float or bfloat16");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous(), "qweight must be contiguous uint8");
  TORCH_CHECK(sz.dim() == 3 && sz.size(2) == 2 && sz.is_contiguous(), "scales must be a contiguous [k/g, n, 2] tensor");
  TORCH_CHECK(sz.scalar_type() == at::kFloat || sz.scalar_type() == at::kBFloat16, "scales must be float or bfloat16");
  const int64_t K = x.size(1), G = sz.size(0), N = sz.size(1);
  TORCH_CHECK(group > 0 && group % step == 0 && G * group == K && N % I4B == 0 && qweight.numel() == N * K / 2,
              "qweight and scales do not match x's width and the group size",
              step > 1 ? " (a multiple of " + std::to_string(step) + ")" : std::string());
}

// x [M, K] (float or bfloat16) @ W^T, W [N, K] packed (uint8 [N / I4B, K, 2 AL]) with scales_zeros [K/g, N, 2]
// -> [M, N] in x's dtype
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, int64_t group) {
  check_int4_args(x, qweight, sz, group, 1);
  const int64_t M = x.size(0), K = x.size(1), G = sz.size(0), N = sz.size(1);
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const uint8_t* pq = qweight.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "int4_linear", [&] {
    const scalar_t* px = x.data_ptr<scalar_t>();
    scalar_t* py = y.data_ptr<scalar_t>();
#if defined(__AVX512BF16__)
    const bool dot_bf16 = std::is_same_v<scalar_t, c10::BFloat16> && group % 2 == 0;   // int4_tile_bf16 reads x
#else
    const bool dot_bf16 = false;
#endif
    std::vector<float> xf(dot_bf16 ? 0 : M * K), xs(M * G);         // x in fp32 (int4_tile), its group sums
    for (int64_t m = 0; m < M; ++m)
      for (int64_t gi = 0; gi < G; ++gi) {
        float s = 0.f;
        for (int64_t c = gi * group; c < (gi + 1) * group; ++c) {
          const float v = f32(px[m * K + c]);
          s += v;
          if (!dot_bf16) xf[m * K + c] = v;
        }
        xs[m * G + gi] = s;
      }
    auto run = [&](const auto* ps) {
#if NIGHTJAR_AMX
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        if (group % 32 == 0 && amx_serves()) {
          int4_linear_amx(px, xs.data(), pq, ps, py, M, K, G, group, N);
          return;
        }
      }
#endif
#if !defined(__AVX512F__)
      if (M > MT4) {
        at::parallel_for(0, N / I4B, 1, [&](int64_t lo, int64_t hi) {
          std::vector<va> buf(group * 4), out(M * 4);
          va (*yb)[4] = reinterpret_cast<va (*)[4]>(out.data());
          for (int64_t b = lo; b < hi; ++b) {
            int4_block_wide(xf.data(), xs.data(), pq + b * K * 2 * AL, ps + b * I4B * 2, M, K, G, group, N,
                            buf.data(), yb);
            for (int64_t i = 0; i < M; ++i)
              for (int r = 0; r < 4; ++r) store_lanes(yb[i][r], py + i * N + b * I4B + AL * r);
          }
        });
        return;
      }
#endif
      at::parallel_for(0, N / I4B, 1, [&](int64_t lo, int64_t hi) {
        va out[MT4][4];
        for (int64_t b = lo; b < hi; ++b)
          for (int64_t m0 = 0; m0 < M; m0 += MT4) {
            const int64_t mt = std::min<int64_t>(MT4, M - m0);
            by_rows<MT4>(mt, [&](auto r) {
              constexpr int R = decltype(r)::value;
              const uint8_t* blk = pq + b * K * 2 * AL;
#if defined(__AVX512BF16__)
              if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
                if (dot_bf16) {
                  int4_tile_bf16<R>(px + m0 * K, xs.data() + m0 * G, blk, ps + b * I4B * 2, K, G, group, N, out);
                  return;
                }
              }
#endif
              int4_tile<R>(xf.data() + m0 * K, xs.data() + m0 * G, blk, ps + b * I4B * 2, K, G, group, N, out);
            });
            for (int64_t i = 0; i < mt; ++i)
              for (int r = 0; r < 4; ++r) store_lanes(out[i][r], py + (m0 + i) * N + b * I4B + AL * r);
          }
      });
    };
    if (sz.scalar_type() == at::kBFloat16) run(sz.data_ptr<c10::BFloat16>());
    else run(sz.data_ptr<float>());
  });
  return y;
}

// ---- int4_linear_a8: int4_linear with x rounded to int8 per group, as llama.cpp's Q8 activations ---------------
// Each row's group of g inputs becomes d q (q = round(x / d) in [-127, 127], d = max |x| / 127), so a weight's
// codes meet x in integer dot products, 32 per instruction (vpmaddubsw: codes 0..15 unsigned, q signed; vpmaddwd
// sums a row's 4 products into 32 bits), then y += (s d) * sum(codes q) + (z - 8 s) * d sum(q): the dequantized
// weights times the rounded x. Runs on 256-bit registers with either build: a block's column (2 AL bytes) is read in
// halves of 16 bytes, byte j of half h holding row 16 h + j (low nibble) and row 2 AL + 16 h + j (high). An output
// is the same sequence of operations whatever M, the tiling or the threads.
constexpr int64_t A8_AHEAD = 128;   // columns from a read to its prefetch (2 KB on AVX2; one row, one thread, 30
                                    // layers: 16.9 -> 13.3 ms here)
constexpr int64_t A8_QUADS = 8;   // quads of inputs summed in 16 bits before widening (vpmaddwd)
constexpr int MTA = 2;   // rows of x per tile: 2 x 4 accumulators beside 4 code vectors in AVX2's 16 registers

// x [M, K] -> per group of g: q [M, K], d [M, G] and the sum of the rounded x, d sum(q) [M, G]; with quads, each
// quad of inputs stored (c, c + 2, c + 1, c + 3) (codes_quad's order), else in order
template <typename T>
void quantize_rows_a8(const T* x, int64_t M, int64_t K, int64_t g, int8_t* q, float* d, float* sum,
                      bool quads = true) {
  const int64_t G = K / g;
  const int order[4] = {0, quads ? 2 : 1, quads ? 1 : 2, 3};
  at::parallel_for(0, M * G, 64, [&](int64_t lo, int64_t hi) {   // (row, group) pairs: a long prefill's too
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t m = t / G, gi = t % G;
      const T* src = x + m * K + gi * g;
      float amax = 0.f;
      bool nan = false;
      for (int64_t c = 0; c < g; ++c) {
        const float v = f32(src[c]);
        amax = std::max(amax, std::fabs(v));
        nan |= v != v;
      }
      const float inv = amax > 0.f && !nan ? 127.f / amax : 0.f;
      int8_t* dst = q + m * K + gi * g;
      int32_t qsum = 0;
      for (int64_t c = 0; c < g; c += 4)
        for (int j = 0; j < 4; ++j) {
          dst[c + j] = static_cast<int8_t>(std::nearbyint(f32(src[c + order[j]]) * inv));
          qsum += dst[c + j];
        }
      d[m * G + gi] = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.f;   // NaN in, NaN out
      sum[m * G + gi] = static_cast<float>(qsum) * d[m * G + gi];
    }
  });
}

// half h of columns c, c + 1 (p: column c's half) -> [c | c + 1]
inline __m256i half_cols(const uint8_t* p) {
  if constexpr (AL == 8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * AL)), 1);
}

// half h of columns c .. c + 3 (p: column c's half) -> u[0], u[1]: 8 rows' bytes each (low nibbles rows 16 h + 8 k,
// high nibbles rows 2 AL + 16 h + 8 k onwards, k = 0, 1), a row's 4 bytes ordered (c, c + 2, c + 1, c + 3)
inline void quad_bytes(const uint8_t* p, __m256i* u) {
  const __m256i a = half_cols(p), b = half_cols(p + 4 * AL);   // [c | c + 1], [c + 2 | c + 3]
  const __m256i pairs = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                         0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
  // unpack: (c, c + 2) per row in the low lane, (c + 1, c + 3) in the high; the permute and shuffle join a row's 4
  u[0] = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(_mm256_unpacklo_epi8(a, b), 0xD8), pairs);
  u[1] = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(_mm256_unpackhi_epi8(a, b), 0xD8), pairs);
}

// A w4a8 layer's codes are stored as quad_bytes leaves them (int4_a8_pack): per quad of columns of a block, for each
// half h, u[0] and u[1] at 64 h and 64 h + 32 (the quad's 8 AL bytes permuted), so the kernel's inner loop reads
// them as they are instead of transposing torch's columns; its scales [G, N, 2] keep their places per 8 rows but
// hold the 8 scales, then the 8 zeros (quant.QuantLinear.from_weight), so that no shuffle takes them apart.

// the 64 bytes of half h of a quad in int4_a8_pack's order (u: their start) -> w[k], 8 rows each: rows 16 h + 8 k
// (k < 2, low nibbles) and 2 AL + 16 h + 8 (k - 2) (high) onwards, a row's 4 codes ordered (c, c + 2, c + 1, c + 3)
inline void codes_quad(const uint8_t* u, __m256i* w) {
  const __m256i u0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u));
  const __m256i u1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 32));
  const __m256i m = _mm256_set1_epi8(15);
  w[0] = _mm256_and_si256(u0, m);
  w[1] = _mm256_and_si256(u1, m);
  w[2] = _mm256_and_si256(_mm256_srli_epi16(u0, 4), m);
  w[3] = _mm256_and_si256(_mm256_srli_epi16(u1, 4), m);
}

// torch's int4 pack [N, K / 2] -> the same bytes in int4_linear_a8's order (above)
at::Tensor int4_a8_pack(const at::Tensor& qweight) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == at::kByte,
              "qweight must be a contiguous uint8 [N, K / 2] tensor");
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  TORCH_CHECK(N % I4B == 0 && K % 4 == 0, "int4_a8_pack needs whole blocks of rows and quads of columns");
  auto out = at::empty_like(qweight);
  const uint8_t* src = qweight.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N * K / (4 * I4B), 64, [&](int64_t lo, int64_t hi) {   // quads: 8 AL bytes each
    for (int64_t t = lo; t < hi; ++t)
      for (int64_t h = 0; h < AL / 8; ++h) {
        __m256i u[2];
        quad_bytes(src + t * 8 * AL + 16 * h, u);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t * 8 * AL + 64 * h), u[0]);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t * 8 * AL + 64 * h + 32), u[1]);
      }
  });
  return out;
}

// The scales of a block's rows lie N pairs apart from one group to the next (on AVX2 with bf16 scales a block's are
// 128 bytes a group), each a miss that the hardware prefetcher does not foresee. Asked for all at once (the first
// two lines a group: all of them there), their latencies overlap.
template <typename S>
inline void prefetch_scales(const S* sz, int64_t G, int64_t N, int64_t r0) {
  for (int64_t gi = 0; gi < G; ++gi) {
    const char* p = reinterpret_cast<const char*>(sz + (gi * N + r0) * 2);
    __builtin_prefetch(p);
    __builtin_prefetch(p + 64);
  }
}

// 8 rows' (scale, zero) of one group in int4_a8_pack's order (p: the rows' first; 8 scales, then 8 zeros) -> s and
// zp = z - 8 s
template <typename S>
inline void load_scales_a8(const S* p, v8& s, v8& zp) {
  s = load_lanes<v8>(p, 8);
  zp = load_lanes<v8>(p + 8, 8) - 8.f * s;
}

// one group's integer sums into an output: y += (s d) * acc + (z - 8 s) * (the group's sum of the rounded x)
inline void group_out_a8(v8& y, __m256i acc, v8 s, float d, float xsum, v8 zp) {
  y += __builtin_convertvector((i8x8)acc, v8) * (s * d) + xsum * zp;
}

// R rows of x (q [R, K], d and sums [R, G]) against half h of a block in int4_a8_pack's order (half: the block's
// start + 64 h, r0: the half's first row) -> y [R][4] (rows as codes_quad's w)
template <int R, typename S>
inline void int4_a8_tile(const int8_t* q, const float* d, const float* xs, const uint8_t* half, const S* sz,
                         int64_t K, int64_t G, int64_t g, int64_t N, int64_t r0, v8 (*y)[4]) {
  const __m256i ones = _mm256_set1_epi16(1);
  prefetch_scales(sz, G, N, r0);
  v8 yl[R][4] = {};          // in registers: y is the caller's memory, which each group would store to
  for (int64_t gi = 0; gi < G; ++gi) {
    __m256i acc[R][4];
    for (int i = 0; i < R; ++i)
      for (int k = 0; k < 4; ++k) acc[i][k] = _mm256_setzero_si256();
    for (int64_t c0 = gi * g; c0 < (gi + 1) * g; c0 += 4 * A8_QUADS) {
      __m256i a16[R][4];          // 16-bit sums of up to A8_QUADS quads: |sum| <= 8 * 2 * 15 * 127 < 2^15
      for (int i = 0; i < R; ++i)
        for (int k = 0; k < 4; ++k) a16[i][k] = _mm256_setzero_si256();
      for (int64_t c = c0; c < std::min(c0 + 4 * A8_QUADS, (gi + 1) * g); c += 4) {
        __m256i w[4];
        __builtin_prefetch(half + (c + A8_AHEAD) * 2 * AL);   // near a block's end: the next block's start
        codes_quad(half + c * 2 * AL, w);                      // c % 4 == 0: the quad's bytes start there
        for (int i = 0; i < R; ++i) {
          int32_t quad;
          std::memcpy(&quad, q + i * K + c, 4);
          const __m256i xb = _mm256_set1_epi32(quad);
          for (int k = 0; k < 4; ++k) a16[i][k] = _mm256_add_epi16(a16[i][k], _mm256_maddubs_epi16(w[k], xb));
        }
      }
      for (int i = 0; i < R; ++i)
        for (int k = 0; k < 4; ++k) acc[i][k] = _mm256_add_epi32(acc[i][k], _mm256_madd_epi16(a16[i][k], ones));
    }
    for (int k = 0; k < 4; ++k) {
      v8 s, zp;
      load_scales_a8(sz + (gi * N + r0 + (k < 2 ? 8 * k : 2 * AL + 8 * (k - 2))) * 2, s, zp);
      for (int i = 0; i < R; ++i) group_out_a8(yl[i][k], acc[i][k], s, d[i * G + gi], xs[i * G + gi], zp);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int k = 0; k < 4; ++k) y[i][k] = yl[i][k];
}

// x [M, K] (float or bfloat16) @ W^T as int4_linear, x rounded to int8 per group -> [M, N] in x's dtype; qweight in
// int4_a8_pack's order, each 8 rows' scales before their zeros
at::Tensor int4_linear_a8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, int64_t group) {
  check_int4_args(x, qweight, sz, group, 4);
  const int64_t M = x.size(0), K = x.size(1), G = sz.size(0), N = sz.size(1);
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const uint8_t* pq = qweight.data_ptr<uint8_t>();
  constexpr int64_t halves = AL / 8;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "int4_linear_a8", [&] {
    scalar_t* py = y.data_ptr<scalar_t>();
    std::vector<int8_t> xq(M * K);
    std::vector<float> xd(M * G), xs(M * G);
    quantize_rows_a8(x.data_ptr<scalar_t>(), M, K, group, xq.data(), xd.data(), xs.data());
    auto run = [&](const auto* ps) {
      at::parallel_for(0, N / I4B * halves, 1, [&](int64_t lo, int64_t hi) {
        v8 out[MTA][4];
        for (int64_t u = lo; u < hi; ++u) {
          const int64_t b = u / halves, h = u % halves, r0 = b * I4B + 16 * h;
          const uint8_t* half = pq + b * K * 2 * AL + 64 * h;
          for (int64_t m0 = 0; m0 < M; m0 += MTA) {
            const int64_t mt = std::min<int64_t>(MTA, M - m0);
            by_rows<MTA>(mt, [&](auto rc) {
              constexpr int R = decltype(rc)::value;
              int4_a8_tile<R>(xq.data() + m0 * K, xd.data() + m0 * G, xs.data() + m0 * G, half, ps, K, G, group,
                              N, r0, out);
            });
            for (int64_t i = 0; i < mt; ++i)
              for (int k = 0; k < 4; ++k)
                store_lanes(out[i][k], py + (m0 + i) * N + r0 + (k < 2 ? 8 * k : 2 * AL + 8 * (k - 2)));
          }
        }
      });
    };
    if (sz.scalar_type() == at::kBFloat16) run(sz.data_ptr<c10::BFloat16>());
    else run(sz.data_ptr<float>());
  });
  return y;
}

// ---- int8_linear_a8: int8_linear with x rounded to int8 per group (a w4a8 model's LM head) -----------------------
// y[m][n] = scale[n] * sum over groups of d[m][g] * sum(q[n][k] x8[m][k]), the group's sum in integers: 32
// products an instruction (vpmaddubsw on |x8| and q given x8's sign; q and x8 in [-127, 127], so a pair's sum fits
// 16 bits), a group's sum widened to fp32 and scaled by d. The weight comes in tiles of NT rows whose 32-byte chunks
// alternate (tile_int8_rows): a tile is read front to back as one stream, which the hardware prefetcher follows
// (NT streams of rows 576 bytes apart ran at ~0.6x the copy rate from DRAM on an AVX2 EPYC; one, ~0.9x). Tiles of
// NT weight rows x up to MT8 rows of x on AVX2's 256-bit registers with either build; an output is the same
// sequence of operations whatever M, the tiling or the threads.
constexpr int MT8 = 2;   // rows of x per tile: 2 x 4 fp32 accumulators beside 4 weight vectors in AVX2's registers
static_assert(MT8 * NT == 8, "one reduce8 sums a tile");

// R rows of int8 x (xq [R, K], d [R, G]) against one weight tile (w: NT rows, chunks alternating) -> acc[R * NT].
// Groups of 32 (one chunk; the head's): a group's x stays in registers while each weight row's integer sums go to
// fp32 at once, so that only the R x NT fp32 accumulators stay live across the group (keeping NT x R integer sums
// as well spilled AVX2's 16 registers to the stack). Each output is the same sequence of operations either way.
template <int R>
inline void int8_a8_tile(const int8_t* xq, const float* d, const int8_t* w, int64_t K, int64_t g, v8* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t G = K / g;
  v8 a[R][NT] = {};
  if (g == 32) {
    for (int64_t gi = 0, c = 0; gi < G; ++gi, c += 32) {
      const int8_t* chunk = w + c * NT;                               // rows 0..NT-1's inputs c..c+31
      __builtin_prefetch(chunk + A8_TILES_AHEAD * NT * K);
      __builtin_prefetch(chunk + A8_TILES_AHEAD * NT * K + 64);
      __m256i xv[R], ax[R];
      for (int i = 0; i < R; ++i) {
        xv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * K + c));
        ax[i] = _mm256_abs_epi8(xv[i]);
      }
      for (int j = 0; j < NT; ++j) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32 * j));
        for (int i = 0; i < R; ++i) {
          const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(ax[i], _mm256_sign_epi8(wv, xv[i])), ones);
          a[i][j] += __builtin_convertvector((i8x8)s32, v8) * d[i * G + gi];
        }
      }
    }
  } else {
    for (int64_t gi = 0; gi < G; ++gi) {
      __m256i s32[R][NT];
      for (int i = 0; i < R; ++i)
        for (int j = 0; j < NT; ++j) s32[i][j] = _mm256_setzero_si256();
      for (int64_t c = gi * g; c < (gi + 1) * g; c += 32) {
        const int8_t* chunk = w + c * NT;
        __builtin_prefetch(chunk + A8_TILES_AHEAD * NT * K);
        __builtin_prefetch(chunk + A8_TILES_AHEAD * NT * K + 64);
        __m256i wv[NT];
        for (int j = 0; j < NT; ++j) wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32 * j));
        for (int i = 0; i < R; ++i) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * K + c));
          const __m256i ax = _mm256_abs_epi8(xv);
          for (int j = 0; j < NT; ++j)
            s32[i][j] = _mm256_add_epi32(
                s32[i][j], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[j], xv)), ones));
        }
      }
      for (int i = 0; i < R; ++i)
        for (int j = 0; j < NT; ++j) a[i][j] += __builtin_convertvector((i8x8)s32[i][j], v8) * d[i * G + gi];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NT; ++j) acc[i * NT + j] = a[i][j];
}

// x [M, K] (float or bfloat16) @ (q * scales [N])^T with x rounded to int8 per group -> [M, N] fp32; q: int8
// [ceil(N / NT) NT, K] in tiles (tile_int8_rows), rows past N ignored
at::Tensor int8_linear_a8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float or bfloat16");
  TORCH_CHECK(scales.dim() == 1 && scales.is_contiguous() && scales.scalar_type() == at::kFloat,
              "scales must be a float [N] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = scales.size(0);
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar && q.size(1) == K &&
              q.size(0) == (N + NT - 1) / NT * NT, "q must be a contiguous int8 [N rounded up to 4, K] tensor");
  TORCH_CHECK(group > 0 && group % 32 == 0 && K % group == 0, "group must be a multiple of 32 dividing K");
  const int64_t G = K / group;
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * G), xs(M * G);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "int8_linear_a8", [&] {
    quantize_rows_a8(x.data_ptr<scalar_t>(), M, K, group, xq.data(), xd.data(), xs.data(), false);
  });
  const int8_t* pq = q.data_ptr<int8_t>();
  const float* ps = scales.data_ptr<float>();
  float* py = y.data_ptr<float>();
  each_tile<MT8>(M, N, [&](auto r, int64_t t, int64_t m0, int64_t mt) {
    v8 acc[MT8 * NT] = {};                    // a tile of mt < MT8 rows leaves the last ones zero for reduce8
    int8_a8_tile<decltype(r)::value>(xq.data() + m0 * K, xd.data() + m0 * G, pq + t * NT * K, K, group, acc);
    const v8 sums = reduce8(acc);
    const int64_t n0 = t * NT, nt = std::min<int64_t>(NT, N - n0);
    for (int64_t i = 0; i < mt; ++i)
      for (int64_t j = 0; j < nt; ++j) py[(m0 + i) * N + n0 + j] = sums[i * NT + j] * ps[n0 + j];
  });
  return y;
}

int64_t first_nan(const float* x, int64_t V) {
  for (int64_t j = 0; j < V; ++j)
    if (x[j] != x[j]) return j;
  return 0;
}

// x [V] -> the first index of its largest value, or of its first NaN (torch.argmax). Two passes: the maximum
// (4 independent vmaxps chains, NaNs noted beside), then the first index holding it. One pass keeping indices in
// 16-lane vectors ran ~3.7 ns a value on AVX2 (its selects split per lane); these take ~12 µs for 49k values
// there, about what torch's max takes.
int64_t argmax_row(const float* x, int64_t V) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m[4] = {ninf, ninf, ninf, ninf}, nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= V; i += 32)
    for (int k = 0; k < 4; ++k) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * k);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      m[k] = _mm256_max_ps(m[k], v);
    }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
  float mx = lanes[0];
  for (int l = 1; l < 8; ++l) mx = std::max(mx, lanes[l]);
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (; i < V; ++i) {
    any_nan |= x[i] != x[i];
    mx = std::max(mx, x[i]);
  }
  if (any_nan) return first_nan(x, V);
  const __m256 mv = _mm256_set1_ps(mx);
  int64_t j = 0;
  for (; j + 8 <= V; j += 8)
    if (const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), mv, _CMP_EQ_OQ)))
      return j + __builtin_ctz(hit);
  for (; j < V; ++j)
    if (x[j] == mx) return j;
  return 0;
}

// ---- bf16_linear: y = x @ W^T for bf16 W on CPUs without bf16 arithmetic (no AVX512-bf16, no AMX) ----------
// torch's bf16 GEMM there runs one GEMV per row (~90 us per row of a 576 x 1536 layer on a 2-vCPU AVX2 EPYC),
// so a step of 16 rows costs 16 steps of one. Here W is held as panels of 16 output columns, P [ceil(N/16), K, 16]
// (zero past N), and each panel is read once per tile of up to MTB rows of x: per input k, the 16 bf16 weights
// widen to fp32 in registers and multiply-add into every row's accumulators. Within a panel's 16 values of one k,
// even places hold outputs 0-7 and odd places outputs 8-15, so one 32-bit lane widens to two weights (its low
// half shifted up, its high half masked). An output is the same sequence of fused multiply-adds over k whatever
// M, the tiling or the threads: a row's numbers never depend on the step's other rows. Vectors are 8 lanes (v8),
// which AVX2 holds in one register each: 6 rows x 2 accumulators + 2 weight vectors + 1 broadcast fit its 16.
constexpr int MTB = 6;                      // rows of x per tile
constexpr int64_t BF16_PANEL = 16;

at::Tensor bf16_panels(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kBFloat16,
              "w must be a contiguous bfloat16 [N, K] tensor");
  const int64_t N = w.size(0), K = w.size(1), NB = (N + BF16_PANEL - 1) / BF16_PANEL;
  auto p = at::zeros({NB, K, BF16_PANEL}, w.options());
  const c10::BFloat16* pw = w.data_ptr<c10::BFloat16>();
  c10::BFloat16* pp = p.data_ptr<c10::BFloat16>();
  at::parallel_for(0, NB, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b)
      for (int64_t j = 0; j < std::min(BF16_PANEL, N - b * BF16_PANEL); ++j) {
        const int64_t place = j < 8 ? 2 * j : 2 * (j - 8) + 1;   // outputs 0-7 even places, 8-15 odd
        for (int64_t k = 0; k < K; ++k) pp[(b * K + k) * BF16_PANEL + place] = pw[(b * BF16_PANEL + j) * K + k];
      }
  });
  return p;
}

template <typename Y>
inline void store_panel_row(const v8& lo, const v8& hi, Y* y, int64_t n) {   // n <= 16 outputs
  for (int64_t j = 0; j < n; ++j) y[j] = static_cast<Y>(j < 8 ? lo[j] : hi[j - 8]);
}

template <int MT, typename Y>
inline void panel_tile(const float* x, int64_t K, const c10::BFloat16* p, Y* y, int64_t N, int64_t n0) {
  v8 lo[MT], hi[MT];
  for (int m = 0; m < MT; ++m) lo[m] = hi[m] = v8{};
  for (int64_t k = 0; k < K; ++k) {
    u32x8 raw;
    std::memcpy(&raw, p + BF16_PANEL * k, sizeof raw);
    const v8 w0 = __builtin_bit_cast(v8, raw << 16);               // outputs 0-7 of input k, fp32
    const v8 w1 = __builtin_bit_cast(v8, raw & 0xFFFF0000u);       // outputs 8-15
    for (int m = 0; m < MT; ++m) {
      const float s = x[m * K + k];
      lo[m] += s * w0;
      hi[m] += s * w1;
    }
  }
  for (int m = 0; m < MT; ++m) store_panel_row(lo[m], hi[m], y + m * N + n0, std::min(BF16_PANEL, N - n0));
}

// x [M, K] (float or bfloat16) @ W^T, W as bf16_panels(W) with N output columns -> [M, N] in x's dtype
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float or bfloat16");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.scalar_type() == at::kBFloat16 &&
              panels.size(1) == x.size(1) && panels.size(2) == BF16_PANEL &&
              panels.size(0) == (N + BF16_PANEL - 1) / BF16_PANEL,
              "panels must be bf16_panels(W) of a bfloat16 [N, K] weight with K = x's columns");
  const int64_t M = x.size(0), K = x.size(1), NB = panels.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const c10::BFloat16* pp = panels.data_ptr<c10::BFloat16>();
  constexpr int64_t CHUNK = 8 * MTB;                              // rows whose fp32 x stays in L2 while panels pass
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "bf16_linear", [&] {
    const scalar_t* px = x.data_ptr<scalar_t>();
    std::vector<float> xf(px, px + M * K);                        // x in fp32 [M, K]
    scalar_t* py = y.data_ptr<scalar_t>();
    for (int64_t c0 = 0; c0 < M; c0 += CHUNK) {
      const int64_t c1 = std::min(M, c0 + CHUNK);
      at::parallel_for(0, NB, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t b = lo; b < hi; ++b)
          for (int64_t m0 = c0; m0 < c1; m0 += MTB)
            by_rows<MTB>(std::min<int64_t>(MTB, c1 - m0), [&](auto r) {
              panel_tile<decltype(r)::value>(xf.data() + m0 * K, K, pp + b * K * BF16_PANEL, py + m0 * N, N,
                                             b * BF16_PANEL);
            });
      });
    }
  });
  return y;
}

// argmax over the last dim of x [N, V] fp32 -> [N] int64, as torch.argmax: the first index of the largest
// value, or of the first NaN (a NaN row is a NaN's argmax in torch too)
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "expected a contiguous fp32 [N, V] tensor");
  const int64_t N = x.size(0), V = x.size(1);
  auto out = at::empty({N}, x.options().dtype(at::kLong));
  const float* px = x.data_ptr<float>();
  int64_t* po = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) po[r] = argmax_row(px + r * V, V);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(nightjar_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor a, Tensor x, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin_signed, Tensor(a!) cache, Tensor slots, int nh) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor cache, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, "
        "int block_size, float scale, int max_query) -> Tensor");
  m.def("int4_weight_t(Tensor qweight, Tensor scales_zeros, int group) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("bf16_panels(Tensor w) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor panels, int n) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor q, Tensor scales, bool like_x=False) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales_zeros, int group) -> Tensor");
  m.def("int4_linear_a8(Tensor x, Tensor qweight, Tensor scales_zeros, int group) -> Tensor");
  m.def("int8_linear_a8(Tensor x, Tensor q, Tensor scales, int group) -> Tensor");
  m.def("int8_linear_tiled(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.def("int4_a8_pack(Tensor qweight) -> Tensor");
  m.def("use_amx(bool on) -> bool", use_amx);           // no tensor: one kernel for every backend
  m.def("uses_amx() -> bool", uses_amx);
  m.def("lanes() -> int", lanes);
}

TORCH_LIBRARY_IMPL(nightjar_cpu, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("silu_mul", silu_mul);
  m.impl("rope_store", rope_store);
  m.impl("paged_attention", paged_attention);
  m.impl("int4_weight_t", int4_weight_t);
  m.impl("argmax_rows", argmax_rows);
  m.impl("bf16_panels", bf16_panels);
  m.impl("bf16_linear", bf16_linear);
  m.impl("int8_linear", int8_linear);
  m.impl("int4_linear", int4_linear);
  m.impl("int4_linear_a8", int4_linear_a8);
  m.impl("int8_linear_a8", int8_linear_a8);
  m.impl("int8_linear_tiled", int8_linear_tiled);
  m.impl("int4_a8_pack", int4_a8_pack);
}
