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

// Chunks [begin[c], begin[c] + len[c]) of one flat array, each cut into tiles of kTile from its own start; the
// work items are (chunk, tile) pairs and a chunk's tiles are summed in tile order, so a chunk's statistics do not
// depend on the other chunks of the call (a layer's alone, or a whole group's) nor on the thread count.
struct Chunks {
  std::vector<int64_t> begin, len, first;  // first[c]: chunk c's first work item; first[chunks]: their count
  void add(int64_t b, int64_t n) {
    if (first.empty()) first.push_back(0);
    begin.push_back(b);
    len.push_back(n);
    first.push_back(first.back() + std::max<int64_t>(1, (n + kTile - 1) / kTile));
  }
  // the chunks of a tensor of n elements at `offset`: `bucket` elements each (the last may be shorter), bucket <= 0
  // one chunk; an empty tensor has none
  void add_tensor(int64_t offset, int64_t n, int64_t bucket) {
    const int64_t b = bucket > 0 ? bucket : n;
    for (int64_t c = 0; c < n; c += b) add(offset + c, std::min(b, n - c));
  }
  int64_t size() const { return (int64_t)begin.size(); }
  int64_t items() const { return first.empty() ? 0 : first.back(); }
  // [b, e) of item w, and its chunk
  int64_t range(int64_t w, int64_t* b, int64_t* e) const {
    int64_t c = std::upper_bound(first.begin(), first.end(), w) - first.begin() - 1;
    *b = begin[c] + (w - first[c]) * kTile;
    *e = std::min(begin[c] + len[c], *b + kTile);
    return c;
  }
};

