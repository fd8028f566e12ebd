#include "model/cuda/device_weights.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <numeric>
#include <random>
#include <utility>

#include "backend/cuda/attention.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/decoder_ops.h"
#include "backend/cuda/mla_attention.h"
#include "backend/cuda/moe_stages.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/progress.h"
#include "core/thread_pool.h"
#include "model/gpu_decoder.h"
#include "model/quantized_matrix.h"

namespace moeinfer::gpu {
namespace {

constexpr size_t kAlignment = 256;
constexpr size_t kStagingBytes = size_t{64} << 20;

// A rectangle of a checkpoint tensor placed into a device matrix.
struct Piece {
  TensorView src;  // 1-D views count as one row
  int64_t src_row0 = 0, src_col0 = 0;
  int64_t rows = 0, cols = 0;
  int64_t dst_row0 = 0, dst_col0 = 0;
};

// Rows of a quantised record placed into one expert's slab (a quantised stack's job).
struct QuantPiece {
  const QuantizedMatrix* matrix = nullptr;
  int64_t src_row0 = 0, rows = 0;
  int64_t expert = 0, dst_row0 = 0;  // the slab, and the first row in it
};

// One device matrix: where it lives, its shape, and what fills it.
struct Job {
  size_t offset = 0;
  int64_t rows = 0, cols = 0;
  bool f32 = false;          // stored as float32 (router biases), else bf16
  // 2: each block of block_rows rows is stored twice, hi = bf16(w) and then lo = bf16(w - hi)
  // (DeviceWeights::weight_terms); a stack of experts has a block per expert.
  int64_t terms = 1;
  int64_t block_rows = 0;
  std::vector<Piece> pieces;  // checkpoint upload
  bool padded = false;        // the pieces leave zeros
  float fill_scale = 0.0f;    // synthetic: uniform in [-scale, scale) + offset
  float fill_offset = 0.0f;
  float value_offset = 0.0f;  // added to every stored value (zero-centred norms: 1 + w)
  const void** target = nullptr;
  bool home = false;  // an offloaded expert matrix: lives in the pinned host home
  // A stack of quantised expert slabs (backend/cuda/expert_quant.h): `rows` slabs of a
  // [slab_rows, slab_cols] matrix each, a slab counting as one row of slab.bytes.
  cuda::ExpertQuant quant = cuda::ExpertQuant::kNone;
  int64_t quant_group = 0;
  int64_t slab_rows = 0, slab_cols = 0;
  cuda::QuantMatrixLayout slab;
  std::vector<QuantPiece> quant_pieces;
  // A dense Linear that CudaDecoder::linear() multiplies (attention, MLA but kv_b, Gated
  // DeltaNet, dense and shared MLPs): it may be held as one quantised slab instead
  // (hold_linears_quantised).
  bool linear = false;
  size_t bytes() const { return static_cast<size_t>(rows) * row_bytes() * terms; }
  size_t row_bytes() const {
    if (quant != cuda::ExpertQuant::kNone) return static_cast<size_t>(slab.bytes);
    return static_cast<size_t>(cols) * (f32 ? 4 : 2);
  }
  // Where row `row` of term `term` lives, in bytes from the job's start.
  size_t row_offset(int64_t row, int64_t term) const {
    const int64_t block = row / block_rows;
    return static_cast<size_t>((block * terms + term) * block_rows + row % block_rows) *
           row_bytes();
  }
};

int64_t view_rows(const TensorView& v) { return v.shape.rank() >= 2 ? v.shape[0] : 1; }
int64_t view_cols(const TensorView& v) {
  return v.shape.rank() >= 2 ? v.numel() / v.shape[0] : v.numel();
}

int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// Collects the jobs in upload order and hands out offsets in one allocation.
class Layout {
 public:
  explicit Layout(int64_t terms) : terms_(terms), norm_terms_(terms) {}

  // A matrix (or norm weight) of rows x cols; f32: stored as float32, one term; one_term: bf16
  // in one term whatever the model's (biases, which the kernels add as bf16). block_rows: rows
  // per term block (an expert of a stack); 0: the whole matrix.
  template <typename T>
  Job& add(const T** target, int64_t rows, int64_t cols, bool f32 = false, bool one_term = false,
           int64_t block_rows = 0) {
    Job job;
    job.home = home_mode_;
    size_t& end = home_mode_ ? home_end_ : end_;
    job.offset = end;
    job.rows = rows;
    job.cols = cols;
    job.f32 = f32;
    job.terms = f32 || one_term ? 1 : terms_;
    job.block_rows = block_rows > 0 ? block_rows : std::max<int64_t>(rows, 1);
    job.fill_scale = 1.0f / std::sqrt(static_cast<float>(cols));
    job.target = reinterpret_cast<const void**>(target);
    end += round_up(static_cast<int64_t>(job.bytes()), kAlignment);
    jobs_.push_back(std::move(job));
    return jobs_.back();
  }
  // num_experts quantised slabs of a [rows, cols] matrix each, in device memory.
  template <typename T>
  Job& quant_stack(const T** target, int64_t num_experts, int64_t rows, int64_t cols,
                   cuda::ExpertQuant quant, int64_t group) {
    Job job;
    job.offset = end_;
    job.rows = num_experts;
    job.cols = 0;
    job.quant = quant;
    job.quant_group = group;
    job.slab_rows = rows;
    job.slab_cols = cols;
    job.slab = cuda::quant_matrix_layout(quant, rows, cols, group);
    job.block_rows = std::max<int64_t>(num_experts, 1);
    job.target = reinterpret_cast<const void**>(target);
    end_ += round_up(static_cast<int64_t>(job.bytes()), kAlignment);
    jobs_.push_back(std::move(job));
    return jobs_.back();
  }
  // A whole tensor as stored; synthetic only needs the shape (rows, cols).
  template <typename T>
  Job& whole(const T** target, const TensorView& v, int64_t rows, int64_t cols) {
    return padded(target, v, rows, cols, rows, cols);
  }
  // A tensor of rows x cols at the top left of a zero padded_rows x padded_cols matrix.
  template <typename T>
  Job& padded(const T** target, const TensorView& v, int64_t rows, int64_t cols,
              int64_t padded_rows, int64_t padded_cols, bool one_term = false) {
    Job& job = add(target, padded_rows, padded_cols, /*f32=*/false, one_term);
    job.padded = rows != padded_rows || cols != padded_cols;
    if (!v.empty()) {
      MOE_CHECK(view_rows(v) == rows && view_cols(v) == cols, "tensor of shape ",
                view_rows(v), "x", view_cols(v), " where ", rows, "x", cols, " was expected");
      job.pieces.push_back({.src = v, .rows = rows, .cols = cols});
    }
    return job;
  }
  // Norm weights of `width`, zero up to `padded_width` (padded columns stay zero), in the
  // norms' terms (set_norm_terms).
  template <typename T>
  Job& norm(const T** target, const TensorView& v, int64_t width, int64_t padded_width = 0) {
    const int64_t saved = terms_;
    terms_ = norm_terms_;
    Job& job = padded(target, v, 1, width, 1, std::max(width, padded_width));
    terms_ = saved;
    job.fill_scale = 0.0f;
    job.fill_offset = 1.0f;
    return job;
  }
  // A norm weight of `cols` whose pieces the caller places (per-head layouts).
  template <typename T>
  Job& norm_rows(const T** target, int64_t cols) {
    const int64_t saved = terms_;
    terms_ = norm_terms_;
    Job& job = add(target, 1, cols);
    terms_ = saved;
    job.fill_scale = 0.0f;
    job.fill_offset = 1.0f;
    return job;
  }
  void set_norm_terms(int64_t terms) { norm_terms_ = terms; }

