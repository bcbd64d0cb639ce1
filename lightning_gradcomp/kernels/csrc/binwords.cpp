// AdaComp's bin-relative words: encode and decode-sum.
#include "common.h"

namespace {

// ---------------------------------------------------------------------------------------------------------
// AdaComp's bin-relative words (lightning_gradcomp/sparse.py, encode_bin_relative / decode_bin_relative):
// sequential scans, one pass each, where the torch-ops form needs a dozen passes over int64 copies.

// the words of ascending indices ip[0..k) with value codes cp (in {0, 1, 2}), appended to out: uint8 words (bits 8)
// or native uint16 words as bytes
void append_words(const int64_t* ip, const int64_t* cp, int64_t k, int64_t bin, int64_t bits, std::vector<uint8_t>& out) {
  const int fb = (int)bits - 2;
  const int64_t max_adv = (int64_t(1) << fb) - 1;
  auto put = [&](int64_t word) {
    if (bits == 8) {
      out.push_back((uint8_t)word);
    } else {
      const uint16_t v = (uint16_t)word;
      uint8_t b[2];
      std::memcpy(b, &v, 2);
      out.insert(out.end(), b, b + 2);
    }
  };
  int64_t prev_bin = 0, prev_off = -1;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t b = ip[j] / bin, off = ip[j] - b * bin, adv = b - prev_bin;
    if (adv > 0 && !(adv == 1 && off <= prev_off)) {  // the decoder cannot infer the bin: markers
      const int64_t markers = (adv + max_adv - 1) / max_adv;
      for (int64_t m = 0; m + 1 < markers; ++m) put((int64_t(3) << fb) | max_adv);
      put((int64_t(3) << fb) | (adv - (markers - 1) * max_adv));
    }
    put((cp[j] << fb) | off);
    prev_bin = b;
    prev_off = off;
  }
}

torch::Tensor bin_words_encode(torch::Tensor index, torch::Tensor codes, int64_t bin, int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 16, "bits must be 8 or 16");
  TORCH_CHECK(bin >= 1 && bin <= (int64_t(1) << (bits - 2)), "bin length out of range for ", bits, "-bit words");
  auto idx = index.to(torch::kInt64).contiguous();
  auto cod = codes.to(torch::kInt64).contiguous();
  const int64_t k = idx.numel();
  TORCH_CHECK(cod.numel() == k, "index and codes differ in length");
  const int64_t* ip = idx.data_ptr<int64_t>();
  const int64_t* cp = cod.data_ptr<int64_t>();
  for (int64_t j = 0; j < k; ++j) {
    TORCH_CHECK(ip[j] >= 0 && (j == 0 || ip[j] > ip[j - 1]), "indices must be ascending and non-negative");
    TORCH_CHECK(cp[j] >= 0 && cp[j] <= 2, "value codes must be 0, 1 or 2");
  }
  std::vector<uint8_t> words;
  append_words(ip, cp, k, bin, bits, words);
  auto out = torch::empty({(int64_t)words.size()}, torch::kUInt8);
  std::memcpy(out.data_ptr<uint8_t>(), words.data(), words.size());
  return out;
}

