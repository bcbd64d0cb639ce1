// Selection for Gradient Dropping, AdaComp, top-k and DGC: sampling, thresholds, bin maxima, sparse decode-sum.
#include "common.h"

namespace {

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

// the entries of x[0..n) not at or below thr (inclusive: not below), as indices base + i, per tile of kTile entries
// (ascending within and across tiles)
std::vector<std::vector<int32_t>> select_tiles(const float* xp, int64_t n, float thr, bool inclusive, int32_t base) {
  const int64_t tiles = (n + kTile - 1) / kTile;
  std::vector<std::vector<int32_t>> idx(tiles);
  at::parallel_for(0, tiles, grain(kTile), [&](int64_t tb, int64_t te) {
    // one tile-sized scratch per task, and per tile only what it selected: a full-tile vector per tile held
    // n * 4 bytes at once, fresh heap memory that glibc returned to the kernel after every call, so each call
    // page-faulted it in again (select of 16M elements: 25 ms, about 6x the time to read the input)
    std::vector<int32_t> scratch(kTile);
    for (int64_t t = tb; t < te; ++t) {
      int64_t b = t * kTile, e = std::min(n, b + kTile);
      int c = (inclusive ? select_tile_ge_nan : select_tile_gt_nan)(xp + b, (int)(e - b), thr,
                                                                  (int32_t)(base + b), scratch.data());
      idx[t].assign(scratch.begin(), scratch.begin() + c);
    }
  });
  return idx;
}

// (int32 index, float32 value) of the entries not at or below the threshold: |x| > threshold or NaN (inclusive:
// |x| >= threshold or NaN), in ascending index order
std::vector<torch::Tensor> select_above(torch::Tensor x, double threshold, bool inclusive) {
  check_f32(x, "x");
  const int64_t n = x.numel();
  TORCH_CHECK(n < (int64_t(1) << 31), "select_above: more than 2^31 elements");
  const float* xp = x.data_ptr<float>();
  const auto idx = select_tiles(xp, n, (float)threshold, inclusive, 0);
  const int64_t tiles = (int64_t)idx.size();
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

// ---------------------------------------------------------------------------------------------------------
// Gradient Dropping over a group of layers back to back, in one call per step of the selection and without a
// dispatched op per layer (raw loops, outputs allocated once): the samples, their order statistics, the survivors.

// the entries of x[0..n) not at or below thr (inclusive: not below), as indices base + i, appended to out ascending
void select_layer(const float* xp, int64_t n, float thr, bool inclusive, int32_t base, std::vector<int32_t>& out) {
  for (const auto& v : select_tiles(xp, n, thr, inclusive, base)) out.insert(out.end(), v.begin(), v.end());
}

// every layer's threshold sample of |x|, back to back: mode 2 the whole layer, 0 sizes[s] values at Marian's stride,
// 1 sizes[s] hashed random positions keyed by keys[s] (sample_abs's positions)
torch::Tensor graddrop_group_sample(torch::Tensor x, torch::Tensor offsets, torch::Tensor sizes, torch::Tensor modes,
                                    torch::Tensor keys) {
  check_f32(x, "x");
  const int64_t layers = offsets.numel() - 1;
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* sz = sizes.data_ptr<int64_t>();
  const int64_t* md = modes.data_ptr<int64_t>();
  const int64_t* ky = keys.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t s = 0; s < layers; ++s) total += sz[s];
  auto out = torch::empty({total}, torch::kFloat32);
  float* op = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  for (int64_t s = 0, at = 0; s < layers; at += sz[s], ++s) {
    const float* lp = xp + off[s];
    const int64_t n = off[s + 1] - off[s], m = sz[s];
    TORCH_CHECK(md[s] != 2 || m == n, "layer ", s, ": a whole-layer sample of another size");
    const int64_t stride = std::max<int64_t>(1, n / std::max<int64_t>(1, m));
    for (int64_t i = 0; i < m; ++i) {
      const int64_t j = md[s] == 2 ? i
                        : md[s] == 0 ? i * stride
                                     : (int64_t)(hash_index((uint32_t)i, (uint32_t)ky[2 * s], (uint32_t)ky[2 * s + 1]) % (uint64_t)n);
      op[at + i] = std::fabs(lp[j]);
    }
  }
  return out;
}

// each layer's ks[s]-th smallest (1-based) sampled value, ranked as kth_smallest ranks (NaN last); 0 where ks[s] == 0.
// The samples lie back to back, layer s's from sample_offsets[s] to sample_offsets[s + 1].
torch::Tensor graddrop_group_kth(torch::Tensor samples, torch::Tensor sample_offsets, torch::Tensor ks) {
  check_f32(samples, "samples");
  const int64_t layers = sample_offsets.numel() - 1;
  const int64_t* off = sample_offsets.data_ptr<int64_t>();
  const int64_t* kp = ks.data_ptr<int64_t>();
  const float* sp = samples.data_ptr<float>();
  auto out = torch::empty({layers}, torch::kFloat32);
  float* op = out.data_ptr<float>();
  std::vector<float> v;
  for (int64_t s = 0; s < layers; ++s) {
    TORCH_CHECK(kp[s] >= 0 && kp[s] <= off[s + 1] - off[s], "layer ", s, ": rank beyond its sample");
    if (kp[s] == 0) {
      op[s] = 0.0f;
      continue;
    }
    v.assign(sp + off[s], sp + off[s + 1]);
    std::nth_element(v.begin(), v.begin() + (kp[s] - 1), v.end(), [](float a, float b) { return a < b || (a == a && b != b); });
    op[s] = v[kp[s] - 1];
  }
  return out;
}

// Gradient Dropping's survivors for every layer of a group back to back in x (layer s: offsets[s] .. offsets[s + 1])
// under its threshold thresholds[s], in one call and without a dispatched op per layer: select_above's rule, the ties
// |x| >= thr when nothing is above a positive threshold; with fp16, survivors beyond fp16's range stay behind, counted.
// Returns (index int32[K] from the group's start, value f32[K], count int64[n], overflow f32[n]).
std::vector<torch::Tensor> graddrop_group_select(torch::Tensor x, torch::Tensor offsets, torch::Tensor thresholds,
                                                 bool fp16) {
  check_f32(x, "x");
  check_f32(thresholds, "thresholds");
  TORCH_CHECK(x.numel() < (int64_t(1) << 31), "graddrop_group_select: more than 2^31 elements");
  const int64_t layers = offsets.numel() - 1;
  const int64_t* off = offsets.data_ptr<int64_t>();
  const float* tp = thresholds.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  auto counts = torch::empty({layers}, torch::kInt64);
  auto overflow = torch::empty({layers}, torch::kFloat32);
  int64_t* cp = counts.data_ptr<int64_t>();
  float* fp = overflow.data_ptr<float>();
  std::vector<int32_t> all;
  for (int64_t s = 0; s < layers; ++s) {
    const float* lp = xp + off[s];
    const int64_t n = off[s + 1] - off[s];
    const float thr = tp[s];
    const size_t begin = all.size();
    select_layer(lp, n, thr, false, (int32_t)off[s], all);
    if (all.size() == begin && thr > 0) select_layer(lp, n, thr, true, (int32_t)off[s], all);
    int64_t dropped = 0;
    if (fp16) {  // not beyond fp16's largest finite value (a NaN fits: it is sent)
      size_t w = begin;
      for (size_t r = begin; r < all.size(); ++r) {
        if (std::fabs(xp[all[r]]) > 65504.0f) ++dropped; else all[w++] = all[r];
      }
      all.resize(w);
    }
    cp[s] = (int64_t)(all.size() - begin);
    fp[s] = (float)dropped;
  }
  auto index = torch::empty({(int64_t)all.size()}, torch::kInt32);
  auto value = torch::empty({(int64_t)all.size()}, torch::kFloat32);
  int32_t* ip = index.data_ptr<int32_t>();
  float* vp = value.data_ptr<float>();
  for (size_t r = 0; r < all.size(); ++r) {
    ip[r] = all[r];
    vp[r] = xp[all[r]];
  }
  return {index, value, counts, overflow};
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
// Counter-based uniforms of a group of layers (QSGD's and Int8's stochastic rounding)

// element j of layer s (elements offsets[s] to offsets[s + 1]) draws hash_index(j, keys[2s], keys[2s + 1]); its top
// 24 bits scaled by 2^-24 are the uniform in [0, 1), exactly rng.py's to_uniform (both steps are exact in float32)
torch::Tensor counter_uniform_flat(torch::Tensor offsets, torch::Tensor keys) {
  TORCH_CHECK(offsets.scalar_type() == torch::kInt64 && keys.scalar_type() == torch::kInt64, "int64 tables");
  const int64_t layers = offsets.numel() - 1;
  TORCH_CHECK(layers >= 0 && keys.numel() == 2 * layers, "a key pair per layer");
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* ky = keys.data_ptr<int64_t>();
  auto out = torch::empty({layers > 0 ? off[layers] : 0}, torch::kFloat32);
  float* op = out.data_ptr<float>();
  for (int64_t s = 0; s < layers; ++s) {
    const uint32_t k0 = (uint32_t)ky[2 * s], k1 = (uint32_t)ky[2 * s + 1];
    float* lp = op + off[s];
    const int64_t n = off[s + 1] - off[s];
    for (int64_t j = 0; j < n; ++j) lp[j] = (float)(hash_index((uint32_t)j, k0, k1) >> 8) * 5.9604644775390625e-08f;
  }
  return out;
}

}  // namespace