  // Hands out the offsets again, in the same order (after jobs changed their size: a dense
  // matrix held as a quantised slab). With no job changed, every offset stays as it was.
  void place() {
    end_ = home_end_ = 0;
    for (Job& job : jobs_) {
      size_t& end = job.home ? home_end_ : end_;
      job.offset = end;
      end += round_up(static_cast<int64_t>(job.bytes()), kAlignment);
    }
  }

  // While on, added jobs are placed in the host home instead of device memory.
  void set_home(bool on) { home_mode_ = on; }

  std::deque<Job>& jobs() { return jobs_; }
  const std::deque<Job>& jobs() const { return jobs_; }
  size_t bytes() const { return end_; }
  size_t home_bytes() const { return home_end_; }

 private:
  std::deque<Job> jobs_;  // references stay valid as jobs are added
  int64_t terms_ = 1;
  int64_t norm_terms_ = 1;
  size_t end_ = 0;
  size_t home_end_ = 0;
  bool home_mode_ = false;
};

// Places head h of `src` (rows [h*D, (h+1)*D) or, with by_columns, columns) at h*Dp.
void add_heads(Job& job, const TensorView& src, int64_t heads, int64_t D, int64_t Dp,
               int64_t dst_head0, bool by_columns) {
  if (src.empty()) return;
  if (D != Dp) job.padded = true;
  const int64_t other = by_columns ? view_rows(src) : view_cols(src);
  for (int64_t h = 0; h < heads; ++h) {
    Piece piece{.src = src};
    if (by_columns) {
      piece.src_col0 = h * D;
      piece.rows = other;
      piece.cols = D;
      piece.dst_col0 = (dst_head0 + h) * Dp;
    } else {
      piece.src_row0 = h * D;
      piece.rows = D;
      piece.cols = other;
      piece.dst_row0 = (dst_head0 + h) * Dp;
    }
    job.pieces.push_back(piece);
  }
}

// A Gated DeltaNet layer's weights (`lw` null: synthetic). The in-projections become one
// [q | k | v | z | b | a] matrix whatever the checkpoint's packing: Qwen3.5-MoE's four
// projections stacked, Qwen3-Next's per-key-head groups ([q_g | k_g | v of its r value heads |
// z of them], and [b of them | a of them]) taken apart.
void add_linear_attention(const ModelConfig& c, const LinearAttentionWeights* lw, DeviceLayer& d,
                          Layout& layout, int64_t Hp) {
  const LinearAttentionConfig& lin = *c.linear_attention;
  const int64_t H = c.hidden_size;
  const int64_t Nk = lin.num_key_heads, Nv = lin.num_value_heads;
  const int64_t Dk = lin.key_head_dim, Dv = lin.value_head_dim, r = Nv / Nk;
  const int64_t C = lin.conv_dim(), Vd = lin.value_dim(), key_dim = lin.key_dim();
  const int64_t z0 = C, b0 = C + Vd, a0 = C + Vd + Nv;
  Job& in = layout.add(&d.lin_in, C + Vd + 2 * Nv, Hp);
  in.padded = H != Hp;
  in.linear = true;
  if (lw != nullptr && !lw->in_proj_qkvz.empty()) {
    const TensorView& qkvz = lw->in_proj_qkvz;
    const TensorView& ba = lw->in_proj_ba;
    const int64_t group = 2 * Dk + 2 * r * Dv;
    for (int64_t g = 0; g < Nk; ++g) {
      const int64_t s = g * group;
      in.pieces.push_back({.src = qkvz, .src_row0 = s, .rows = Dk, .cols = H, .dst_row0 = g * Dk});
      in.pieces.push_back(
          {.src = qkvz, .src_row0 = s + Dk, .rows = Dk, .cols = H, .dst_row0 = key_dim + g * Dk});
      in.pieces.push_back({.src = qkvz, .src_row0 = s + 2 * Dk, .rows = r * Dv, .cols = H,
                           .dst_row0 = 2 * key_dim + g * r * Dv});
      in.pieces.push_back({.src = qkvz, .src_row0 = s + 2 * Dk + r * Dv, .rows = r * Dv,
                           .cols = H, .dst_row0 = z0 + g * r * Dv});
      in.pieces.push_back(
          {.src = ba, .src_row0 = g * 2 * r, .rows = r, .cols = H, .dst_row0 = b0 + g * r});
      in.pieces.push_back(
          {.src = ba, .src_row0 = g * 2 * r + r, .rows = r, .cols = H, .dst_row0 = a0 + g * r});
    }
  } else if (lw != nullptr) {
    in.pieces.push_back({.src = lw->in_proj_qkv, .rows = C, .cols = H});
    in.pieces.push_back({.src = lw->in_proj_z, .rows = Vd, .cols = H, .dst_row0 = z0});
    in.pieces.push_back({.src = lw->in_proj_b, .rows = Nv, .cols = H, .dst_row0 = b0});
    in.pieces.push_back({.src = lw->in_proj_a, .rows = Nv, .cols = H, .dst_row0 = a0});
  }
  static const TensorView kNone{};
  Job& conv = layout.add(&d.lin_conv, C, lin.conv_kernel, /*f32=*/true);
  if (lw) conv.pieces.push_back({.src = lw->conv1d, .rows = C, .cols = lin.conv_kernel});
  Job& a_log = layout.add(&d.lin_a_log, 1, Nv, /*f32=*/true);
  if (lw) a_log.pieces.push_back({.src = lw->a_log, .rows = 1, .cols = Nv});
  Job& dt_bias = layout.add(&d.lin_dt_bias, 1, Nv, /*f32=*/true);
  if (lw) dt_bias.pieces.push_back({.src = lw->dt_bias, .rows = 1, .cols = Nv});
  Job& norm = layout.add(&d.lin_norm, 1, Dv, /*f32=*/true);
  norm.fill_offset = 1.0f;
  if (lw) norm.pieces.push_back({.src = lw->norm, .rows = 1, .cols = Dv});
  layout.padded(&d.lin_out, lw ? lw->out_proj : kNone, H, Vd, Hp, Vd).linear = true;
}

// The whole model's layout; `w` may be null (synthetic: shapes from the config only). Every
// matrix that reads or writes the hidden state is Hp wide (zero columns or rows past H), so the
// padded columns of the residual stream stay zero through every layer.
void build_layout(const ModelConfig& c, const DecoderWeights* w, bool offload_experts,
                  DeviceWeights& out, Layout& layout) {
  const int64_t H = c.hidden_size, Hp = out.padded_hidden_size, V = c.vocab_size;
  const int64_t D = c.head_dim, Dp = out.padded_head_dim;
  const int64_t Nq = c.num_heads, Nkv = c.num_kv_heads;
  const int64_t E = c.num_experts, I = c.moe_intermediate_size, Ip = out.padded_expert_width;
  static const TensorView kNone{};
  // [rows, H] -> [rows, Hp] (reads the hidden state) and [H, cols] -> [Hp, cols] (writes it).
  auto reads_hidden = [&](auto** target, const TensorView& v, int64_t rows) -> Job& {
    return layout.padded(target, v, rows, H, rows, Hp);
  };
  auto writes_hidden = [&](auto** target, const TensorView& v, int64_t cols) -> Job& {
    return layout.padded(target, v, H, cols, Hp, cols);
  };

  // The decoder's norms (not the gated norm of linear attention, nor MLA's): 1 + w where the
  // checkpoint stores zero-centred weights.
  const float norm_offset = c.norm_weight_offset ? 1.0f : 0.0f;
  reads_hidden(&out.embed, w ? w->embed_tokens : kNone, V).fill_scale = 1.0f;
  layout.norm(&out.final_norm, w ? w->final_norm : kNone, H, Hp).value_offset = norm_offset;
  const bool tied = w ? w->lm_head.data == w->embed_tokens.data : c.tie_word_embeddings;
  if (!tied) reads_hidden(&out.lm_head, w ? w->lm_head : kNone, V);

  out.layers.resize(c.num_layers);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    DeviceLayer& d = out.layers[l];
    const LayerWeights* lw = w ? &w->layers[l] : nullptr;
    layout.norm(&d.input_norm, lw ? lw->input_norm : kNone, H, Hp).value_offset = norm_offset;
    layout.norm(&d.post_norm, lw ? lw->post_attention_norm : kNone, H, Hp).value_offset =
        norm_offset;

    if (c.is_linear_layer(l)) {
      add_linear_attention(c, lw ? &lw->linear_attention : nullptr, d, layout, Hp);
    } else if (c.mla) {
      const MlaConfig& m = *c.mla;
      const int64_t qk = m.qk_head_dim(), L = m.kv_lora_rank, R = m.qk_rope_head_dim;
      const int64_t Lp = out.mla.latent, Rp = out.mla.rope;
      if (m.q_lora_rank > 0) {
        reads_hidden(&d.q_a, lw ? lw->mla.q_a_proj : kNone, m.q_lora_rank).linear = true;
        layout.norm(&d.q_a_norm, lw ? lw->mla.q_a_norm : kNone, m.q_lora_rank);
        layout.whole(&d.q_b, lw ? lw->mla.q_b_proj : kNone, c.num_heads * qk, m.q_lora_rank)
            .linear = true;
      } else {
        reads_hidden(&d.q_proj, lw ? lw->mla.q_proj : kNone, c.num_heads * qk).linear = true;
      }
      // kv_a's latent rows at [0, L) and its rope rows at [Lp, Lp + R).
      Job& kv_a = layout.add(&d.kv_a, Lp + Rp, Hp);
      kv_a.padded = H != Hp || L != Lp || R != Rp;
      kv_a.linear = true;
      if (lw) {
        const TensorView& v = lw->mla.kv_a_proj;
        MOE_CHECK(view_rows(v) == L + R && view_cols(v) == H, "kv_a_proj of shape ",
                  view_rows(v), "x", view_cols(v), " where ", L + R, "x", H, " was expected");
        kv_a.pieces.push_back({.src = v, .rows = L, .cols = H});
        kv_a.pieces.push_back({.src = v, .src_row0 = L, .rows = R, .cols = H, .dst_row0 = Lp});
      }
      layout.norm(&d.kv_a_norm, lw ? lw->mla.kv_a_norm : kNone, L, Lp);
      const int64_t kv_b_rows = c.num_heads * (m.qk_nope_head_dim + m.v_head_dim);
      layout.padded(&d.kv_b, lw ? lw->mla.kv_b_proj : kNone, kv_b_rows, L, kv_b_rows, Lp);
      // kv_b stays bf16: the absorbed per-head products (CudaDecoder::absorbed) read it.
      writes_hidden(&d.mla_o, lw ? lw->mla.o_proj : kNone, c.num_heads * m.v_head_dim).linear =
          true;
    } else {
      const int64_t Nqkv = (Nq + 2 * Nkv) * Dp;
      const bool gate = c.attention_output_gate;
      Job& qkv = layout.add(&d.qkv, Nqkv + (gate ? Nq * Dp : 0), Hp);
      qkv.padded = H != Hp;
      qkv.linear = true;
      if (lw && gate) {
        // q_proj is [Nq, 2D, H]: each head's query rows, then its gate rows; the gates go after v.
        const TensorView& q = lw->attention.q_proj;
        MOE_CHECK(view_rows(q) == 2 * Nq * D, "q_proj with an output gate has ", view_rows(q),
                  " rows where ", 2 * Nq * D, " were expected");
        qkv.padded = qkv.padded || D != Dp;
        for (int64_t h = 0; h < Nq; ++h) {
          qkv.pieces.push_back(
              {.src = q, .src_row0 = 2 * h * D, .rows = D, .cols = H, .dst_row0 = h * Dp});
          qkv.pieces.push_back({.src = q, .src_row0 = 2 * h * D + D, .rows = D, .cols = H,
                                .dst_row0 = Nqkv + h * Dp});
        }
      } else if (lw) {
        add_heads(qkv, lw->attention.q_proj, Nq, D, Dp, 0, false);
      }
      if (lw) {
        add_heads(qkv, lw->attention.k_proj, Nkv, D, Dp, Nq, false);
        add_heads(qkv, lw->attention.v_proj, Nkv, D, Dp, Nq + Nkv, false);
      }
      if (c.attention_bias) {
        Job& bias = layout.add(&d.qkv_bias, 1, Nqkv, /*f32=*/false, /*one_term=*/true);
        bias.fill_scale = 0.02f;
        if (lw) {
          add_heads(bias, lw->attention.q_bias, Nq, D, Dp, 0, true);
          add_heads(bias, lw->attention.k_bias, Nkv, D, Dp, Nq, true);
          add_heads(bias, lw->attention.v_bias, Nkv, D, Dp, Nq + Nkv, true);
        }
      }
      if (c.qk_norm_per_head) {
        layout.norm(&d.q_norm, lw ? lw->attention.q_norm : kNone, D).value_offset = norm_offset;
        layout.norm(&d.k_norm, lw ? lw->attention.k_norm : kNone, D).value_offset = norm_offset;
      } else if (c.qk_norm_full) {
        Job& qn = layout.norm_rows(&d.q_norm, Nq * Dp);
        Job& kn = layout.norm_rows(&d.k_norm, Nkv * Dp);
        qn.value_offset = kn.value_offset = norm_offset;
        if (lw) {
          add_heads(qn, lw->attention.q_norm, Nq, D, Dp, 0, true);
          add_heads(kn, lw->attention.k_norm, Nkv, D, Dp, 0, true);
        }
      }
      Job& o = layout.add(&d.o_proj, Hp, Nq * Dp);
      o.padded = H != Hp;
      o.linear = true;
      if (lw) add_heads(o, lw->attention.o_proj, Nq, D, Dp, 0, true);
      if (c.attention_out_bias) {
        layout.padded(&d.o_bias, lw ? lw->attention.o_bias : kNone, 1, H, 1, Hp,
                      /*one_term=*/true)
            .fill_scale = 0.02f;
      }
      if (c.attention_sinks) {  // float32 [Nq]; a synthetic model's are zero
        Job& sinks = layout.add(&d.sinks, 1, Nq, /*f32=*/true);
        if (lw) sinks.pieces.push_back({.src = lw->attention.sinks, .rows = 1, .cols = Nq});
      }
    }

    d.is_moe = c.layer_is_moe[l];
    auto add_mlp = [&](const bf16** gate_up, const bf16** down, const MlpWeights* mlp,
                       int64_t width) {
      Job& gu = layout.add(gate_up, 2 * width, Hp);
      gu.padded = H != Hp;
      gu.linear = true;
      if (mlp) {
        gu.pieces.push_back({.src = mlp->gate_proj, .rows = width, .cols = H});
        gu.pieces.push_back({.src = mlp->up_proj, .rows = width, .cols = H, .dst_row0 = width});
      }
      writes_hidden(down, mlp ? mlp->down_proj : kNone, width).linear = true;
    };
    if (!d.is_moe) {
      d.mlp_width = lw ? lw->mlp.gate_proj.shape[0] : c.intermediate_size;
      add_mlp(&d.mlp_gate_up, &d.mlp_down, lw ? &lw->mlp : nullptr, d.mlp_width);
      continue;
    }
    const MoeWeights* mw = lw ? &lw->moe : nullptr;
    reads_hidden(&d.router, mw ? mw->routed.router : kNone, E);
    if (c.router_selection_bias) {
      Job& bias = layout.add(&d.selection_bias, 1, E, /*f32=*/true);
      bias.fill_scale = 0.0f;
      if (mw) bias.pieces.push_back({.src = mw->selection_bias, .rows = 1, .cols = E});
    }
    if (c.router_bias) {  // float32 [E]; a synthetic model's is zero
      Job& bias = layout.add(&d.router_bias, 1, E, /*f32=*/true);
      if (mw) bias.pieces.push_back({.src = mw->router_bias, .rows = 1, .cols = E});
    }
    if (c.expert_bias) {
      // float32, resident even with offloaded experts: [E, 2 Ip] (gate at 0, up at Ip) and
      // [E, Hp], zeros in the padding; a synthetic model's are zero.
      Job& gu_bias = layout.add(&d.experts_gate_up_bias, E, 2 * Ip, /*f32=*/true);
      Job& down_bias = layout.add(&d.experts_down_bias, E, Hp, /*f32=*/true);
      gu_bias.padded = I != Ip;
      down_bias.padded = H != Hp;
      MOE_CHECK(mw == nullptr || static_cast<int64_t>(mw->routed.experts.size()) == E, "layer ",
                l, " has ", mw ? mw->routed.experts.size() : 0, " experts bound, the config says ",
                E);
      for (int64_t e = 0; mw != nullptr && e < E; ++e) {
        const moe::ExpertWeights& ex = mw->routed.experts[e];
        MOE_CHECK(!ex.gate_bias.empty() && !ex.up_bias.empty() && !ex.down_bias.empty(),
                  "layer ", l, " expert ", e, " has no gate, up or down bias; the config says "
                  "its experts have them");
        gu_bias.pieces.push_back({.src = ex.gate_bias, .rows = 1, .cols = I, .dst_row0 = e});
        gu_bias.pieces.push_back(
            {.src = ex.up_bias, .rows = 1, .cols = I, .dst_row0 = e, .dst_col0 = Ip});
        down_bias.pieces.push_back({.src = ex.down_bias, .rows = 1, .cols = H, .dst_row0 = e});
      }
    }
    if (out.expert_quant != cuda::ExpertQuant::kNone) {
      // Quantised (chosen by plan_layout with bound weights whose every expert has codes, or for
      // a synthetic model under --weights fp8|int4: then no pieces, random codes).
      Job& gu = layout.quant_stack(&d.experts_gate_up, E, 2 * Ip, Hp, out.expert_quant,
                                   out.expert_quant_group);
      Job& down = layout.quant_stack(&d.experts_down, E, Hp, Ip, out.expert_quant,
                                     out.expert_quant_group);
      out.expert_bytes = gu.slab.bytes + down.slab.bytes;
      MOE_CHECK(mw == nullptr || static_cast<int64_t>(mw->routed.experts.size()) == E, "layer ", l,
                " has ", mw ? mw->routed.experts.size() : 0, " experts bound, the config says ", E);
      for (int64_t e = 0; mw != nullptr && e < E; ++e) {
        const moe::ExpertWeights& ex = mw->routed.experts[e];
        auto piece = [&](Job& job, const TensorView& view, int64_t dst_row0, int64_t rows,
                         int64_t cols) {
          MOE_CHECK(view.shape.rank() == 2 && view.shape[0] == rows && view.shape[1] == cols,
                    "layer ", l, " expert ", e, ": a matrix of shape ", view.shape.str(),
                    " where ", rows, "x", cols, " was expected");
          int64_t first_row = 0;
          const QuantizedMatrix* m = w->quantized->find(view, &first_row);
          MOE_CHECK(m != nullptr, "layer ", l, " expert ", e, " has no codes");
          job.quant_pieces.push_back({.matrix = m, .src_row0 = first_row,
                                      .rows = view.shape[0], .expert = e,
                                      .dst_row0 = dst_row0});
        };
        piece(gu, ex.gate, 0, I, H);
        piece(gu, ex.up, Ip, I, H);
        piece(down, ex.down, 0, H, I);
      }
    } else {
      layout.set_home(offload_experts);
      Job& gu =
          layout.add(&d.experts_gate_up, E * 2 * Ip, Hp, false, false, /*block_rows=*/2 * Ip);
      Job& down = layout.add(&d.experts_down, E * Hp, Ip, false, false, /*block_rows=*/Hp);
      layout.set_home(false);
      out.expert_bytes = static_cast<int64_t>(gu.row_bytes() * gu.terms) * 2 * Ip +
                         static_cast<int64_t>(down.row_bytes() * down.terms) * Hp;
      gu.padded = down.padded = I != Ip || H != Hp;
      down.fill_scale = 1.0f / std::sqrt(static_cast<float>(I));
      if (mw) {
        MOE_CHECK(static_cast<int64_t>(mw->routed.experts.size()) == E, "layer ", l, " has ",
                  mw->routed.experts.size(), " experts bound, the config says ", E);
        for (int64_t e = 0; e < E; ++e) {
          const moe::ExpertWeights& ex = mw->routed.experts[e];
          gu.pieces.push_back({.src = ex.gate, .rows = I, .cols = H, .dst_row0 = e * 2 * Ip});
          gu.pieces.push_back({.src = ex.up, .rows = I, .cols = H, .dst_row0 = e * 2 * Ip + Ip});
          down.pieces.push_back({.src = ex.down, .rows = H, .cols = I, .dst_row0 = e * Hp});
        }
      }
    }
    const bool has_shared = mw ? !mw->shared_expert.gate_proj.empty()
                               : c.shared_expert_intermediate_size > 0;
    if (has_shared) {
      d.shared_width =
          mw ? mw->shared_expert.gate_proj.shape[0] : c.shared_expert_intermediate_size;
      add_mlp(&d.shared_gate_up, &d.shared_down, mw ? &mw->shared_expert : nullptr,
              d.shared_width);
      if (c.shared_expert_gated) {
        reads_hidden(&d.shared_gate, mw ? mw->shared_expert_gate : kNone, 1);
      }
    }
  }
}

// Converts n stored values to bf16 (or float32) at dst: term 0 is bf16(w), term 1 the rest,
// bf16(w - bf16(w)) (zero for a bf16 source).
void convert_row(DType dtype, const void* src, size_t n, bool to_f32, int64_t term, void* dst,
                 std::vector<float>& scratch, float offset) {
  if (to_f32) {
    convert_to_f32(dtype, src, static_cast<float*>(dst), n);
    for (size_t i = 0; offset != 0.0f && i < n; ++i) static_cast<float*>(dst)[i] += offset;
    return;
  }
  auto* out = static_cast<uint16_t*>(dst);
  if (dtype == DType::kBF16 && offset == 0.0f) {
    if (term == 0) {
      std::memcpy(out, src, n * 2);
    } else {
      std::memset(out, 0, n * 2);
    }
    return;
  }
  scratch.resize(n);
  convert_to_f32(dtype, src, scratch.data(), n);
  for (size_t i = 0; offset != 0.0f && i < n; ++i) scratch[i] += offset;
  if (term == 0) {
    for (size_t i = 0; i < n; ++i) out[i] = f32_to_bf16(scratch[i]);
  } else {
    for (size_t i = 0; i < n; ++i) {
      out[i] = f32_to_bf16(scratch[i] - bf16_to_f32(f32_to_bf16(scratch[i])));
    }
  }
}

// Writes rows [src_row0, src_row0 + rows) of a record at row dst_row0 of a slab laid out as
// `slab` (zeroed before: the padding's codes and scales stay zero, so its values are zero).
void write_quant_rows(const QuantizedMatrix& m, int64_t src_row0, int64_t rows, int64_t dst_row0,
                      const cuda::QuantMatrixLayout& slab, char* out) {
  const bool fp8 = m.format == CodeFormat::kFp8;
  const int64_t code_bytes = fp8 ? m.cols : m.cols / 2;
  const int64_t groups = m.format == CodeFormat::kMxfp4 ? m.cols / 32 : m.groups_per_row();
  MOE_CHECK(code_bytes <= slab.row_code_bytes && groups <= slab.groups_per_row,
            "a quantised matrix of ", m.cols, " inputs does not fit its device slab");
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t src = src_row0 + r, dst = dst_row0 + r;
    std::memcpy(out + dst * slab.row_code_bytes, m.code_data() + src * code_bytes,
                static_cast<size_t>(code_bytes));
    if (m.format == CodeFormat::kMxfp4) {
      std::memcpy(out + slab.scale_offset + dst * slab.groups_per_row,
                  m.exponents.data() + src * groups, static_cast<size_t>(groups));
      continue;
    }
    std::memcpy(out + slab.scale_offset + dst * slab.groups_per_row * 4,
                m.scales.data() + src * groups, static_cast<size_t>(groups) * 4);
    if (m.format == CodeFormat::kInt4) {
      std::memcpy(out + slab.zero_offset + dst * slab.groups_per_row * 4,
                  m.zeros.data() + src * groups, static_cast<size_t>(groups) * 4);
    }
  }
}