// adds (code - 1) * scale at each decoded index of one payload (AdaComp's paper wire, [float32 scale][words],
// nb bytes; nothing when nb == 0) to op[0..n)
void add_words(float* op, int64_t n, const uint8_t* bp, int64_t nb, int64_t bin, int64_t bits, size_t r) {
  if (nb == 0) return;
  const int fb = (int)bits - 2;
  const uint32_t mask = (1u << fb) - 1;
  const int64_t wb = bits / 8;
  TORCH_CHECK(nb >= 4 && (nb - 4) % wb == 0, "payload ", r, " is not a scale followed by ", bits, "-bit words");
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

void check_payload(const torch::Tensor& p, size_t r) {
  TORCH_CHECK(p.scalar_type() == torch::kUInt8 && p.is_contiguous() && p.device().is_cpu(),
              "payload ", r, " must be contiguous CPU uint8");
}

// dense float32[n] = sum over payloads, in the given (rank) order, of (code - 1) * scale at each decoded index;
// a payload is AdaComp's paper wire, [float32 scale][words], or empty (nothing sent)
torch::Tensor bin_words_decode_sum(int64_t n, std::vector<torch::Tensor> payloads, int64_t bin, int64_t bits,
                                   torch::Tensor out_) {
  TORCH_CHECK(bits == 8 || bits == 16, "bits must be 8 or 16");
  auto out = output(out_, n);
  out.zero_();
  float* op = out.data_ptr<float>();
  for (size_t r = 0; r < payloads.size(); ++r) {
    check_payload(payloads[r], r);
    add_words(op, n, payloads[r].data_ptr<uint8_t>(), payloads[r].numel(), bin, bits, r);
  }
  return out;
}

// word bits of a bin length (sparse.bin_word_bits)
inline int64_t word_bits(int64_t bin) { return bin < 64 ? 8 : 16; }

// AdaComp over a group of layers back to back (layer s: offsets[s] .. offsets[s + 1], bin length bins[s]), in one
// call and without a dispatched op per layer: per layer the bins' maxima of |G| (absmax), the scale (their mean,
// summed in bin order as torch.segment_reduce sums), the entries |H| >= gmax(bin) with G != 0 (ternary: also
// 2|G| >= scale), and when any is sent [float32 scale][words], the layers' payloads back to back.
// Returns (payload uint8, nbytes int64[n], scale f32[n], count int64[n]).
std::vector<torch::Tensor> adacomp_group_encode(torch::Tensor G, torch::Tensor H, torch::Tensor offsets,
                                                torch::Tensor bins, bool ternary) {
  check_f32(G, "G");
  check_f32(H, "H");
  TORCH_CHECK(G.numel() == H.numel(), "G and H differ in size");
  const int64_t layers = offsets.numel() - 1;
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* bp = bins.data_ptr<int64_t>();
  const float* gp = G.data_ptr<float>();
  const float* hp = H.data_ptr<float>();
  auto nbytes = torch::empty({layers}, torch::kInt64);
  auto scales = torch::empty({layers}, torch::kFloat32);
  auto counts = torch::empty({layers}, torch::kInt64);
  int64_t* np = nbytes.data_ptr<int64_t>();
  float* sp = scales.data_ptr<float>();
  int64_t* cp = counts.data_ptr<int64_t>();
  std::vector<uint8_t> payload;
  std::vector<float> gmax;
  std::vector<int32_t> scratch;
  std::vector<int64_t> index, codes;
  for (int64_t s = 0; s < layers; ++s) {
    const int64_t n = off[s + 1] - off[s], bin = bp[s];
    TORCH_CHECK(bin >= 1 && bin <= (int64_t(1) << 14), "bin length out of range in layer ", s);
    const int64_t nb = (n + bin - 1) / bin;
    const float* g = gp + off[s];
    const float* h = hp + off[s];
    gmax.resize(nb);
    scratch.resize(std::max<int64_t>(bin, 1));
    index.clear();
    codes.clear();
    float sum = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t a = b * bin, e = std::min(n, a + bin);
      gmax[b] = absmax(g + a, e - a);
      sum += gmax[b];
    }
    const float scale = nb ? sum / (float)nb : 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t a = b * bin, e = std::min(n, a + bin);
      const int c = select_tile_ge(h + a, (int)(e - a), gmax[b], (int32_t)a, scratch.data());
      for (int j = 0; j < c; ++j) {
        const float v = g[scratch[j]];
        if (v == 0.0f || (ternary && !(2 * std::fabs(v) >= scale))) continue;  // G = 0 is never sent
        index.push_back(scratch[j]);
        codes.push_back(v > 0 ? 2 : 0);
      }
    }
    const size_t begin = payload.size();
    if (!index.empty()) {
      uint8_t head[4];
      std::memcpy(head, &scale, 4);
      payload.insert(payload.end(), head, head + 4);
      append_words(index.data(), codes.data(), (int64_t)index.size(), bin, word_bits(bin), payload);
    }
    np[s] = (int64_t)(payload.size() - begin);
    sp[s] = scale;
    cp[s] = (int64_t)index.size();
  }
  auto out = torch::empty({(int64_t)payload.size()}, torch::kUInt8);
  if (!payload.empty()) std::memcpy(out.data_ptr<uint8_t>(), payload.data(), payload.size());
  return {out, nbytes, scales, counts};
}

// dense float32[offsets[-1]] = sum over ranks, in the given order, of adacomp_group_encode's payloads, rank r's
// layer s being nbytes[r][s] bytes of payloads[r]
torch::Tensor adacomp_group_decode_sum(std::vector<torch::Tensor> payloads, std::vector<torch::Tensor> nbytes,
                                       torch::Tensor offsets, torch::Tensor bins, torch::Tensor out_) {
  TORCH_CHECK(payloads.size() == nbytes.size(), "payloads and sizes differ in count");
  const int64_t layers = offsets.numel() - 1;
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* bp = bins.data_ptr<int64_t>();
  auto out = output(out_, off[layers]);
  out.zero_();
  float* op = out.data_ptr<float>();
  for (size_t r = 0; r < payloads.size(); ++r) {
    check_payload(payloads[r], r);
    auto sizes = nbytes[r].to(torch::kInt64).contiguous();
    TORCH_CHECK(sizes.numel() == layers, "rank ", r, ": one size per layer expected");
    const int64_t* zp = sizes.data_ptr<int64_t>();
    const uint8_t* pp = payloads[r].data_ptr<uint8_t>();
    int64_t at = 0;
    for (int64_t s = 0; s < layers; ++s) {
      TORCH_CHECK(zp[s] >= 0 && at + zp[s] <= payloads[r].numel(), "rank ", r, ": sizes beyond its payload");
      add_words(op + off[s], off[s + 1] - off[s], pp + at, zp[s], bp[s], word_bits(bp[s]), r);
      at += zp[s];
    }
  }
  return out;
}

}  // namespace
