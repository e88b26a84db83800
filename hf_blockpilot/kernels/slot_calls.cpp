// A masked verify forward's attention on the exact path, as each row's one-token decoding steps compute it: for each
// row r and slot i, one call of PyTorch's CPU flash-attention kernel (what `F.scaled_dot_product_attention` runs for
// it) over the row's first lengths[r] + i + 1 keys, with its mask, the query heads packed as rows of their key/value
// head where `groups` > 1 (as Transformers packs a masked one-query call). The same calls
// `exact_verify.slotwise_exact_attention` makes from Python, without the interpreter's overheads between them (about
// half of each call's cost at a verify's sizes); whether they give SDPA's bits is probed before use
// (hf_blockpilot/exact_verify.py).
#include <torch/extension.h>

#include <optional>
#include <vector>

// q (B, H, n, D), k / v (B, Hkv, L, D), mask (B, 1, n, L) additive -> (B, n, H, Dv), slots past slots[r] zero
torch::Tensor masked_slot_calls(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const torch::Tensor& mask, const std::vector<int64_t>& lengths,
                                const std::vector<int64_t>& slots, std::optional<double> scale, int64_t groups) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4, "4-D query, key, value and mask");
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(3);
  TORCH_CHECK(static_cast<int64_t>(lengths.size()) == batch && static_cast<int64_t>(slots.size()) == batch,
              "a length and a slot count per row");
  TORCH_CHECK(groups >= 1 && heads % groups == 0, "query heads a whole number of groups");
  auto out = torch::zeros({batch, q.size(2), heads, v.size(3)}, q.options());
  for (int64_t r = 0; r < batch; ++r) {
    const auto row_q = q.slice(0, r, r + 1), row_k = k.slice(0, r, r + 1), row_v = v.slice(0, r, r + 1);
    const auto row_mask = mask.slice(0, r, r + 1);
    for (int64_t i = 0; i < slots[r]; ++i) {
      auto query = row_q.slice(2, i, i + 1);
      if (groups > 1) query = query.reshape({1, heads / groups, groups, head_dim});
      const int64_t keys = lengths[r] + i + 1;
      const auto attended = std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(
          query, row_k.slice(2, 0, keys), row_v.slice(2, 0, keys), 0.0, false,
          row_mask.slice(2, i, i + 1).slice(3, 0, keys), scale));
      out.select(0, r).select(0, i).copy_(attended.reshape({heads, -1}));
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("masked_slot_calls", &masked_slot_calls); }