// Fills term `term` of rows [row_begin, row_end) of `job` into `staging` (row_begin at its start).
void stage_rows(const Job& job, int64_t row_begin, int64_t row_end, int64_t term, char* staging) {
  if (job.quant != cuda::ExpertQuant::kNone) {  // rows are expert slabs
    std::memset(staging, 0, static_cast<size_t>(row_end - row_begin) * job.row_bytes());
    for (const QuantPiece& p : job.quant_pieces) {
      if (p.expert < row_begin || p.expert >= row_end) continue;
      write_quant_rows(*p.matrix, p.src_row0, p.rows, p.dst_row0, job.slab,
                       staging + static_cast<size_t>(p.expert - row_begin) * job.row_bytes());
    }
    return;
  }
  const size_t elem = job.f32 ? 4 : 2;
  const size_t row_bytes = job.row_bytes();
  if (job.padded) std::memset(staging, 0, static_cast<size_t>(row_end - row_begin) * row_bytes);
  for (const Piece& p : job.pieces) {
    const int64_t begin = std::max(row_begin, p.dst_row0);
    const int64_t end = std::min(row_end, p.dst_row0 + p.rows);
    if (begin >= end) continue;
    const int64_t src_cols = view_cols(p.src);
    const size_t src_elem = dtype_size(p.src.dtype);
    parallel_for(end - begin, [&](int64_t a, int64_t b) {
      std::vector<float> scratch;
      for (int64_t r = begin + a; r < begin + b; ++r) {
        const int64_t src_row = p.src_row0 + (r - p.dst_row0);
        const char* src = static_cast<const char*>(p.src.data) +
                          (src_row * src_cols + p.src_col0) * static_cast<int64_t>(src_elem);
        char* dst = staging + static_cast<size_t>(r - row_begin) * row_bytes +
                    static_cast<size_t>(p.dst_col0) * elem;
        convert_row(p.src.dtype, src, static_cast<size_t>(p.cols), job.f32, term, dst, scratch,
                    job.value_offset);
      }
    }, /*min_chunk=*/64);
  }
}

