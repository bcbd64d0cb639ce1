"""C++ source of the CPU kernels, compiled on first use by :mod:`lightning_gradcomp.kernels._build`.

Kept as a Python string so the package needs no data files. Design choices, once:

* Every kernel works on tiles of a few thousand elements that stay in L1/L2; the hot per-tile loops are
  plain loops the compiler auto-vectorises. They are compiled for several instruction sets at once with GCC's
  ``target_clones`` (picked at load time by the CPU), so one build runs on any x86-64 machine: no
  ``-march=native``.
* Tiles are distributed over torch's intra-op threads (``at::parallel_for``, OpenMP) and every partial result
  is combined in a fixed order, so results never depend on the thread count.
* Float reductions keep 16 independent lanes: GCC vectorises them without ``-ffast-math``.
* The random stream is a keyed integer hash of the element index (counter-based): element i of a tensor
  draws ``lowbias32(lowbias32(i + k0) ^ k1)``, the same on CPU, in the torch-ops fallback and on CUDA.
"""

CPU_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && __GNUC__ >= 11
// the x86-64 micro-architecture levels: v4 adds AVX-512 BW/VL to F, which the byte narrowing of the ternary codes
// and packing need (with "avx512f" alone the ternarize + pack kernel ran at 2/3 of this speed on AMD EPYC)
#define LGC_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"), noinline))
#elif defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define LGC_CLONES __attribute__((target_clones("avx512f", "avx2", "default"), noinline))
#else
#define LGC_CLONES
#endif

namespace {

constexpr int64_t kTile = 16384;  // elements per tile (input side)

// at least this many elements per thread: small tensors stay on one thread, where a fork/join (and, on a
// busy machine, waiting for a descheduled sibling thread) would cost more than the work
inline int64_t grain(int64_t elems_per_item) {
  return std::max<int64_t>(1, (8 * kTile) / std::max<int64_t>(1, elems_per_item));
}

inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

inline uint32_t hash_index(uint32_t i, uint32_t k0, uint32_t k1) { return lowbias32(lowbias32(i + k0) ^ k1); }

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// the caller's output buffer (float32, n elements, contiguous), or a new one when it passes an empty tensor:
// writing into a reused buffer skips the page faults of a fresh allocation
torch::Tensor output(torch::Tensor out, int64_t n) {
  if (out.numel() == 0 && n != 0) return torch::empty({n}, torch::kFloat32);
  check_f32(out, "out");
  TORCH_CHECK(out.numel() == n, "out has ", out.numel(), " elements, expected ", n);
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// TernGrad statistics: per tile sum, sum of squares (double lanes) and max|g| (float lanes)

// GCC vector extensions: explicit 8-wide lanes that each target_clones variant lowers to its own registers
// (one ymm on AVX2, halves of a zmm on AVX-512, two xmm on the SSE2 baseline).
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));
typedef double d8 __attribute__((vector_size(64)));

inline f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f8 abs8(f8 v) {
  i8v bits = (i8v)v & 0x7fffffff;
  return (f8)bits;
}

// max that propagates NaN as torch.amax does: a plain `m > a ? m : a` forgets a NaN at the next comparison, so a
// NaN gradient would get a finite scaler here but a NaN one on the torch backend
inline f8 nanmax8(f8 m, f8 a) { return ((m > a) | (m != m)) ? m : a; }
inline float nanmax(float m, float a) { return (m > a || m != m) ? m : a; }

LGC_CLONES void stats_tile(const float* x, int64_t n, double* out3) {
  d8 s = {0}, q = {0};
  f8 m = {0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    f8 v = load8(x + i);
    f8 a = abs8(v);
    m = nanmax8(m, a);
    d8 d = __builtin_convertvector(v, d8);
    s += d;
    q += d * d;
  }
  double S = 0, Q = 0;
  float M = 0;
  for (int l = 0; l < 8; ++l) {
    S += s[l];
    Q += q[l];
    M = nanmax(M, m[l]);
  }
  for (; i < n; ++i) {
    double d = (double)x[i];
    S += d;
    Q += d * d;
    M = nanmax(M, std::fabs(x[i]));
  }
  out3[0] = S;
  out3[1] = Q;
  out3[2] = (double)M;
}

// Work items: (chunk, tile within chunk). A chunk is `bucket` elements (the last may be shorter).
struct Items {
  int64_t n, bucket, tiles_per_chunk, chunks;
  Items(int64_t n_, int64_t bucket_) : n(n_), bucket(bucket_) {
    chunks = (n + bucket - 1) / bucket;
    tiles_per_chunk = (bucket + kTile - 1) / kTile;
  }
  int64_t count() const { return chunks * tiles_per_chunk; }
  // [begin, end) of item w, possibly empty in the short last chunk
  void range(int64_t w, int64_t* b, int64_t* e) const {
    int64_t c = w / tiles_per_chunk, t = w % tiles_per_chunk;
    int64_t cb = c * bucket, ce = std::min(n, cb + bucket);
    *b = std::min(ce, cb + t * kTile);
    *e = std::min(ce, *b + kTile);
  }
};

