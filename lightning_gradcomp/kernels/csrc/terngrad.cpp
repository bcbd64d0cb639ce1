// TernGrad: statistics, scaler and clip, ternarize (packed and int8), decode and decode-sum.
#include "common.h"

namespace {

// ---------------------------------------------------------------------------------------------------------
// TernGrad statistics: per tile sum, sum of squares (double lanes) and max|g| (float lanes)

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

}  // namespace