DeviceArray<char> allocate(size_t bytes) {
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  MOE_CHECK(bytes <= free_bytes, "the weights need ", bytes >> 20, " MiB of device memory, ",
            free_bytes >> 20, " MiB are free (use --layers to cut a synthetic model)");
  return device_array<char>(bytes);
}

void resolve_targets(Layout& layout, void* base, void* home) {
  for (Job& job : layout.jobs()) {
    *job.target = static_cast<char*>(job.home ? home : base) + job.offset;
  }
}

// The dense Linears held as quantised slabs (after resolve_targets), and which layers' shared
// experts are among them.
void collect_dense_quant(const Layout& layout, DeviceWeights& out) {
  for (const Job& job : layout.jobs()) {
    if (!job.linear || job.quant == cuda::ExpertQuant::kNone) continue;
    out.dense_quant.push_back({.data = *job.target,
                               .format = job.quant,
                               .group = job.quant_group,
                               .rows = job.slab_rows,
                               .cols = job.slab_cols,
                               .layout = job.slab});
    out.dense_quant_max_elems = std::max(out.dense_quant_max_elems, job.slab_rows * job.slab_cols);
    out.dense_quant_bytes += job.slab.bytes;
  }
  for (DeviceLayer& d : out.layers) {
    for (const DenseQuantMatrix& m : out.dense_quant) {
      if (m.data == d.shared_gate_up || m.data == d.shared_down) d.shared_quantized = true;
    }
  }
}