// returns [chunks, 2] float32: sigma (population), max|g|
torch::Tensor terngrad_stats(torch::Tensor g, int64_t bucket) {
  check_f32(g, "g");
  const int64_t n = g.numel();
  TORCH_CHECK(n > 0 && bucket > 0, "empty tensor or bucket");
  Items items(n, bucket);
  std::vector<double> part(items.count() * 3, 0.0);
  const float* x = g.data_ptr<float>();
  at::parallel_for(0, items.count(), grain(std::min(bucket, kTile)), [&](int64_t wb, int64_t we) {
    for (int64_t w = wb; w < we; ++w) {
      int64_t b, e;
      items.range(w, &b, &e);
      if (e > b) stats_tile(x + b, e - b, &part[w * 3]);
    }
  });
  auto out = torch::empty({items.chunks, 2}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  for (int64_t c = 0; c < items.chunks; ++c) {  // fixed order: independent of the thread count
    double S = 0, Q = 0, M = 0;
    for (int64_t t = 0; t < items.tiles_per_chunk; ++t) {
      const double* p = &part[(c * items.tiles_per_chunk + t) * 3];
      S += p[0];
      Q += p[1];
      M = (M > p[2] || M != M) ? M : p[2];  // NaN-propagating, as nanmax
    }
    double cnt = (double)(std::min(n, (c + 1) * bucket) - c * bucket);
    double mean = S / cnt;
    double var = Q / cnt - mean * mean;
    var = var < 0.0 ? 0.0 : var;  // rounding below 0 clamped, NaN kept (std::max(0.0, NaN) is 0), as clamp_min
    o[2 * c] = (float)std::sqrt(var);
    o[2 * c + 1] = (float)M;
  }
  return out;
}

// The scaler and clip threshold per chunk from the statistics, in one call: terngrad_scaler (kernels/terngrad.py)
// is four torch ops on tensors of one element per chunk, whose dispatch cost more than the statistics pass of a
// small tensor. Float32 arithmetic with the constants rounded to float first, and NaN propagated as
// torch.minimum does, so the result equals the torch ops' bit for bit. clip_mode: 0 none (scaler max|g|),
// 1 "paper" (clip at the threshold, scaler min(max|g|, threshold)), 2 "code" (scaler = threshold, no clip).
std::vector<torch::Tensor> terngrad_scale_clip(torch::Tensor g, int64_t bucket, double clip_factor, int64_t clip_mode,
                                               double sigma_noise) {
  TORCH_CHECK(clip_mode >= 0 && clip_mode <= 2, "clip_mode must be 0, 1 or 2");
  torch::Tensor stats = terngrad_stats(g, bucket);
  const int64_t chunks = stats.size(0);
  const float* st = stats.data_ptr<float>();
  auto scale = torch::empty({chunks}, torch::kFloat32);
  auto clip = torch::empty({clip_mode == 1 ? chunks : 0}, torch::kFloat32);
  float* sp = scale.data_ptr<float>();
  float* cp = clip.data_ptr<float>();
  const float noise = (float)sigma_noise, factor = (float)clip_factor;
  for (int64_t c = 0; c < chunks; ++c) {
    const float sigma = st[2 * c], absmax = st[2 * c + 1];
    if (clip_mode == 0) {
      sp[c] = absmax;
      continue;
    }
    const float threshold = sigma <= noise * absmax ? absmax : sigma * factor;
    if (clip_mode == 2) {
      sp[c] = threshold;
      continue;
    }
    cp[c] = threshold;
    sp[c] = (std::isnan(absmax) || std::isnan(threshold)) ? NAN : std::min(absmax, threshold);
  }
  return {scale, clip};
}

// ---------------------------------------------------------------------------------------------------------
// TernGrad ternarize: codes c = t + 1 in {0,1,2}; keep ~ Bernoulli(min(|g|, clip) / s) as u*s < min(|g|, clip)

LGC_CLONES void ternary_codes(const float* __restrict x, int64_t len, uint32_t base, float s, float clip, uint32_t k0,
                              uint32_t k1, uint8_t* __restrict codes) {
  // int loop counter and branch-free arithmetic: what GCC's vectoriser needs here (len <= kTile)
  const int n = (int)len;
  for (int i = 0; i < n; ++i) {
    float v = x[i];
    float a = std::fabs(v);
    a = a > clip ? clip : a;  // min(|g|, clip) keeping a NaN (never kept: NaN is sent as 0, as torch.minimum)
    uint32_t h = hash_index(base + (uint32_t)i, k0, k1);
    float u = (float)(int32_t)(h >> 8) * 5.9604644775390625e-08f;  // 2^-24: the 24-bit uniform of torch.rand
    int32_t keep = u * s < a;
    int32_t neg = v < 0.0f;
    codes[i] = (uint8_t)(1 + keep - 2 * (keep & neg));  // keep ? sign(v) + 1 : 1 (v != 0 when kept)
  }
}

// codes for flat range [b, e) (e may exceed n: padding code 1), split at chunk boundaries
void codes_range(const float* x, int64_t n, int64_t b, int64_t e, int64_t bucket, const float* s,
                 const float* clip, uint32_t k0, uint32_t k1, uint8_t* codes) {
  int64_t i = b;
  while (i < e) {
    if (i >= n) {
      std::memset(codes + (i - b), 1, e - i);
      break;
    }
    int64_t c = i / bucket;
    int64_t seg_end = std::min(std::min(e, n), (c + 1) * bucket);
    ternary_codes(x + i, seg_end - i, (uint32_t)i, s[c], clip ? clip[c] : INFINITY, k0, k1, codes + (i - b));
    i = seg_end;
  }
}

LGC_CLONES int64_t pack4(const uint8_t* c0, const uint8_t* c1, const uint8_t* c2, const uint8_t* c3, int64_t len,
                         uint8_t* out) {
  int64_t ones = 0;
  for (int64_t k = 0; k < len; ++k) {
    out[k] = (uint8_t)(c0[k] | (c1[k] << 2) | (c2[k] << 4) | (c3[k] << 6));
    ones += (c0[k] == 1) + (c1[k] == 1) + (c2[k] == 1) + (c3[k] == 1);
  }
  return ones;
}

// 2-bit quarter-split packing fused with ternarization. Returns (packed uint8[m], int64 nonzero count).
std::vector<torch::Tensor> terngrad_ternarize_pack(torch::Tensor g, torch::Tensor scale, torch::Tensor clip,
                                                   int64_t bucket, int64_t k0, int64_t k1) {
  check_f32(g, "g");
  check_f32(scale, "scale");
  const int64_t n = g.numel();
  const int64_t m = (n + 3) / 4;
  const bool has_clip = clip.numel() > 0;
  if (has_clip) check_f32(clip, "clip");
  auto out = torch::empty({m}, torch::kUInt8);
  const float* x = g.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float* cp = has_clip ? clip.data_ptr<float>() : nullptr;
  uint8_t* op = out.data_ptr<uint8_t>();
  const int64_t T = kTile / 4;  // output bytes per tile
  const int64_t tiles = (m + T - 1) / T;
  std::vector<int64_t> ones(tiles, 0);
  at::parallel_for(0, tiles, grain(kTile), [&](int64_t tb, int64_t te) {
    std::vector<uint8_t> buf(4 * T);
    for (int64_t t = tb; t < te; ++t) {
      int64_t kb = t * T, ke = std::min(m, kb + T), len = ke - kb;
      for (int j = 0; j < 4; ++j)
        codes_range(x, n, j * m + kb, j * m + ke, bucket, sp, cp, (uint32_t)k0, (uint32_t)k1, &buf[j * T]);
      ones[t] = pack4(&buf[0], &buf[T], &buf[2 * T], &buf[3 * T], len, op + kb);
    }
  });
  int64_t total_ones = 0;
  for (int64_t v : ones) total_ones += v;
  int64_t nonzero = 4 * m - total_ones;  // padding codes are 1 (zero) and counted in ones
  return {out, torch::tensor({nonzero}, torch::kInt64)};
}

LGC_CLONES int64_t codes_to_values(const uint8_t* __restrict codes, int len, int8_t* __restrict out) {
  int32_t cnt = 0;
  for (int i = 0; i < len; ++i) {
    out[i] = (int8_t)(codes[i] - 1);
    cnt += codes[i] != 1;
  }
  return cnt;
}

// the int8 form (values in {-1,0,1}) for the summable all-reduce. Returns (int8[n], int64 nonzero count).
std::vector<torch::Tensor> terngrad_ternarize_int8(torch::Tensor g, torch::Tensor scale, torch::Tensor clip,
                                                   int64_t bucket, int64_t k0, int64_t k1) {
  check_f32(g, "g");
  check_f32(scale, "scale");
  const int64_t n = g.numel();
  const bool has_clip = clip.numel() > 0;
  if (has_clip) check_f32(clip, "clip");
  auto out = torch::empty({n}, torch::kInt8);
  const float* x = g.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float* cp = has_clip ? clip.data_ptr<float>() : nullptr;
  int8_t* op = out.data_ptr<int8_t>();
  const int64_t tiles = (n + kTile - 1) / kTile;
  std::vector<int64_t> nz(tiles, 0);
  at::parallel_for(0, tiles, grain(kTile), [&](int64_t tb, int64_t te) {
    std::vector<uint8_t> codes(kTile);
    for (int64_t t = tb; t < te; ++t) {
      int64_t b = t * kTile, e = std::min(n, b + kTile);
      codes_range(x, n, b, e, bucket, sp, cp, (uint32_t)k0, (uint32_t)k1, codes.data());
      nz[t] = codes_to_values(codes.data(), (int)(e - b), op + b);
    }
  });
  int64_t total = 0;
  for (int64_t v : nz) total += v;
  return {out, torch::tensor({total}, torch::kInt64)};
}

// ---------------------------------------------------------------------------------------------------------
// TernGrad decode: unpack the quarter-split layout and scale; decode-and-sum with a shared scaler

LGC_CLONES void scale_codes(const uint8_t* packed, int64_t len, int shift, float s, float* out) {
  for (int64_t k = 0; k < len; ++k) out[k] = (float)((int)((packed[k] >> shift) & 3) - 1) * s;
}

// (sum - offset) * s, then the mean's division: a power-of-two divisor is a multiplication by its exact
// reciprocal (the same correctly rounded result as dividing), anything else a true division, so the result
// equals decoding and then dividing in float32 bit for bit. Sums come as bytes (up to 127 payloads) or int32.
template <bool kDivide, typename Sum>
inline void scale_sums_impl(const Sum* sums, int64_t len, int32_t offset, float s, float d, float* out) {
  for (int64_t k = 0; k < len; ++k) {
    float v = (float)((int32_t)sums[k] - offset) * s;
    out[k] = kDivide ? v / d : v * d;
  }
}
LGC_CLONES void scale_bytes_div(const uint8_t* sums, int64_t len, int32_t offset, float s, float d, float* out) {
  scale_sums_impl<true>(sums, len, offset, s, d, out);
}
LGC_CLONES void scale_bytes_mul(const uint8_t* sums, int64_t len, int32_t offset, float s, float d, float* out) {
  scale_sums_impl<false>(sums, len, offset, s, d, out);
}
LGC_CLONES void scale_counts_div(const int32_t* sums, int64_t len, int32_t offset, float s, float d, float* out) {
  scale_sums_impl<true>(sums, len, offset, s, d, out);
}
LGC_CLONES void scale_counts_mul(const int32_t* sums, int64_t len, int32_t offset, float s, float d, float* out) {
  scale_sums_impl<false>(sums, len, offset, s, d, out);
}

// Up to 127 payloads: each quarter's sum of codes (<= 2 * 127) in a byte of its own, fields[j * len + k].
// Explicit 64-byte vectors of 64-bit lanes (SWAR): masking after the shift keeps every field inside its byte,
// and byte sums never carry, so lane-wide adds equal per-byte adds. Left to the auto-vectoriser, such loops
// vectorised for some payload counts and not others (5-50x apart).
constexpr int kByteMaxPayloads = 127;
typedef uint64_t u64x8 __attribute__((vector_size(64)));
LGC_CLONES void byte_sums(const uint8_t* const* payloads, int count, int64_t kb, int64_t len, uint8_t* __restrict fields) {
  const uint64_t mask = 0x0303030303030303ULL;
  int64_t k = 0;
  for (; k + 64 <= len; k += 64) {
    u64x8 f0 = {0}, f1 = {0}, f2 = {0}, f3 = {0};
    for (int w = 0; w < count; ++w) {
      u64x8 b;
      std::memcpy(&b, payloads[w] + kb + k, sizeof b);
      f0 += b & mask;
      f1 += (b >> 2) & mask;
      f2 += (b >> 4) & mask;
      f3 += (b >> 6) & mask;
    }
    std::memcpy(fields + k, &f0, sizeof f0);
    std::memcpy(fields + len + k, &f1, sizeof f1);
    std::memcpy(fields + 2 * len + k, &f2, sizeof f2);
    std::memcpy(fields + 3 * len + k, &f3, sizeof f3);
  }
  for (; k < len; ++k) {
    uint8_t f[4] = {0, 0, 0, 0};
    for (int w = 0; w < count; ++w) {
      uint8_t b = payloads[w][kb + k];
      for (int j = 0; j < 4; ++j) f[j] += (b >> (2 * j)) & 3;
    }
    for (int j = 0; j < 4; ++j) fields[j * len + k] = f[j];
  }
}

LGC_CLONES void accumulate_codes(const uint8_t* packed, int64_t len, int32_t* a0, int32_t* a1, int32_t* a2,
                                 int32_t* a3) {
  for (int64_t k = 0; k < len; ++k) {
    int32_t b = packed[k];
    a0[k] += b & 3;
    a1[k] += (b >> 2) & 3;
    a2[k] += (b >> 4) & 3;
    a3[k] += b >> 6;
  }
}

// Calls f(quarter j, byte offset kb2, length, flat index i, chunk c) for the pieces of byte range [kb, ke)
// of quarter j that lie below n and within one chunk.
template <typename F>
void for_segments(int64_t n, int64_t m, int64_t bucket, int64_t kb, int64_t ke, F f) {
  for (int j = 0; j < 4; ++j) {
    int64_t i = j * m + kb, e = std::min(n, j * m + ke);
    while (i < e) {
      int64_t c = i / bucket;
      int64_t seg_end = std::min(e, (c + 1) * bucket);
      f(j, i - j * m, seg_end - i, i, c);
      i = seg_end;
    }
  }
}

torch::Tensor terngrad_decode(torch::Tensor packed, int64_t n, torch::Tensor scale, int64_t bucket, torch::Tensor out_) {
  check_f32(scale, "scale");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed must be contiguous uint8");
  const int64_t m = (n + 3) / 4;
  TORCH_CHECK(packed.numel() == m, "packed has ", packed.numel(), " bytes, expected ", m);
  auto out = output(out_, n);
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t T = kTile / 4;
  const int64_t tiles = (m + T - 1) / T;
  at::parallel_for(0, tiles, grain(kTile), [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t) {
      int64_t kb = t * T, ke = std::min(m, kb + T);
      for_segments(n, m, bucket, kb, ke, [&](int j, int64_t k, int64_t len, int64_t i, int64_t c) {
        scale_codes(p + k, len, 2 * j, sp[c], op + i);
      });
    }
  });
  return out;
}