// returns [chunks, 2] float32: sigma (population), max|g| of each chunk
torch::Tensor chunk_stats(const float* x, const Chunks& chunks, int64_t grain_elems) {
  std::vector<double> part(chunks.items() * 3, 0.0);
  at::parallel_for(0, chunks.items(), grain(grain_elems), [&](int64_t wb, int64_t we) {
    for (int64_t w = wb; w < we; ++w) {
      int64_t b, e;
      chunks.range(w, &b, &e);
      if (e > b) stats_tile(x + b, e - b, &part[w * 3]);
    }
  });
  auto out = torch::empty({chunks.size(), 2}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  for (int64_t c = 0; c < chunks.size(); ++c) {  // fixed order: independent of the thread count
    double S = 0, Q = 0, M = 0;
    for (int64_t w = chunks.first[c]; w < chunks.first[c + 1]; ++w) {
      const double* p = &part[w * 3];
      S += p[0];
      Q += p[1];
      M = (M > p[2] || M != M) ? M : p[2];  // NaN-propagating, as nanmax
    }
    double cnt = (double)chunks.len[c];
    double mean = S / cnt;
    double var = Q / cnt - mean * mean;
    var = var < 0.0 ? 0.0 : var;  // rounding below 0 clamped, NaN kept (std::max(0.0, NaN) is 0), as clamp_min
    o[2 * c] = (float)std::sqrt(var);
    o[2 * c + 1] = (float)M;
  }
  return out;
}

// returns [chunks, 2] float32: sigma (population), max|g|
torch::Tensor terngrad_stats(torch::Tensor g, int64_t bucket) {
  check_f32(g, "g");
  const int64_t n = g.numel();
  TORCH_CHECK(n > 0 && bucket > 0, "empty tensor or bucket");
  Chunks chunks;
  chunks.add_tensor(0, n, bucket);
  return chunk_stats(g.data_ptr<float>(), chunks, std::min(bucket, kTile));
}

// A group of tensors back to back in one flat array: offsets [tensors + 1] (int64, CPU).
struct Group {
  std::vector<int64_t> offset;
  explicit Group(const torch::Tensor& offsets) {
    TORCH_CHECK(offsets.scalar_type() == torch::kInt64 && offsets.dim() == 1 && offsets.numel() >= 1 &&
                    offsets.is_contiguous() && offsets.device().is_cpu(),
                "offsets must be a contiguous int64 CPU vector of tensors + 1 entries");
    const int64_t* p = offsets.data_ptr<int64_t>();
    offset.assign(p, p + offsets.numel());
    for (size_t l = 1; l < offset.size(); ++l) TORCH_CHECK(offset[l] >= offset[l - 1], "offsets must not decrease");
  }
  int64_t size() const { return (int64_t)offset.size() - 1; }
  int64_t numel(int64_t l) const { return offset[l + 1] - offset[l]; }
  int64_t total() const { return offset.back(); }
  // the group's chunks (TernGrad's scalers), tensor after tensor; first_chunk[l]: tensor l's first
  Chunks chunks(int64_t bucket, std::vector<int64_t>* first_chunk) const {
    Chunks c;
    for (int64_t l = 0; l < size(); ++l) {
      if (first_chunk) first_chunk->push_back(c.size());
      c.add_tensor(offset[l], numel(l), bucket);
    }
    if (first_chunk) first_chunk->push_back(c.size());
    return c;
  }
};

// Work items over a group: (tensor, tile) pairs, tensor l split into tiles of `per_tile` of its `units[l]` units
// (elements or packed bytes); an empty tensor has none.
struct GroupTiles {
  std::vector<int64_t> first;  // first[l]: tensor l's first item; first[tensors]: their count
  GroupTiles(const std::vector<int64_t>& units, int64_t per_tile) {
    first.push_back(0);
    for (int64_t u : units) first.push_back(first.back() + (u + per_tile - 1) / per_tile);
  }
  int64_t count() const { return first.back(); }
  // the tensor and its tile index of item w
  void locate(int64_t w, int64_t* l, int64_t* t) const {
    *l = std::upper_bound(first.begin(), first.end(), w) - first.begin() - 1;
    *t = w - first[*l];
  }
};

// The scaler and clip threshold per chunk from the statistics, in one call: terngrad_scaler (kernels/terngrad.py)
// is four torch ops on tensors of one element per chunk, whose dispatch cost more than the statistics pass of a
// small tensor. Float32 arithmetic with the constants rounded to float first, and NaN propagated as
// torch.minimum does, so the result equals the torch ops' bit for bit. clip_mode: 0 none (scaler max|g|),
// 1 "paper" (clip at the threshold, scaler min(max|g|, threshold)), 2 "code" (scaler = threshold, no clip).
std::vector<torch::Tensor> scale_clip_of(const torch::Tensor& stats, double clip_factor, int64_t clip_mode,
                                         double sigma_noise) {
  TORCH_CHECK(clip_mode >= 0 && clip_mode <= 2, "clip_mode must be 0, 1 or 2");
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

std::vector<torch::Tensor> terngrad_scale_clip(torch::Tensor g, int64_t bucket, double clip_factor, int64_t clip_mode,
                                               double sigma_noise) {
  TORCH_CHECK(clip_mode >= 0 && clip_mode <= 2, "clip_mode must be 0, 1 or 2");
  return scale_clip_of(terngrad_stats(g, bucket), clip_factor, clip_mode, sigma_noise);
}

// terngrad_scale_clip of every tensor of a group (flat g, offsets [tensors + 1]) in one call: the scalers and
// clip thresholds of all chunks, tensor after tensor, each equal to the tensor's own call bit for bit. bucket <= 0:
// one chunk per tensor; an empty tensor has none.
std::vector<torch::Tensor> terngrad_scale_clip_flat(torch::Tensor g, torch::Tensor offsets, int64_t bucket,
                                                    double clip_factor, int64_t clip_mode, double sigma_noise) {
  check_f32(g, "g");
  TORCH_CHECK(clip_mode >= 0 && clip_mode <= 2, "clip_mode must be 0, 1 or 2");
  Group group(offsets);
  TORCH_CHECK(group.total() == g.numel(), "offsets end at ", group.total(), " but g has ", g.numel(), " elements");
  Chunks chunks = group.chunks(bucket, nullptr);
  const int64_t per_item = std::max<int64_t>(1, g.numel() / std::max<int64_t>(1, chunks.items()));
  return scale_clip_of(chunk_stats(g.data_ptr<float>(), chunks, per_item), clip_factor, clip_mode, sigma_noise);
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

LGC_CLONES int64_t codes_to_values(const uint8_t* __restrict codes, int len, int8_t* __restrict out) {
  int32_t cnt = 0;
  for (int i = 0; i < len; ++i) {
    out[i] = (int8_t)(codes[i] - 1);
    cnt += codes[i] != 1;
  }
  return cnt;
}

// One tensor's ternarization, tile by tile: the same draws and bytes whether the tensor comes alone or in a group.
struct Ternarize {
  const float* x;  // the tensor's first element
  int64_t n, bucket;
  const float* sp;  // its chunks' scalers
  const float* cp;  // its chunks' clip thresholds, or null
  uint32_t k0, k1;
  // bytes [kb, ke) of the 2-bit quarter-split payload of m bytes into op (buf: 4 * T codes); returns the zero codes
  // among them (padding included)
  int64_t pack_tile(int64_t m, int64_t kb, int64_t ke, uint8_t* buf, uint8_t* op) const {
    const int64_t T = kTile / 4;
    for (int j = 0; j < 4; ++j) codes_range(x, n, j * m + kb, j * m + ke, bucket, sp, cp, k0, k1, &buf[j * T]);
    return pack4(&buf[0], &buf[T], &buf[2 * T], &buf[3 * T], ke - kb, op + kb);
  }
  // elements [b, e) as int8 values into op (codes: kTile scratch); returns the nonzero values among them
  int64_t int8_tile(int64_t b, int64_t e, uint8_t* codes, int8_t* op) const {
    codes_range(x, n, b, e, bucket, sp, cp, k0, k1, codes);
    return codes_to_values(codes, (int)(e - b), op + b);
  }
};

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
  const Ternarize t{g.data_ptr<float>(), n, bucket, scale.data_ptr<float>(), has_clip ? clip.data_ptr<float>() : nullptr,
                    (uint32_t)k0, (uint32_t)k1};
  uint8_t* op = out.data_ptr<uint8_t>();
  const int64_t T = kTile / 4;  // output bytes per tile
  const int64_t tiles = (m + T - 1) / T;
  std::vector<int64_t> ones(tiles, 0);
  at::parallel_for(0, tiles, grain(kTile), [&](int64_t tb, int64_t te) {
    std::vector<uint8_t> buf(4 * T);
    for (int64_t i = tb; i < te; ++i) ones[i] = t.pack_tile(m, i * T, std::min(m, i * T + T), buf.data(), op);
  });
  int64_t total_ones = 0;
  for (int64_t v : ones) total_ones += v;
  int64_t nonzero = 4 * m - total_ones;  // padding codes are 1 (zero) and counted in ones
  return {out, torch::tensor({nonzero}, torch::kInt64)};
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
  const Ternarize t{g.data_ptr<float>(), n, bucket, scale.data_ptr<float>(), has_clip ? clip.data_ptr<float>() : nullptr,
                    (uint32_t)k0, (uint32_t)k1};
  int8_t* op = out.data_ptr<int8_t>();
  const int64_t tiles = (n + kTile - 1) / kTile;
  std::vector<int64_t> nz(tiles, 0);
  at::parallel_for(0, tiles, grain(kTile), [&](int64_t tb, int64_t te) {
    std::vector<uint8_t> codes(kTile);
    for (int64_t i = tb; i < te; ++i) nz[i] = t.int8_tile(i * kTile, std::min(n, i * kTile + kTile), codes.data(), op);
  });
  int64_t total = 0;
  for (int64_t v : nz) total += v;
  return {out, torch::tensor({total}, torch::kInt64)};
}

// Both forms for a whole group (flat g, offsets [tensors + 1]) in one call, every tensor exactly as its own call
// would make it: scale and clip hold all chunks tensor after tensor (terngrad_scale_clip_flat), keys [tensors, 2]
// each tensor's stream key (an element's index in its stream is its index within its tensor). packed: the 2-bit
// payloads back to back (ceil(n/4) bytes each), else the int8 values [total]. Returns (payload, int64 nonzero
// count per tensor).
std::vector<torch::Tensor> terngrad_ternarize_flat(torch::Tensor g, torch::Tensor offsets, int64_t bucket,
                                                   torch::Tensor scale, torch::Tensor clip, torch::Tensor keys,
                                                   bool packed) {
  check_f32(g, "g");
  check_f32(scale, "scale");
  Group group(offsets);
  const int64_t L = group.size();
  TORCH_CHECK(group.total() == g.numel(), "offsets end at ", group.total(), " but g has ", g.numel(), " elements");
  TORCH_CHECK(keys.scalar_type() == torch::kInt64 && keys.is_contiguous() && keys.numel() == 2 * L,
              "keys must be contiguous int64 [tensors, 2]");
  std::vector<int64_t> first_chunk;
  const Chunks chunks = group.chunks(bucket, &first_chunk);
  TORCH_CHECK(scale.numel() == chunks.size(), "scale has ", scale.numel(), " entries, expected ", chunks.size());
  const bool has_clip = clip.numel() > 0;
  if (has_clip) {
    check_f32(clip, "clip");
    TORCH_CHECK(clip.numel() == chunks.size(), "clip has ", clip.numel(), " entries, expected ", chunks.size());
  }
  const float* x = g.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float* cp = has_clip ? clip.data_ptr<float>() : nullptr;
  const int64_t* kp = keys.data_ptr<int64_t>();
  auto tensor = [&](int64_t l) {
    const int64_t n = group.numel(l);
    return Ternarize{x + group.offset[l], n, bucket > 0 ? bucket : std::max<int64_t>(n, 1), sp + first_chunk[l],
                     cp ? cp + first_chunk[l] : nullptr, (uint32_t)kp[2 * l], (uint32_t)kp[2 * l + 1]};
  };
  std::vector<int64_t> units(L), out_start(L + 1, 0);
  for (int64_t l = 0; l < L; ++l) {
    units[l] = packed ? (group.numel(l) + 3) / 4 : group.numel(l);
    out_start[l + 1] = out_start[l] + units[l];
  }
  const int64_t per_tile = packed ? kTile / 4 : kTile;
  const GroupTiles tiles(units, per_tile);
  std::vector<int64_t> counted(tiles.count(), 0);
  auto out = torch::empty({out_start[L]}, packed ? torch::kUInt8 : torch::kInt8);
  const int64_t per_item = std::max<int64_t>(1, g.numel() / std::max<int64_t>(1, tiles.count()));
  at::parallel_for(0, tiles.count(), grain(per_item), [&](int64_t wb, int64_t we) {
    std::vector<uint8_t> buf(kTile);
    for (int64_t w = wb; w < we; ++w) {
      int64_t l, i;
      tiles.locate(w, &l, &i);
      const Ternarize t = tensor(l);
      const int64_t b = i * per_tile, e = std::min(units[l], b + per_tile);
      if (packed)
        counted[w] = t.pack_tile(units[l], b, e, buf.data(), out.data_ptr<uint8_t>() + out_start[l]);
      else
        counted[w] = t.int8_tile(b, e, buf.data(), out.data_ptr<int8_t>() + out_start[l]);
    }
  });
  auto nonzero = torch::zeros({L}, torch::kInt64);
  int64_t* nz = nonzero.data_ptr<int64_t>();
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t w = tiles.first[l]; w < tiles.first[l + 1]; ++w) nz[l] += counted[w];
    if (packed) nz[l] = 4 * units[l] - nz[l];  // pack_tile counts zero codes, padding included
  }
  return {out, nonzero};
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

// One tensor's decode-and-sum, tile by tile: payloads (count of them, m bytes each) sharing the scalers sp.
struct DecodeSum {
  const uint8_t* const* ptrs;  // each payload's first byte for this tensor
  int32_t count;
  int64_t n, m, bucket;
  const float* sp;
  float d;
  bool pow2;
  // bytes [kb, ke) of every payload: summed, scaled, divided, into op (the tensor's first element); fields and acc
  // are the caller's scratch of 4 * T bytes and int32s
  void tile(int64_t kb, int64_t ke, uint8_t* fields, int32_t* acc, float* op) const {
    const int64_t T = kTile / 4, len = ke - kb;
    const int32_t offset = count;  // each code is t + 1
    if (count <= kByteMaxPayloads) {  // exact sums in bytes up to 127 payloads, in int32 beyond
      byte_sums(ptrs, count, kb, len, fields);
      for_segments(n, m, bucket, kb, ke, [&](int j, int64_t k, int64_t len2, int64_t i, int64_t c) {
        (pow2 ? scale_bytes_mul : scale_bytes_div)(&fields[j * len + (k - kb)], len2, offset, sp[c], d, op + i);
      });
      return;
    }
    std::fill(acc, acc + 4 * T, 0);
    for (int32_t w = 0; w < count; ++w) accumulate_codes(ptrs[w] + kb, len, &acc[0], &acc[T], &acc[2 * T], &acc[3 * T]);
    for_segments(n, m, bucket, kb, ke, [&](int j, int64_t k, int64_t len2, int64_t i, int64_t c) {
      (pow2 ? scale_counts_mul : scale_counts_div)(&acc[j * T + (k - kb)], len2, offset, sp[c], d, op + i);
    });
  }
};

// a power-of-two divisor is a multiplication by its exact reciprocal (the same correctly rounded result)
inline float divisor_factor(int64_t divisor) {
  return (divisor & (divisor - 1)) == 0 ? 1.0f / (float)divisor : (float)divisor;
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
  auto out = output(out_, n);
  const DecodeSum dec{ptrs.data(), (int32_t)ptrs.size(), n, m, bucket, scale.data_ptr<float>(), divisor_factor(divisor),
                      (divisor & (divisor - 1)) == 0};
  float* op = out.data_ptr<float>();
  const int64_t T = kTile / 4;
  const int64_t tiles = (m + T - 1) / T;
  at::parallel_for(0, tiles, grain(kTile), [&](int64_t tb, int64_t te) {
    std::vector<int32_t> acc(4 * T);
    std::vector<uint8_t> fields(4 * T);
    for (int64_t t = tb; t < te; ++t) dec.tile(t * T, std::min(m, t * T + T), fields.data(), acc.data(), op);
  });
  return out;
}

LGC_CLONES void scale_int8(const int8_t* __restrict v, int64_t len, float s, float* __restrict out) {
  for (int64_t k = 0; k < len; ++k) out[k] = (float)v[k] * s;
}

// int8 values of a group (ternaries, or their sums over ranks: the all-reduce form) times their chunk's scaler, in
// one pass: float32 [total], equal to values.float() * scale per tensor bit for bit. out: [total] or empty (new).
torch::Tensor terngrad_scale_int8_flat(torch::Tensor values, torch::Tensor offsets, int64_t bucket, torch::Tensor scale,
                                       torch::Tensor out_) {
  check_f32(scale, "scale");
  TORCH_CHECK(values.scalar_type() == torch::kInt8 && values.is_contiguous() && values.device().is_cpu(),
              "values must be a contiguous int8 CPU tensor");
  Group group(offsets);
  TORCH_CHECK(group.total() == values.numel(), "offsets end at ", group.total(), " but values has ", values.numel());
  const Chunks chunks = group.chunks(bucket, nullptr);
  TORCH_CHECK(scale.numel() == chunks.size(), "scale has ", scale.numel(), " entries, expected ", chunks.size());
  auto out = output(out_, group.total());
  const int8_t* v = values.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t per_item = std::max<int64_t>(1, group.total() / std::max<int64_t>(1, chunks.items()));
  at::parallel_for(0, chunks.items(), grain(per_item), [&](int64_t wb, int64_t we) {
    for (int64_t w = wb; w < we; ++w) {
      int64_t b, e;
      const int64_t c = chunks.range(w, &b, &e);
      scale_int8(v + b, e - b, sp[c], op + b);
    }
  });
  return out;
}

// terngrad_decode_sum of every tensor of a group (offsets [tensors + 1] of the decoded flat tensor) in one call:
// tensor l's 2-bit bytes start at byte starts[l] of every payload (other bytes, e.g. scalers, may sit between),
// scale holds all chunks tensor after tensor; out [total] float32 (or empty: a new one).
torch::Tensor terngrad_decode_sum_flat(std::vector<torch::Tensor> payloads, torch::Tensor offsets, torch::Tensor starts,
                                       int64_t bucket, torch::Tensor scale, torch::Tensor out_, int64_t divisor) {
  check_f32(scale, "scale");
  TORCH_CHECK(divisor >= 1, "divisor must be >= 1, got ", divisor);
  TORCH_CHECK(!payloads.empty(), "no payloads");
  Group group(offsets);
  const int64_t L = group.size();
  TORCH_CHECK(starts.scalar_type() == torch::kInt64 && starts.is_contiguous() && starts.numel() == L,
              "starts must be contiguous int64 [tensors]");
  const int64_t* st = starts.data_ptr<int64_t>();
  std::vector<int64_t> first_chunk;
  const int64_t chunks = group.chunks(bucket, &first_chunk).size();
  TORCH_CHECK(scale.numel() == chunks, "scale has ", scale.numel(), " entries, expected ", chunks);
  std::vector<int64_t> units(L);
  for (int64_t l = 0; l < L; ++l) units[l] = (group.numel(l) + 3) / 4;
  const int64_t R = (int64_t)payloads.size();
  std::vector<const uint8_t*> base;
  for (auto& t : payloads) {
    TORCH_CHECK(t.scalar_type() == torch::kUInt8 && t.is_contiguous() && t.dim() == 1, "payloads must be contiguous uint8");
    for (int64_t l = 0; l < L; ++l)
      TORCH_CHECK(st[l] >= 0 && st[l] + units[l] <= t.numel(), "payload of ", t.numel(), " bytes too short");
    base.push_back(t.data_ptr<uint8_t>());
  }
  auto out = output(out_, group.total());
  float* op = out.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const int64_t T = kTile / 4;
  const GroupTiles tiles(units, T);
  const int64_t per_item = std::max<int64_t>(1, group.total() / std::max<int64_t>(1, tiles.count()));
  at::parallel_for(0, tiles.count(), grain(per_item), [&](int64_t wb, int64_t we) {
    std::vector<int32_t> acc(4 * T);
    std::vector<uint8_t> fields(4 * T);
    std::vector<const uint8_t*> ptrs(R);
    for (int64_t w = wb; w < we; ++w) {
      int64_t l, i;
      tiles.locate(w, &l, &i);
      for (int64_t r = 0; r < R; ++r) ptrs[r] = base[r] + st[l];
      const int64_t n = group.numel(l);
      const DecodeSum dec{ptrs.data(), (int32_t)R, n, units[l], bucket > 0 ? bucket : n, sp + first_chunk[l],
                          divisor_factor(divisor), (divisor & (divisor - 1)) == 0};
      dec.tile(i * T, std::min(units[l], i * T + T), fields.data(), acc.data(), op + group.offset[l]);
    }
  });
  return out;
}

}  // namespace