// The pinned home of offloaded experts.
PinnedArray<char> allocate_home(size_t bytes) {
  if (bytes == 0) return nullptr;
  try {
    return mapped_pinned_array<char>(bytes);
  } catch (const Error& e) {
    MOE_CHECK(false, "the offloaded experts need ", bytes >> 20,
              " MiB of pinned host memory, which could not be allocated: ", e.what());
  }
  return nullptr;
}

// The device format of a record's codes.
cuda::ExpertQuant expert_quant_of(CodeFormat format) {
  switch (format) {
    case CodeFormat::kFp8:
      return cuda::ExpertQuant::kFp8;
    case CodeFormat::kInt4:
      return cuda::ExpertQuant::kInt4;
    case CodeFormat::kMxfp4:
      return cuda::ExpertQuant::kMxfp4;
  }
  return cuda::ExpertQuant::kNone;  // unreachable: every enumerator returns above
}

// The quantised format the routed experts are held in: the records' format and group when every
// routed expert matrix of every MoE layer has one, all alike, in a group the expert GEMM reads
// (a multiple of 8, MXFP4's 32); else kNone, bf16 experts (GPTQ with act-order, a bf16
// checkpoint).
std::pair<cuda::ExpertQuant, int64_t> expert_codes(const ModelConfig& config,
                                                   const DecoderWeights& weights) {
  constexpr std::pair kBf16{cuda::ExpertQuant::kNone, int64_t{0}};
  if (weights.quantized == nullptr || weights.quantized->empty() || config.num_experts <= 0) {
    return kBf16;
  }
  const QuantizedMatrix* first = nullptr;
  for (const LayerWeights& layer : weights.layers) {
    if (!layer.is_moe) continue;
    for (const moe::ExpertWeights& ex : layer.moe.routed.experts) {
      for (const TensorView* view : {&ex.gate, &ex.up, &ex.down}) {
        int64_t first_row = 0;
        const QuantizedMatrix* m = weights.quantized->find(*view, &first_row);
        if (m == nullptr) return kBf16;
        if (first == nullptr) first = m;
        if (m->format != first->format || m->group != first->group) return kBf16;
      }
    }
  }
  if (first == nullptr) return kBf16;
  const bool readable = first->format == CodeFormat::kMxfp4 ? first->group == 32
                                                             : first->group % 8 == 0;
  if (!readable) return kBf16;
  return {expert_quant_of(first->format), first->group};
}