// sum over payloads (rank order irrelevant: integer accumulation is exact), scaled once, then divided by
// `divisor` (the mean over ranks; 1: the sum)
torch::Tensor terngrad_decode_sum(std::vector<torch::Tensor> packed, int64_t n, torch::Tensor scale, int64_t bucket,
                                  torch::Tensor out_, int64_t divisor) {
  check_f32(scale, "scale");
  TORCH_CHECK(divisor >= 1, "divisor must be >= 1, got ", divisor);
  const int64_t m = (n + 3) / 4;
  std::vector<const uint8_t*> ptrs;
  for (auto& t : packed) {
    TORCH_CHECK(t.scalar_type() == torch::kUInt8 && t.is_contiguous() && t.numel() == m,
                "every payload must be contiguous uint8 of ", m, " bytes");
    ptrs.push_back(t.data_ptr<uint8_t>());
  }
  TORCH_CHECK(!ptrs.empty(), "no payloads");
  const int32_t offset = (int32_t)ptrs.size();  // each code is t + 1
  const bool pow2 = (divisor & (divisor - 1)) == 0;
  const float d = pow2 ? 1.0f / (float)divisor : (float)divisor;
  auto out = output(out_, n);
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t T = kTile / 4;
  const int64_t tiles = (m + T - 1) / T;
  // exact sums in bytes up to 127 payloads, in int32 beyond
  const bool bytes = offset <= kByteMaxPayloads;
  at::parallel_for(0, tiles, grain(kTile), [&](int64_t tb, int64_t te) {
    std::vector<int32_t> acc(bytes ? 0 : 4 * T);
    std::vector<uint8_t> fields(bytes ? 4 * T : 0);
    for (int64_t t = tb; t < te; ++t) {
      int64_t kb = t * T, ke = std::min(m, kb + T), len = ke - kb;
      if (bytes) {
        byte_sums(ptrs.data(), offset, kb, len, fields.data());
        for_segments(n, m, bucket, kb, ke, [&](int j, int64_t k, int64_t len2, int64_t i, int64_t c) {
          (pow2 ? scale_bytes_mul : scale_bytes_div)(&fields[j * len + (k - kb)], len2, offset, sp[c], d, op + i);
        });
        continue;
      }
      std::fill(acc.begin(), acc.end(), 0);
      for (const uint8_t* p : ptrs) accumulate_codes(p + kb, len, &acc[0], &acc[T], &acc[2 * T], &acc[3 * T]);
      for_segments(n, m, bucket, kb, ke, [&](int j, int64_t k, int64_t len2, int64_t i, int64_t c) {
        (pow2 ? scale_counts_mul : scale_counts_div)(&acc[j * T + (k - kb)], len2, offset, sp[c], d, op + i);
      });
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// Selection

// |x| at strided (mode 0: i * (n / S)) or hashed random (mode 1: hash(i) % n) positions
torch::Tensor sample_abs(torch::Tensor x, int64_t size, int64_t mode, int64_t k0, int64_t k1) {
  check_f32(x, "x");
  const int64_t n = x.numel();
  auto out = torch::empty({size}, torch::kFloat32);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t stride = std::max<int64_t>(1, n / std::max<int64_t>(1, size));
  for (int64_t i = 0; i < size; ++i) {
    int64_t j = mode == 0 ? i * stride : (int64_t)(hash_index((uint32_t)i, (uint32_t)k0, (uint32_t)k1) % (uint64_t)n);
    op[i] = std::fabs(xp[j]);
  }
  return out;
}

// the k-th smallest (0-based) value: an exact order statistic, like torch.kthvalue(sample, k + 1), NaN ranked above
// every number as torch ranks it (a plain `<` is no strict weak order with NaN: nth_element's result is then arbitrary)
double kth_smallest(torch::Tensor sample, int64_t k) {
  check_f32(sample, "sample");
  std::vector<float> v(sample.data_ptr<float>(), sample.data_ptr<float>() + sample.numel());
  TORCH_CHECK(k >= 0 && k < (int64_t)v.size(), "k out of range");
  std::nth_element(v.begin(), v.begin() + k, v.end(), [](float a, float b) { return a < b || (a == a && b != b); });
  return (double)v[k];
}

// whether |x| = a passes thr: a > thr (ge: a >= thr); with nan, also when unordered (a NaN |x|, or a NaN thr):
// "not at or below the threshold", Gradient Dropping's drop rule inverted
template <bool ge, bool nan>
inline bool passes(float a, float thr) {
  return nan ? !(ge ? a < thr : a <= thr) : (ge ? a >= thr : a > thr);
}
template <bool ge, bool nan>
inline i8v passes8(f8 a, f8 tv) {
  if constexpr (nan && ge) return ~(a < tv);
  if constexpr (nan && !ge) return ~(a <= tv);
  if constexpr (!nan && ge) return a >= tv;
  return a > tv;
}

// indices base + i of the |x[i]| that pass thr (see passes) for i < len, ascending, into out (room for len); returns
// the count. Groups of 16 are tested at vector speed and scanned only when one of them is selected.
template <bool ge, bool nan>
inline int select_tile_impl(const float* x, int len, float thr, int32_t base, int32_t* out) {
  const f8 tv = f8{} + thr;
  int c = 0, g = 0;
  for (; g + 16 <= len; g += 16) {
    f8 a0 = abs8(load8(x + g)), a1 = abs8(load8(x + g + 8));
    i8v hit = passes8<ge, nan>(a0, tv) | passes8<ge, nan>(a1, tv);
    uint64_t words[4];
    std::memcpy(words, &hit, sizeof words);
    if (!(words[0] | words[1] | words[2] | words[3])) continue;
    for (int j = g; j < g + 16; ++j) {  // branch-free compaction: no mispredicted branches
      out[c] = base + j;
      c += passes<ge, nan>(std::fabs(x[j]), thr);
    }
  }
  for (; g < len; ++g) {
    if (passes<ge, nan>(std::fabs(x[g]), thr)) out[c++] = base + g;
  }
  return c;
}

// Gradient Dropping's survivors: not |x| <= thr (so a NaN survives), or with inclusive not |x| < thr
LGC_CLONES int select_tile_gt_nan(const float* x, int len, float thr, int32_t base, int32_t* out) {
  return select_tile_impl<false, true>(x, len, thr, base, out);
}

LGC_CLONES int select_tile_ge_nan(const float* x, int len, float thr, int32_t base, int32_t* out) {
  return select_tile_impl<true, true>(x, len, thr, base, out);
}

// AdaComp's selection |H| >= gmax (ordered: a NaN is not selected, as torch's comparison)
LGC_CLONES int select_tile_ge(const float* x, int len, float thr, int32_t base, int32_t* out) {
  return select_tile_impl<true, false>(x, len, thr, base, out);
}

// (int32 index, float32 value) of the entries not at or below the threshold: |x| > threshold or NaN (inclusive:
// |x| >= threshold or NaN), in ascending index order
std::vector<torch::Tensor> select_above(torch::Tensor x, double threshold, bool inclusive) {
  check_f32(x, "x");
  const int64_t n = x.numel();
  TORCH_CHECK(n < (int64_t(1) << 31), "select_above: more than 2^31 elements");
  const float* xp = x.data_ptr<float>();
  const float thr = (float)threshold;
  const int64_t tiles = (n + kTile - 1) / kTile;
  std::vector<std::vector<int32_t>> idx(tiles);
  at::parallel_for(0, tiles, grain(kTile), [&](int64_t tb, int64_t te) {
    // one tile-sized scratch per task, and per tile only what it selected: a full-tile vector per tile held
    // n * 4 bytes at once, fresh heap memory that glibc returned to the kernel after every call, so each call
    // page-faulted it in again (select of 16M elements: 25 ms, about 6x the time to read the input)
    std::vector<int32_t> scratch(kTile);
    for (int64_t t = tb; t < te; ++t) {
      int64_t b = t * kTile, e = std::min(n, b + kTile);
      int c = (inclusive ? select_tile_ge_nan : select_tile_gt_nan)(xp + b, (int)(e - b), thr, (int32_t)b, scratch.data());
      idx[t].assign(scratch.begin(), scratch.begin() + c);
    }
  });
  std::vector<int64_t> start(tiles + 1, 0);
  for (int64_t t = 0; t < tiles; ++t) start[t + 1] = start[t] + (int64_t)idx[t].size();
  auto oi = torch::empty({start[tiles]}, torch::kInt32);
  auto ov = torch::empty({start[tiles]}, torch::kFloat32);
  int32_t* oip = oi.data_ptr<int32_t>();
  float* ovp = ov.data_ptr<float>();
  at::parallel_for(0, tiles, grain(kTile), [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t) {
      const auto& v = idx[t];
      for (size_t r = 0; r < v.size(); ++r) {
        oip[start[t] + r] = v[r];
        ovp[start[t] + r] = xp[v[r]];
      }
    }
  });
  return {oi, ov};
}

LGC_CLONES float absmax(const float* x, int64_t len) {
  f8 m = {0};
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    m = nanmax8(m, abs8(load8(x + i)));
  }
  float M = 0;
  for (int l = 0; l < 8; ++l) M = nanmax(M, m[l]);
  for (; i < len; ++i) M = nanmax(M, std::fabs(x[i]));
  return M;
}

torch::Tensor bin_absmax(torch::Tensor x, int64_t bin) {
  check_f32(x, "x");
  const int64_t n = x.numel();
  const int64_t bins = (n + bin - 1) / bin;
  auto out = torch::empty({bins}, torch::kFloat32);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, bins, grain(bin), [&](int64_t bb, int64_t be) {
    for (int64_t b = bb; b < be; ++b) op[b] = absmax(xp + b * bin, std::min(n, (b + 1) * bin) - b * bin);
  });
  return out;
}

// AdaComp in one pass per bin: gmax = max|G| over the bin, select |H| >= gmax.
// Returns (binmax f32[bins], counts int32[bins], index int32[K] absolute, value f32[K] = G at index).
std::vector<torch::Tensor> adacomp_select(torch::Tensor G, torch::Tensor H, int64_t bin) {
  check_f32(G, "G");
  check_f32(H, "H");
  const int64_t n = G.numel();
  TORCH_CHECK(H.numel() == n, "G and H differ in size");
  TORCH_CHECK(n < (int64_t(1) << 31), "adacomp_select: more than 2^31 elements");
  const int64_t bins = (n + bin - 1) / bin;
  const int64_t per_group = std::max<int64_t>(1, kTile / bin);  // bins per work group
  const int64_t groups = (bins + per_group - 1) / per_group;
  auto gmax = torch::empty({bins}, torch::kFloat32);
  auto counts = torch::empty({bins}, torch::kInt32);
  const float* gp = G.data_ptr<float>();
  const float* hp = H.data_ptr<float>();
  float* mp = gmax.data_ptr<float>();
  int32_t* cp = counts.data_ptr<int32_t>();
  std::vector<std::vector<int32_t>> idx(groups);
  at::parallel_for(0, groups, grain(per_group * bin), [&](int64_t gb, int64_t ge) {
    std::vector<int32_t> scratch(per_group * bin);  // reused by the task's groups (see select_above)
    for (int64_t g = gb; g < ge; ++g) {
      int64_t kept = 0;
      for (int64_t b = g * per_group; b < std::min(bins, (g + 1) * per_group); ++b) {
        int64_t s = b * bin, e = std::min(n, s + bin);
        float thr = absmax(gp + s, e - s);
        mp[b] = thr;
        int c = select_tile_ge(hp + s, (int)(e - s), thr, (int32_t)s, scratch.data() + kept);
        kept += c;
        cp[b] = c;
      }
      idx[g].assign(scratch.begin(), scratch.begin() + kept);
    }
  });
  std::vector<int64_t> start(groups + 1, 0);
  for (int64_t g = 0; g < groups; ++g) start[g + 1] = start[g] + (int64_t)idx[g].size();
  auto oi = torch::empty({start[groups]}, torch::kInt32);
  auto ov = torch::empty({start[groups]}, torch::kFloat32);
  int32_t* oip = oi.data_ptr<int32_t>();
  float* ovp = ov.data_ptr<float>();
  for (int64_t g = 0; g < groups; ++g)
    for (size_t r = 0; r < idx[g].size(); ++r) {
      oip[start[g] + r] = idx[g][r];
      ovp[start[g] + r] = gp[idx[g][r]];
    }
  return {gmax, counts, oi, ov};
}

// dense float32[n] = sum over payloads, in the given (rank) order, of values scattered at indices.
// The order over payloads is fixed (and within a payload, repeated indices add in order), so every rank
// gets the same bits.
template <typename I>
void scatter_add(float* out, int64_t n, const I* ip, const float* vp, int64_t k, size_t r) {
  bool ascending = true;
  for (int64_t j = 0; j < k; ++j) {
    TORCH_CHECK(ip[j] >= 0 && (int64_t)ip[j] < n, "index ", (int64_t)ip[j], " out of range [0, ", n, ") in payload ", r);
    ascending &= j == 0 || ip[j] > ip[j - 1];
  }
  if (ascending) {  // distinct indices: threads never touch the same element
    at::parallel_for(0, k, 8 * kTile, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) out[ip[j]] += vp[j];
    });
  } else {  // repeated indices add up in payload order, as index_add_ does on CPU
    for (int64_t j = 0; j < k; ++j) out[ip[j]] += vp[j];
  }
}

