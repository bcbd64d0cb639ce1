// AdaComp's bin-relative words: encode and decode-sum.
#include "common.h"

namespace {

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