// Turns a dense Linear job into one quantised slab of its [rows, cols] matrix.
void make_quant_slab(Job& job, cuda::ExpertQuant quant, int64_t group) {
  job.quant = quant;
  job.quant_group = group;
  job.slab_rows = job.rows;
  job.slab_cols = job.cols;
  job.slab = cuda::quant_matrix_layout(quant, job.rows, job.cols, group);
  job.rows = 1;
  job.cols = 0;
  job.terms = 1;
  job.block_rows = 1;
  job.padded = false;
}

// The quantised pieces of a dense Linear job whose every piece is rows of a quantised record
// (model/quantized_matrix.h) in fp8 or int4, all in one format and group the device reads, its
// columns where the record has them; empty when it must stay bf16 (a piece without codes, MXFP4,
// columns moved (heads padded along K), int4 whose padded columns would share a group with
// real ones, K not a multiple of 8).
std::vector<QuantPiece> linear_quant_pieces(const Job& job, const QuantizedMatrices& records) {
  std::vector<QuantPiece> out;
  if (job.pieces.empty() || job.cols % 8 != 0) return {};
  const QuantizedMatrix* first = nullptr;
  for (const Piece& p : job.pieces) {
    if (p.src.shape.rank() != 2 || p.src_col0 != p.dst_col0) return {};
    int64_t first_row = 0;
    const QuantizedMatrix* m = records.find(p.src, &first_row);
    if (m == nullptr || m->format == CodeFormat::kMxfp4 || m->group % 8 != 0) return {};
    if (first == nullptr) first = m;
    if (m->format != first->format || m->group != first->group) return {};
    if (m->cols > job.cols) return {};
    if (m->format == CodeFormat::kInt4 && m->cols != job.cols && m->cols % m->group != 0) {
      return {};  // a padded column's code 0 would not be zero in a group with a zero point
    }
    // The columns of a head-by-head piece (o_proj) are the record's own: one piece per rows.
    const QuantPiece piece{.matrix = m,
                           .src_row0 = first_row + p.src_row0,
                           .rows = p.rows,
                           .expert = 0,
                           .dst_row0 = p.dst_row0};
    const bool seen = std::any_of(out.begin(), out.end(), [&](const QuantPiece& q) {
      return q.matrix == m && q.src_row0 == piece.src_row0 && q.dst_row0 == piece.dst_row0 &&
             q.rows == piece.rows;
    });
    if (!seen) out.push_back(piece);
  }
  return out;
}

// Dense Linear jobs held as quantised slabs: with bound weights, each whose pieces all have
// codes the device reads (a block-scaled fp8, GPTQ or AWQ checkpoint's dense matrices, or
// --weights-scope linear); for a synthetic model, every one under `synthetic` codes (random
// codes, no pieces). Offsets are handed out again afterwards.
void hold_linears_quantised(Layout& layout, const DecoderWeights* weights, ExpertCodes synthetic) {
  bool changed = false;
  for (Job& job : layout.jobs()) {
    if (!job.linear || job.quant != cuda::ExpertQuant::kNone) continue;
    if (weights == nullptr) {
      if (synthetic.format == cuda::ExpertQuant::kNone || job.cols % 8 != 0) continue;
      make_quant_slab(job, synthetic.format, synthetic.group);
      changed = true;
      continue;
    }
    if (weights->quantized == nullptr || weights->quantized->empty()) return;
    std::vector<QuantPiece> pieces = linear_quant_pieces(job, *weights->quantized);
    if (pieces.empty()) continue;
    const QuantizedMatrix& m = *pieces.front().matrix;
    make_quant_slab(job, expert_quant_of(m.format), m.group);
    job.pieces.clear();
    job.quant_pieces = std::move(pieces);
    changed = true;
  }
  if (changed) layout.place();
}