torch::Tensor sparse_decode_sum(int64_t n, std::vector<torch::Tensor> indices, std::vector<torch::Tensor> values,
                                torch::Tensor out_) {
  TORCH_CHECK(indices.size() == values.size(), "indices and values differ in count");
  auto out = output(out_, n);
  out.zero_();
  float* op = out.data_ptr<float>();
  for (size_t r = 0; r < indices.size(); ++r) {
    auto idx = indices[r].contiguous();
    if (idx.scalar_type() != torch::kInt32) idx = idx.to(torch::kInt64);
    auto val = values[r].to(torch::kFloat32).contiguous();
    TORCH_CHECK(idx.numel() == val.numel(), "payload ", r, ": indices and values differ in length");
    if (idx.scalar_type() == torch::kInt32)
      scatter_add(op, n, idx.data_ptr<int32_t>(), val.data_ptr<float>(), idx.numel(), r);
    else
      scatter_add(op, n, idx.data_ptr<int64_t>(), val.data_ptr<float>(), idx.numel(), r);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// AdaComp's bin-relative words (lightning_gradcomp/sparse.py, encode_bin_relative / decode_bin_relative):
// sequential scans, one pass each, where the torch-ops form needs a dozen passes over int64 copies.

// words for ascending indices with value codes in {0, 1, 2}: uint8 words (bits 8) or native uint16 words as bytes
torch::Tensor bin_words_encode(torch::Tensor index, torch::Tensor codes, int64_t bin, int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 16, "bits must be 8 or 16");
  TORCH_CHECK(bin >= 1 && bin <= (int64_t(1) << (bits - 2)), "bin length out of range for ", bits, "-bit words");
  auto idx = index.to(torch::kInt64).contiguous();
  auto cod = codes.to(torch::kInt64).contiguous();
  const int64_t k = idx.numel();
  TORCH_CHECK(cod.numel() == k, "index and codes differ in length");
  const int64_t* ip = idx.data_ptr<int64_t>();
  const int64_t* cp = cod.data_ptr<int64_t>();
  const int fb = (int)bits - 2;
  const int64_t max_adv = (int64_t(1) << fb) - 1;
  int64_t total = 0, prev_bin = 0, prev_off = -1;
  for (int64_t j = 0; j < k; ++j) {  // pass 1: validate and count the words (entries plus bin-advance markers)
    TORCH_CHECK(ip[j] >= 0 && (j == 0 || ip[j] > ip[j - 1]), "indices must be ascending and non-negative");
    TORCH_CHECK(cp[j] >= 0 && cp[j] <= 2, "value codes must be 0, 1 or 2");
    const int64_t b = ip[j] / bin, off = ip[j] - b * bin, adv = b - prev_bin;
    if (adv > 0 && !(adv == 1 && off <= prev_off)) total += (adv + max_adv - 1) / max_adv;
    total += 1;
    prev_bin = b;
    prev_off = off;
  }
  auto out = torch::empty({total * (bits / 8)}, torch::kUInt8);
  uint8_t* op = out.data_ptr<uint8_t>();
  int64_t w = 0;
  auto put = [&](int64_t word) {
    if (bits == 8) {
      op[w++] = (uint8_t)word;
    } else {
      const uint16_t v = (uint16_t)word;
      std::memcpy(op + 2 * w++, &v, 2);
    }
  };
  prev_bin = 0;
  prev_off = -1;
  for (int64_t j = 0; j < k; ++j) {  // pass 2: the words
    const int64_t b = ip[j] / bin, off = ip[j] - b * bin, adv = b - prev_bin;
    if (adv > 0 && !(adv == 1 && off <= prev_off)) {
      const int64_t markers = (adv + max_adv - 1) / max_adv;
      for (int64_t m = 0; m + 1 < markers; ++m) put((int64_t(3) << fb) | max_adv);
      put((int64_t(3) << fb) | (adv - (markers - 1) * max_adv));
    }
    put((cp[j] << fb) | off);
    prev_bin = b;
    prev_off = off;
  }
  return out;
}

// dense float32[n] = sum over payloads, in the given (rank) order, of (code - 1) * scale at each decoded index;
// a payload is AdaComp's paper wire, [float32 scale][words], or empty (nothing sent)
torch::Tensor bin_words_decode_sum(int64_t n, std::vector<torch::Tensor> payloads, int64_t bin, int64_t bits,
                                   torch::Tensor out_) {
  TORCH_CHECK(bits == 8 || bits == 16, "bits must be 8 or 16");
  auto out = output(out_, n);
  out.zero_();
  float* op = out.data_ptr<float>();
  const int fb = (int)bits - 2;
  const uint32_t mask = (1u << fb) - 1;
  const int64_t wb = bits / 8;
  for (size_t r = 0; r < payloads.size(); ++r) {
    const auto& p = payloads[r];
    TORCH_CHECK(p.scalar_type() == torch::kUInt8 && p.is_contiguous() && p.device().is_cpu(),
                "payload ", r, " must be contiguous CPU uint8");
    const int64_t nb = p.numel();
    if (nb == 0) continue;
    TORCH_CHECK(nb >= 4 && (nb - 4) % wb == 0, "payload ", r, " is not a scale followed by ", bits, "-bit words");
    const uint8_t* bp = p.data_ptr<uint8_t>();
    float scale;
    std::memcpy(&scale, bp, 4);
    int64_t b = 0, prev_field = -1;
    bool prev_marker = true;
    for (int64_t w = 0; w < (nb - 4) / wb; ++w) {
      uint32_t word;
      if (bits == 8) {
        word = bp[4 + w];
      } else {
        uint16_t v;
        std::memcpy(&v, bp + 4 + 2 * w, 2);
        word = v;
      }
      const uint32_t code = word >> fb, field = word & mask;
      if (code == 3) {  // a marker advances by its field
        b += field;
      } else {
        if (!prev_marker && (int64_t)field <= prev_field) b += 1;  // an offset that does not increase: next bin
        const int64_t i = b * bin + field;
        TORCH_CHECK(i < n, "index ", i, " out of range [0, ", n, ") in payload ", r);
        op[i] += (float)((int32_t)code - 1) * scale;
      }
      prev_marker = code == 3;
      prev_field = field;
    }
  }
  return out;
}

}  // namespace

"""

FUNCTIONS = [
    "terngrad_stats",
    "terngrad_scale_clip",
    "terngrad_ternarize_pack",
    "terngrad_ternarize_int8",
    "terngrad_decode",
    "terngrad_decode_sum",
    "sample_abs",
    "kth_smallest",
    "select_above",
    "bin_absmax",
    "adacomp_select",
    "sparse_decode_sum",
    "bin_words_encode",
    "bin_words_decode_sum",
]