// The padded dims and the layout of every matrix (`weights` null: shapes only, synthetic, whose
// routed experts are held as `synthetic_codes`, and under `synthetic_scope` linear the dense
// Linears too), each bf16 matrix in `terms` terms.
Layout plan_layout(const ModelConfig& config, const DecoderWeights* weights, bool offload_experts,
                   int64_t terms, DeviceWeights& out, ExpertCodes synthetic_codes = {},
                   WeightScope synthetic_scope = WeightScope::kExperts) {
  out.padded_hidden_size = padded_hidden_size(config);
  out.padded_head_dim = padded_head_dim(config);
  out.padded_expert_width = padded_expert_width(config);
  out.mla = padded_mla_dims(config);
  out.experts_offloaded =
      offload_experts && config.num_experts > 0 &&
      std::find(config.layer_is_moe.begin(), config.layer_is_moe.end(), true) !=
          config.layer_is_moe.end();
  out.weight_terms = terms;
  const auto [quant, group] = weights != nullptr
                                  ? expert_codes(config, *weights)
                                  : std::pair{synthetic_codes.format, synthetic_codes.group};
  // The expert cache's slots and host home hold bf16 experts: with it the codes stay unused.
  const bool held = !out.experts_offloaded;
  out.expert_quant = held ? quant : cuda::ExpertQuant::kNone;
  out.expert_quant_group = held ? group : 0;
  out.expert_codes_unused =
      !held && quant != cuda::ExpertQuant::kNone ? cuda::expert_quant_name(quant) : nullptr;
  out.norm_terms = terms == 2 || config.norm_weight_offset ? 2 : 1;
  Layout layout(terms);
  layout.set_norm_terms(out.norm_terms);
  build_layout(config, weights, out.experts_offloaded, out, layout);
  hold_linears_quantised(layout, weights,
                         synthetic_scope == WeightScope::kLinear ? synthetic_codes : ExpertCodes{});
  return layout;
}

// 2 when most of the bf16 matrices' values come from float32 or float16 tensors (a float32
// checkpoint: bf16 would round every weight), else 1.
int64_t checkpoint_weight_terms(const ModelConfig& config, const DecoderWeights& weights) {
  DeviceWeights shapes;
  const Layout layout = plan_layout(config, &weights, /*offload_experts=*/false, 1, shapes);
  int64_t wide = 0, all = 0;
  for (const Job& job : layout.jobs()) {
    if (job.f32) continue;
    // Quantised experts count as narrow values, as their bf16 dequantisation did before.
    for (const QuantPiece& piece : job.quant_pieces) all += piece.rows * piece.matrix->cols;
    for (const Piece& piece : job.pieces) {
      const int64_t values = piece.rows * piece.cols;
      all += values;
      if (piece.src.dtype == DType::kF32 || piece.src.dtype == DType::kF16) wide += values;
    }
  }
  return 2 * wide > all ? 2 : 1;
}

}  // namespace

int64_t padded_hidden_size(const ModelConfig& config) { return round_up(config.hidden_size, 64); }

int64_t padded_head_dim(const ModelConfig& config) {
  if (config.mla) return 0;
  const int64_t D = config.head_dim;
  MOE_CHECK(D > 0, "head_dim ", D, " must be positive");
  // 64, 128 or 256 (the fast attention kernels), a multiple of 64 above (the wide decode kernel;
  // prompts then take the per-query route).
  return cuda::decode_padded_head_dim(D);
}

int64_t padded_expert_width(const ModelConfig& config) {
  return round_up(config.moe_intermediate_size, 64);
}

MlaPaddedDims padded_mla_dims(const ModelConfig& config) {
  if (!config.mla) return {};
  return {.latent = round_up(config.mla->kv_lora_rank, 8),
          .rope = round_up(config.mla->qk_rope_head_dim, 8)};
}

ExpertCodes expert_codes_for(WeightFormat format) {
  switch (format) {
    case WeightFormat::kFp8:
      return {.format = cuda::ExpertQuant::kFp8, .group = kFp8BlockSize};
    case WeightFormat::kInt4:
      return {.format = cuda::ExpertQuant::kInt4, .group = kInt4GroupSize};
    case WeightFormat::kCheckpoint:
    case WeightFormat::kBf16:
      return {};
  }
  return {};  // unreachable: every enumerator returns above
}

int64_t device_weight_bytes(const ModelConfig& config, int64_t weight_terms,
                            WeightFormat expert_weights, WeightScope scope) {
  DeviceWeights shapes;
  const Layout layout = plan_layout(config, nullptr, /*offload_experts=*/false, weight_terms,
                                    shapes, expert_codes_for(expert_weights), scope);
  return static_cast<int64_t>(layout.bytes());
}

DeviceWeights upload_weights(const ModelConfig& config, const DecoderWeights& weights,
                             bool show_progress, bool offload_experts, bool round_to_bf16) {
  DeviceWeights out;
  const int64_t terms = round_to_bf16 ? 1 : checkpoint_weight_terms(config, weights);
  Layout layout = plan_layout(config, &weights, offload_experts, terms, out);
  out.bytes = static_cast<int64_t>(layout.bytes());
  out.allocation = allocate(layout.bytes());
  out.expert_home_bytes = static_cast<int64_t>(layout.home_bytes());
  out.expert_home = allocate_home(layout.home_bytes());
  resolve_targets(layout, out.allocation.get(), out.expert_home.get());
  if (out.lm_head == nullptr) out.lm_head = out.embed;  // tied
  collect_dense_quant(layout, out);

  const auto start = std::chrono::steady_clock::now();
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  char* staging[2] = {nullptr, nullptr};
  cudaEvent_t done[2] = {nullptr, nullptr};
  for (int i = 0; i < 2; ++i) {
    CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&staging[i]), kStagingBytes,
                             cudaHostAllocDefault));
    CUDA_CHECK(cudaEventCreateWithFlags(&done[i], cudaEventDisableTiming));
  }
  size_t total = 0;
  for (const Job& job : layout.jobs()) total += job.bytes();
  ProgressBar progress("upload to GPU", total,
                       {.force = false, .delay_s = show_progress ? 1.0 : 1e30, .unit = "B"});
  int which = 0;
  for (const Job& job : layout.jobs()) {
    const size_t row_bytes = job.row_bytes();
    if (job.quant != cuda::ExpertQuant::kNone && !job.home && row_bytes > kStagingBytes) {
      // A dense matrix's slab larger than a staging buffer (DeepSeek-V3's o_proj in fp8 is
      // 117 MB): assembled in pageable memory and copied in one go.
      std::vector<char> whole(row_bytes);
      stage_rows(job, 0, 1, 0, whole.data());
      CUDA_CHECK(cudaStreamSynchronize(stream));
      CUDA_CHECK(cudaMemcpy(out.allocation.get() + job.offset, whole.data(), row_bytes,
                            cudaMemcpyHostToDevice));
      progress.advance(row_bytes);
      continue;
    }
    MOE_CHECK(row_bytes <= kStagingBytes, "a row of ", row_bytes, " bytes exceeds the staging buffer");
    const int64_t chunk_rows = static_cast<int64_t>(kStagingBytes / row_bytes);
    for (int64_t row = 0, end = 0; row < job.rows; row = end) {
      // A chunk stays inside one term block, whose terms are contiguous rows of their own.
      end = std::min({job.rows, row + chunk_rows, (row / job.block_rows + 1) * job.block_rows});
      const size_t bytes = static_cast<size_t>(end - row) * row_bytes;
      for (int64_t term = 0; term < job.terms; ++term) {
        const size_t dst_offset = job.offset + job.row_offset(row, term);
        if (job.home) {  // converted straight into the home: no staging, no copy
          stage_rows(job, row, end, term, out.expert_home.get() + dst_offset);
          progress.advance(bytes);
          continue;
        }
        CUDA_CHECK(cudaEventSynchronize(done[which]));  // the copy out of this buffer finished
        stage_rows(job, row, end, term, staging[which]);
        CUDA_CHECK(cudaMemcpyAsync(out.allocation.get() + dst_offset, staging[which], bytes,
                                   cudaMemcpyHostToDevice, stream));
        CUDA_CHECK(cudaEventRecord(done[which], stream));
        progress.advance(bytes);
        which ^= 1;
      }
    }
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  progress.finish();
  for (int i = 0; i < 2; ++i) {
    cudaEventDestroy(done[i]);
    cudaFreeHost(staging[i]);
  }
  cudaStreamDestroy(stream);
  out.upload_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

DeviceWeights synthetic_weights(const ModelConfig& config, uint64_t seed,
                                const RoutingSkew& routing, bool offload_experts,
                                WeightFormat expert_weights, WeightScope scope) {
  const double zipf_exponent = routing.kind == RoutingSkew::Kind::kZipf ? routing.exponent : 0.0;
  const ExpertCodes codes = expert_codes_for(expert_weights);
  MOE_CHECK(codes.format == cuda::ExpertQuant::kNone || !offload_experts, "--weights ",
            weight_format_name(expert_weights),
            " with --expert-budget: the expert cache holds bf16 experts, and a synthetic "
            "model's quantised experts have no bf16 values; drop one of the two");
  DeviceWeights out;
  MOE_CHECK(scope == WeightScope::kExperts || codes.format != cuda::ExpertQuant::kNone,
            "--weights-scope linear needs --weights fp8 or --weights int4");
  Layout layout = plan_layout(config, nullptr, offload_experts, /*terms=*/1, out, codes, scope);
  // Random fills cover whole matrices, padding included, so synthetic shapes must need none.
  MOE_CHECK(out.padded_hidden_size == config.hidden_size,
            "synthetic models need hidden_size a multiple of 64, not ", config.hidden_size);
  MOE_CHECK(out.padded_head_dim == 0 || out.padded_head_dim == config.head_dim,
            "synthetic models need head_dim 64, 128 or 256, not ", config.head_dim);
  MOE_CHECK(out.padded_expert_width == config.moe_intermediate_size,
            "synthetic models need moe_intermediate_size a multiple of 64, not ",
            config.moe_intermediate_size);
  // zipf:A: a logit bias per MoE layer, -A log(rank + 1) over a random ranking of the experts,
  // added to per-token Gumbel noise that replaces the router's logits, so that each token draws
  // its experts with probabilities proportional to (rank + 1)^-A. (A bias on the random router's
  // own logits, whose spread is small, would pick nearly the same experts for every token.)
  std::vector<size_t> skew_jobs;
  if (zipf_exponent > 0.0) {
    for (DeviceLayer& d : out.layers) {
      if (!d.is_moe) continue;
      layout.add(&d.logit_bias, 1, config.num_experts, /*f32=*/true);
      skew_jobs.push_back(layout.jobs().size() - 1);
    }
  }
  if (routing.kind != RoutingSkew::Kind::kNone) {
    for (size_t l = 0; l < out.layers.size(); ++l) {
      DeviceLayer& d = out.layers[l];
      if (!d.is_moe) continue;
      d.router_noise = true;
      d.router_noise_seed = cuda::router_noise_mix(cuda::router_noise_mix(seed) ^ (l + 1));
    }
  }
  out.bytes = static_cast<int64_t>(layout.bytes());
  out.allocation = allocate(layout.bytes());
  out.expert_home_bytes = static_cast<int64_t>(layout.home_bytes());
  out.expert_home = allocate_home(layout.home_bytes());
  resolve_targets(layout, out.allocation.get(), out.expert_home.get());
  if (out.lm_head == nullptr) out.lm_head = out.embed;
  collect_dense_quant(layout, out);
  // Home matrices are filled a device staging buffer at a time and copied down.
  DeviceArray<bf16> staging;
  if (out.expert_home) staging = device_array<bf16>(kStagingBytes / sizeof(bf16));

  std::mt19937_64 rng(seed);
  for (size_t j = 0; j < layout.jobs().size(); ++j) {
    const Job& job = layout.jobs()[j];
    void* dst = (job.home ? out.expert_home.get() : out.allocation.get()) + job.offset;
    if (job.quant != cuda::ExpertQuant::kNone) {
      // Random codes and scales; the gaps between a slab's parts zero, so that two builds of
      // one seed are the same bytes. Values within +-1/sqrt(fan-in), as the bf16 experts'.
      CUDA_CHECK(cudaMemset(dst, 0, job.bytes()));
      cuda::quant_random_fill({.out = dst,
                               .num_slabs = job.rows,
                               .rows = job.slab_rows,
                               .cols = job.slab_cols,
                               .format = job.quant,
                               .group = job.quant_group,
                               .seed = seed * 1000003 + j,
                               .scale = 1.0f / std::sqrt(static_cast<float>(job.slab_cols))},
                              nullptr);
      continue;
    }
    if (job.f32) {
      // Zeros (biases, sinks), or the job's constant (the gated norm's weight: 1).
      std::vector<float> values(static_cast<size_t>(job.rows * job.cols), job.fill_offset);
      if (std::find(skew_jobs.begin(), skew_jobs.end(), j) != skew_jobs.end()) {
        std::vector<int64_t> rank(values.size());
        std::iota(rank.begin(), rank.end(), 0);
        std::shuffle(rank.begin(), rank.end(), rng);
        for (size_t e = 0; e < values.size(); ++e) {
          values[e] = static_cast<float>(-zipf_exponent * std::log(static_cast<double>(rank[e] + 1)));
        }
      }
      CUDA_CHECK(cudaMemcpy(dst, values.data(), values.size() * 4, cudaMemcpyHostToDevice));
      continue;
    }
    if (job.home) {
      const int64_t count = job.rows * job.cols;
      const int64_t chunk = static_cast<int64_t>(kStagingBytes / sizeof(bf16));
      for (int64_t first = 0; first < count; first += chunk) {
        const int64_t n = std::min(chunk, count - first);
        cuda::random_fill({.out = staging.get(), .count = n, .seed = seed * 1000003 + j,
                           .scale = job.fill_scale, .offset = job.fill_offset,
                           .first_index = first},
                          nullptr);
        CUDA_CHECK(cudaMemcpy(static_cast<bf16*>(dst) + first, staging.get(),
                              static_cast<size_t>(n) * sizeof(bf16), cudaMemcpyDeviceToHost));
      }
      continue;
    }
    cuda::random_fill({.out = static_cast<bf16*>(dst),
                       .count = job.rows * job.cols,
                       .seed = seed * 1000003 + j,
                       .scale = job.fill_scale,
                       .offset = job.fill_offset},
                      nullptr);
    if (job.terms == 2) {  // a norm in two terms (norm_terms): its second term is zero
      MOE_CHECK(job.block_rows == job.rows, "a synthetic matrix of several two-term blocks");
      CUDA_CHECK(cudaMemset(static_cast<bf16*>(dst) + job.rows * job.cols, 0,
                            static_cast<size_t>(job.rows * job.cols) * sizeof(bf16)));
    }
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  return out;
}

}  // namespace moeinfer::gpu
