// Python binding of the KDA prefill kernels (the fused forward, its combine, the backward's kda_bwd_wy): tensors
// in (DLPack), checks, the kernel's Params, launch on the caller's current stream of q's device. Every check reads
// metadata only and runs before any CUDA call, so the errors are the same (and testable) on a machine without a GPU.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "common/dlpack_tensor.h"
#include "kda_sm90/kda_bwd.h"
#include "kda_sm90/kda_fwd.h"

namespace fla_cula {
namespace {

namespace py = pybind11;

// An optional gate parameter (A_log [HV], dt_bias [HV*128]): fp32 or bf16, `numel` elements, contiguous, on q's
// device. None leaves *data null.
void optional_gate_param(py::handle obj, char const* name, int64_t numel, char const* numel_what,
                         TensorArg const& q, void const** data, bool* fp32) {
  if (obj.is_none()) return;
  TensorArg t = tensor_arg(obj, name);
  expect_dtype(t, {dtype::kFloat32, dtype::kBFloat16});
  if (t.numel() != numel) {
    throw py::value_error(std::string(name) + ": expected " + numel_what + " = " + std::to_string(numel) +
                          " elements, got shape " + t.shape_str());
  }
  expect_contiguous(t);
  expect_same_device(t, q);
  *data = t.data;
  *fp32 = t.dtype == dtype::kFloat32;
}

constexpr int64_t kHeadDim = 128;
constexpr int64_t kChunk = 64;

std::string dims(std::initializer_list<int64_t> v) {
  std::string s = "(";
  int i = 0;
  for (int64_t x : v) s += (i++ ? ", " : "") + std::to_string(x);
  return s + (v.size() == 1 ? ",)" : ")");
}

// dtype, exact shape, contiguity, device (as `ref`), in that order.
void expect_tensor(TensorArg const& t, std::initializer_list<DLDataType> dtypes, std::initializer_list<int64_t> shape,
                   char const* what, TensorArg const* ref, int align = 0) {
  expect_dtype(t, dtypes);
  std::string w = std::string(what) + " = " + dims(shape);
  expect_shape(t, shape, w.c_str());
  expect_contiguous(t);
  if (align) expect_aligned(t, align);
  if (ref == nullptr) {
    expect_cuda(t);
  } else {
    expect_same_device(t, *ref);
  }
}

// q and k bf16 [B, T, H, 128] and x [B, T, HV, 128] of one of x_dtypes with HV a multiple of H, all contiguous,
// 16-byte aligned, q on a CUDA device and the rest on q's: {B, T, H, HV}.
struct HeadDims {
  int64_t B, T, H, HV;
};
HeadDims expect_qk_and_heads(TensorArg const& q, TensorArg const& k, TensorArg const& x,
                             std::initializer_list<DLDataType> x_dtypes) {
  expect_dtype(q, {dtype::kBFloat16});
  expect_ndim(q, 4);
  int64_t const B = q.size(0), T = q.size(1), H = q.size(2);
  if (q.size(3) != kHeadDim) {
    throw py::value_error("q: expected head dim 128, got shape " + q.shape_str());
  }
  expect_contiguous(q);
  expect_aligned(q, 16);
  expect_cuda(q);
  expect_tensor(k, {dtype::kBFloat16}, {B, T, H, kHeadDim}, "(B, T, H, 128) as q", &q, 16);
  expect_dtype(x, x_dtypes);
  expect_ndim(x, 4);
  int64_t const HV = x.size(2);
  if (x.size(0) != B || x.size(1) != T || x.size(3) != kHeadDim || HV < 1 || HV % H != 0) {
    throw py::value_error(std::string(x.name) + ": expected shape (B, T, HV, 128) = (" + std::to_string(B) + ", " +
                          std::to_string(T) + ", HV, 128) with HV a multiple of H = " + std::to_string(H) + ", got " +
                          x.shape_str());
  }
  expect_contiguous(x);
  expect_aligned(x, 16);
  expect_same_device(x, q);
  return {B, T, H, HV};
}

// chunk_list's varlen half: the two tensors checked, p's pointers and widths set; returns chunk_indices' rows
int64_t varlen_chunk_list(KdaBwdLaunch& p, py::handle cu_obj, py::handle ci_obj, TensorArg const& q,
                          HeadDims const& d) {
  if (d.B != 1) {
    throw py::value_error(std::string(q.name) + ": expected batch size 1 with cu_seqlens, got " + std::to_string(d.B));
  }
  TensorArg cu = tensor_arg(cu_obj, "cu_seqlens");
  expect_dtype(cu, {dtype::kInt32, dtype::kInt64});
  expect_ndim(cu, 1);
  if (cu.size(0) < 1) throw py::value_error("cu_seqlens: expected at least 1 entry (N+1 for N sequences), got 0");
  expect_contiguous(cu);
  expect_same_device(cu, q);
  TensorArg ci = tensor_arg(ci_obj, "chunk_indices");
  expect_dtype(ci, {dtype::kInt32, dtype::kInt64});
  expect_ndim(ci, 2);
  if (ci.size(1) != 2) throw py::value_error("chunk_indices: expected shape (chunks, 2), got " + ci.shape_str());
  expect_contiguous(ci);
  expect_same_device(ci, q);
  p.cu_seqlens = cu.data;
  p.cu_seqlens_int64 = cu.dtype == dtype::kInt64;
  p.chunk_indices = ci.data;
  p.chunk_indices_int64 = ci.dtype == dtype::kInt64;
  return ci.size(0);
}

// The backward's chunk list: cu_seqlens [N+1] and chunk_indices [chunks, 2] (FLA's prepare_chunk_indices), int32 or
// int64, both or neither, on q's device (q: the call's first tensor), batch size 1 with them; at most 2^31 - 1
// (chunk, value head) pairs. Sets p's chunk list (the chunks: B * ceil(T / 64) without them), device and stream.
int64_t chunk_list(KdaBwdLaunch& p, py::handle cu_obj, py::handle ci_obj, TensorArg const& q, HeadDims const& d,
                   char const* op) {
  bool const varlen = !cu_obj.is_none();
  if (varlen != !ci_obj.is_none()) throw py::value_error("cu_seqlens and chunk_indices: expected both or neither");
  int64_t chunks = d.B * ((d.T + kChunk - 1) / kChunk);
  if (varlen) chunks = varlen_chunk_list(p, cu_obj, ci_obj, q, d);
  if (chunks * d.HV >= (int64_t(1) << 31)) {
    throw py::value_error(std::string(op) + ": too many (chunk, value head) pairs");
  }
  p.chunks = static_cast<int>(chunks);
  p.device = q.device.device_id;
  p.stream = current_stream(q.device);
  return chunks;
}

void kda_fwd_api(py::handle q_obj, py::handle k_obj, py::handle v_obj, py::handle g_obj, py::handle beta_obj,
                 py::handle A_log_obj, py::handle dt_bias_obj, py::handle h0_obj, py::handle cu_obj, py::handle o_obj,
                 py::handle ht_obj, py::handle Aqk_obj, py::handle Akk_obj, double scale, double lower_bound,
                 bool use_qk_l2norm, bool use_beta_sigmoid, double beta_scale, bool state_v_first,
                 int block_v, py::handle phase_cycles_obj, bool wgmma, int pass, py::handle rec_obj,
                 int chunks_per_cta, int units, bool maps, py::handle seg_H_obj, py::handle seg_M_obj,
                 py::handle h_inter_obj, py::handle chunk_offsets_obj, bool state_rs, py::handle q_hat_obj,
                 py::handle k_hat_obj, py::handle q_rstd_obj, py::handle k_rstd_obj, int seg_lo, int seg_hi,
                 std::string const& gate, py::handle rec_ready_obj) {
  TensorArg q = tensor_arg(q_obj, "q"), k = tensor_arg(k_obj, "k"), v = tensor_arg(v_obj, "v");
  auto const [B, T, H, HV] = expect_qk_and_heads(q, k, v, {dtype::kBFloat16});
  TensorArg g = tensor_arg(g_obj, "g");
  expect_tensor(g, {dtype::kBFloat16}, {B, T, HV, kHeadDim}, "(B, T, HV, 128)", &q, 16);
  TensorArg beta = tensor_arg(beta_obj, "beta");
  expect_tensor(beta, {dtype::kBFloat16, dtype::kFloat32}, {B, T, HV}, "(B, T, HV)", &q);

  int64_t N = B;
  TensorArg cu;
  bool const varlen = !cu_obj.is_none();
  if (varlen) {
    cu = tensor_arg(cu_obj, "cu_seqlens");
    expect_dtype(cu, {dtype::kInt32, dtype::kInt64});
    expect_ndim(cu, 1);
    if (cu.size(0) < 1) throw py::value_error("cu_seqlens: expected at least 1 entry (N+1 for N sequences), got 0");
    expect_contiguous(cu);
    expect_same_device(cu, q);
    if (B != 1) throw py::value_error("q: expected batch size 1 with cu_seqlens, got " + std::to_string(B));
    N = cu.size(0) - 1;
  }
  std::initializer_list<int64_t> const state_shape = {N, HV, kHeadDim, kHeadDim};
  char const* state_what = state_v_first ? "(N, HV, V, K)" : "(N, HV, K, V)";

  KdaFwdParams p{};
  optional_gate_param(A_log_obj, "A_log", HV, "HV", q, &p.A_log, &p.A_log_fp32);
  optional_gate_param(dt_bias_obj, "dt_bias", HV * kHeadDim, "HV * 128", q, &p.dt_bias, &p.dt_bias_fp32);
  if (!h0_obj.is_none()) {
    TensorArg h0 = tensor_arg(h0_obj, "initial_state");
    expect_tensor(h0, {dtype::kFloat32}, state_shape, state_what, &q);
    p.h0 = h0.ptr<float>();
  }
  if (pass != kKdaFused && pass != kKdaPrep && pass != kKdaState && pass != kKdaRoles) {
    throw py::value_error("pass: expected 0 (fused), 1 (prep), 2 (state) or 3 (prep and pass 2 in one launch), got " +
                          std::to_string(pass));
  }
  bool const roles = pass == kKdaRoles;
  bool const two_kernel = pass != kKdaFused;
  if (!two_kernel && (!rec_obj.is_none() || maps || !seg_H_obj.is_none() || !seg_M_obj.is_none())) {
    throw py::value_error("rec, maps, seg_H, seg_M: expected none of them with pass 0 (the fused kernel)");
  }
  // o: every pass that writes outputs (the fused kernel, the state kernel's pass 2); the prep and maps passes take None
  bool const needs_o = pass == kKdaFused || pass == kKdaRoles || (pass == kKdaState && !maps);
  if (needs_o == o_obj.is_none()) {
    throw py::value_error(std::string("o: expected ") + (needs_o ? "a tensor" : "None") + " with pass " +
                          std::to_string(pass) + (maps ? " and maps" : ""));
  }
  if (needs_o) {
    TensorArg o = tensor_arg(o_obj, "o");
    expect_tensor(o, {dtype::kBFloat16}, {B, T, HV, kHeadDim}, "(B, T, HV, 128)", &q, 4);
    p.o = o.data;
  }
  if (!ht_obj.is_none() && (pass == kKdaPrep || maps)) {
    throw py::value_error("final_state: expected None with the prep pass or the maps pass");
  }
  if (!ht_obj.is_none()) {
    TensorArg ht = tensor_arg(ht_obj, "final_state");
    expect_tensor(ht, {dtype::kFloat32}, state_shape, state_what, &q, 8);  // 8-byte stores (K-major pairs)
    p.ht = ht.ptr<float>();
  }
  if (Aqk_obj.is_none() != Akk_obj.is_none()) {
    throw py::value_error("Aqk, Akk: expected both or neither (grad extras)");
  }
  if (!Aqk_obj.is_none() && pass == kKdaState) {
    throw py::value_error("Aqk, Akk: expected None with the state pass (the prep pass writes them)");
  }
  if (!Aqk_obj.is_none()) {
    TensorArg Aqk = tensor_arg(Aqk_obj, "Aqk");
    expect_tensor(Aqk, {dtype::kBFloat16}, {B, T, HV, kChunk}, "(B, T, HV, 64)", &q, 4);
    TensorArg Akk = tensor_arg(Akk_obj, "Akk");
    expect_tensor(Akk, {dtype::kBFloat16}, {B, T, HV, kChunk}, "(B, T, HV, 64)", &q, 4);
    p.Aqk = Aqk.data;
    p.Akk = Akk.data;
  }
  bool const qk_hat = !q_hat_obj.is_none();
  if (qk_hat != !k_hat_obj.is_none() || qk_hat != !q_rstd_obj.is_none() || qk_hat != !k_rstd_obj.is_none()) {
    throw py::value_error("q_hat, k_hat, q_rstd, k_rstd: expected all four or none (grad extras)");
  }
  if (qk_hat) {
    if (pass == kKdaState) throw py::value_error("q_hat: expected None with the state pass (the prep pass writes it)");
    if (!phase_cycles_obj.is_none()) {
      throw py::value_error("q_hat: expected None with phase_cycles (the instrumented kernels do not write it)");
    }
    if (!use_qk_l2norm) throw py::value_error("q_hat: expected None without use_qk_l2norm (it is the l2norm's output)");
    if (q.stride(1) != H * kHeadDim || q.stride(2) != kHeadDim) {
      throw py::value_error("q, k: expected contiguous rows [B, T, H, 128] with q_hat (it takes q's strides)");
    }
    TensorArg qh = tensor_arg(q_hat_obj, "q_hat"), kh = tensor_arg(k_hat_obj, "k_hat");
    expect_tensor(qh, {dtype::kBFloat16}, {B, T, H, kHeadDim}, "(B, T, H, 128)", &q, 4);
    expect_tensor(kh, {dtype::kBFloat16}, {B, T, H, kHeadDim}, "(B, T, H, 128)", &q, 4);
    TensorArg qr = tensor_arg(q_rstd_obj, "q_rstd"), kr = tensor_arg(k_rstd_obj, "k_rstd");
    expect_tensor(qr, {dtype::kFloat32}, {B, T, H}, "(B, T, H)", &q);
    expect_tensor(kr, {dtype::kFloat32}, {B, T, H}, "(B, T, H)", &q);
    p.q_hat = qh.data;
    p.k_hat = kh.data;
    p.q_rstd = qr.ptr<float>();
    p.k_rstd = kr.ptr<float>();
  }
  if (block_v != 64 && block_v != 128) {
    throw py::value_error("block_v: expected 64 or 128, got " + std::to_string(block_v));
  }
  p.block_v = block_v;
  p.wgmma = wgmma;
  if (two_kernel) {
    if (!wgmma) {
      throw py::value_error("wgmma: expected True with pass " + std::to_string(pass) + " (wgmma tile records)");
    }
    if (units < 1) throw py::value_error("units: expected >= 1, got " + std::to_string(units));
    if (roles && chunks_per_cta < 1) {
      throw py::value_error("chunks_per_cta: expected >= 1 (the prep's chunks per CTA) with pass 3, got " +
                            std::to_string(chunks_per_cta));
    }
    if (chunks_per_cta < 0 || (chunks_per_cta == 0 && units != 1)) {
      throw py::value_error("chunks_per_cta: expected > 0, or 0 (whole sequences) with units = 1, got " +
                            std::to_string(chunks_per_cta) + " with units = " + std::to_string(units));
    }
    TensorArg rec = tensor_arg(rec_obj, "rec");
    expect_dtype(rec, {dtype::kUInt8});
    expect_ndim(rec, 3);
    int64_t const min_slots = B * T / kChunk + N;
    if (rec.size(0) != HV || rec.size(1) < min_slots || rec.size(2) != kKdaRecBytes) {
      throw py::value_error("rec: expected shape (HV, >= B * T / 64 + N, " + std::to_string(kKdaRecBytes) + ") = (" +
                            std::to_string(HV) + ", >= " + std::to_string(min_slots) + ", " +
                            std::to_string(kKdaRecBytes) + "), got " + rec.shape_str());
    }
    expect_contiguous(rec);
    expect_same_device(rec, q);
    p.rec = rec.data;
    p.rec_slots = rec.size(1);
    // segment states: maps writes seg_H [P-1] and seg_M [P-2] (units = 2 P - 3); pass 2 of a split (units = P > 1)
    // reads seg_H [P-1]
    int64_t P = 1;
    if (pass == kKdaState && maps) {
      if (units % 2 == 0) {
        throw py::value_error("units: expected 2 P - 3 (odd) with maps, got " + std::to_string(units));
      }
      P = (units + 3) / 2;
    } else if (pass == kKdaState) {
      P = units;
    } else if (maps) {
      throw py::value_error("maps: expected False with the prep pass");
    }
    if (pass == kKdaState && P > 1 && chunks_per_cta == 0) {
      throw py::value_error("chunks_per_cta: expected > 0 for a split state pass, got 0");
    }
    // the launch's segments: pass 2 runs [seg_lo, seg_hi) of the P (seg_hi 0: P); [1, P) after the combine, or
    // [0, 1) beside a maps pass with seg_lo = 1, segment 0's end state then also to seg_H[0]
    if (seg_hi == 0) seg_hi = static_cast<int>(P);
    std::string const range = "[" + std::to_string(seg_lo) + ", " + std::to_string(seg_hi) + ")";
    if (pass != kKdaState && (seg_lo != 0 || seg_hi != P)) {
      throw py::value_error("seg_lo, seg_hi: expected the defaults with the prep pass, got " + range);
    }
    if (maps && ((seg_lo != 0 && (seg_lo != 1 || P < 3)) || seg_hi != P)) {
      throw py::value_error("seg_lo, seg_hi: expected seg_lo 0, or 1 with P >= 3, and seg_hi P = " +
                            std::to_string(P) + " with maps, got " + range);
    }
    bool const whole = seg_lo == 0 && seg_hi == P;
    if (pass == kKdaState && !maps && !whole && !(seg_lo >= 1 && seg_lo < P && seg_hi == P) &&
        !(seg_lo == 0 && seg_hi == 1 && P > 1)) {
      throw py::value_error("seg_lo, seg_hi: expected [0, P), [s, P) with 1 <= s < P, or [0, 1) with P > 1 (P = " +
                            std::to_string(P) + "), got " + range);
    }
    if ((seg_lo != 0 || !whole) && !state_rs) {
      throw py::value_error("seg_lo, seg_hi: expected the defaults without state_rs, got " + range);
    }
    p.segments = static_cast<int>(P);
    p.seg_lo = seg_lo;
    p.seg_H_out = pass == kKdaState && !maps && seg_hi < P;
    if (pass == kKdaState) units = maps ? units - seg_lo : seg_hi - seg_lo;  // the launch's CTAs per pair
    // a segment-state buffer of `slots` segments: None (or an empty tensor) when there are none
    auto seg_state = [&](py::handle obj, char const* name, int64_t slots) -> float* {
      if (slots == 0) {
        if (!obj.is_none() && tensor_arg(obj, name).numel() != 0) {
          throw py::value_error(std::string(name) + ": expected None (no segment states here)");
        }
        return nullptr;
      }
      if (obj.is_none()) {
        throw py::value_error(std::string(name) + ": expected a tensor of " + std::to_string(slots) + " segments");
      }
      TensorArg t = tensor_arg(obj, name);
      std::string const what = "(" + std::to_string(slots) + " segments, N, HV, 128, 128)";
      expect_tensor(t, {dtype::kFloat32}, {slots, N, HV, kHeadDim, kHeadDim}, what.c_str(), &q, 16);
      return t.ptr<float>();
    };
    p.seg_H = seg_state(seg_H_obj, "seg_H", pass == kKdaState ? P - 1 : 0);
    p.seg_M = seg_state(seg_M_obj, "seg_M", pass == kKdaState && maps ? P - 2 : 0);
    if (maps && block_v != 128) {
      throw py::value_error("block_v: expected 128 with maps (a map is 128 x 128), got " + std::to_string(block_v));
    }
    if (roles && block_v != 64) {
      throw py::value_error("block_v: expected 64 with pass 3 (pass 2 at 64 columns per CTA), got " +
                            std::to_string(block_v));
    }
    // record-ready flags: pass 3 only, int32 (HV, rec's slots), zero (the caller's torch.zeros)
    if (roles == rec_ready_obj.is_none()) {
      throw py::value_error(std::string("rec_ready: expected ") + (roles ? "an int32 tensor (HV, rec slots)" : "None") +
                            " with pass " + std::to_string(pass));
    }
    if (roles) {
      TensorArg rr = tensor_arg(rec_ready_obj, "rec_ready");
      expect_tensor(rr, {dtype::kInt32}, {HV, rec.size(1)}, "(HV, rec slots)", &q, 4);
      p.rec_ready = rr.ptr<int>();
    }
  } else if (!rec_ready_obj.is_none()) {
    throw py::value_error("rec_ready: expected None with pass 0 (the fused kernel)");
  }
  // return_intermediate_states: the chunk-start states, written by the passes that write o
  if (!h_inter_obj.is_none()) {
    if (!needs_o || roles) {
      throw py::value_error("h_inter: expected None with pass " + std::to_string(pass) + (maps ? " and maps" : ""));
    }
    TensorArg hi = tensor_arg(h_inter_obj, "h_inter");
    expect_dtype(hi, {dtype::kBFloat16});
    expect_ndim(hi, 5);
    int64_t const NT = hi.size(1);
    if (!varlen && NT != (T + kChunk - 1) / kChunk) {
      throw py::value_error("h_inter: expected NT = ceil(T / 64) = " + std::to_string((T + kChunk - 1) / kChunk) +
                            " chunks, got shape " + hi.shape_str());
    }
    std::string const what = std::string("(B, NT, HV, 128, 128)") + (state_v_first ? " V-first" : "");
    expect_tensor(hi, {dtype::kBFloat16}, {B, NT, HV, kHeadDim, kHeadDim}, what.c_str(), &q);
    if (NT > INT32_MAX) throw py::value_error("h_inter: too many chunks, got shape " + hi.shape_str());
    p.h_inter = hi.data;
    p.NT = static_cast<int>(NT);
    if (varlen) {
      if (chunk_offsets_obj.is_none()) throw py::value_error("chunk_offsets: expected a tensor with varlen h_inter");
      TensorArg co = tensor_arg(chunk_offsets_obj, "chunk_offsets");
      expect_tensor(co, {dtype::kInt32, dtype::kInt64}, {N + 1}, "(N + 1,)", &q);
      p.chunk_offsets = co.data;
      p.chunk_offsets_int64 = co.dtype == dtype::kInt64;
    }
  }
  if (!chunk_offsets_obj.is_none() && p.chunk_offsets == nullptr) {
    throw py::value_error("chunk_offsets: expected None without varlen h_inter");
  }
  if (state_rs && (pass != kKdaState || p.h_inter != nullptr || !phase_cycles_obj.is_none())) {
    throw py::value_error(std::string("state_rs: expected a state pass (pass_kind 2) without h_inter or phase_cycles, "
                                      "got pass_kind ") + std::to_string(pass) +
                          (p.h_inter != nullptr ? " with h_inter" : "") +
                          (phase_cycles_obj.is_none() ? "" : " with phase_cycles"));
  }
  p.state_rs = state_rs;
  p.pass = pass;
  p.chunks_per_cta = chunks_per_cta;
  p.units = units;
  p.maps = maps;
  if (!phase_cycles_obj.is_none() && roles) throw py::value_error("phase_cycles: expected None with pass 3");
  if (!phase_cycles_obj.is_none()) {
    TensorArg pc = tensor_arg(phase_cycles_obj, "phase_cycles");
    // one row per CTA: fused N * HV * 128 / block_v, prep N * HV * units, state N * HV * 128 / block_v * units
    int64_t const rows = pass == kKdaPrep ? int64_t(N) * HV * units
                                          : int64_t(N) * HV * (kHeadDim / block_v) * (pass == kKdaState ? units : 1);
    expect_tensor(pc, {dtype::kInt64}, {rows, kKdaFwdPhases}, "(CTAs of the pass, phases)", &q);
    p.phase_cycles = pc.ptr<long long>();
  }
  int const gate_form = gate == "sigmoid_lb" ? 0 : gate == "softplus" ? 1 : gate == "precomputed" ? 2 : -1;
  if (gate_form < 0) {
    throw py::value_error("gate: expected 'sigmoid_lb', 'softplus' or 'precomputed', got '" + gate + "'");
  }
  if (gate_form != 0 && ((pass != kKdaPrep && pass != kKdaRoles) || !phase_cycles_obj.is_none())) {
    throw py::value_error("gate '" + gate + "': expected pass_kind 1 or 3 (the prep pass) without phase_cycles, got " +
                          "pass_kind " + std::to_string(pass));
  }
  if (gate_form == 0 && !(lower_bound >= -5.0 && lower_bound < 0.0)) {
    throw py::value_error("lower_bound: expected -5 <= lower_bound < 0, got " + std::to_string(lower_bound));
  }
  if (beta_scale != 1.0 && beta_scale != 2.0) {
    throw py::value_error("beta_scale: expected 1 or 2, got " + std::to_string(beta_scale));
  }
  if (B * T > INT32_MAX || N > INT32_MAX || H > INT32_MAX || HV > INT32_MAX) {
    throw py::value_error("q: sizes beyond 2^31 tokens or heads are not supported, got shape " + q.shape_str());
  }

  p.q = q.data;
  p.k = k.data;
  p.qk_tok_stride = q.stride(1);
  p.qk_head_stride = q.stride(2);
  p.v = v.data;
  p.v_tok_stride = v.stride(1);
  p.v_head_stride = v.stride(2);
  p.g = g.data;
  p.g_tok_stride = g.stride(1);
  p.g_head_stride = g.stride(2);
  p.beta = beta.data;
  p.beta_fp32 = beta.dtype == dtype::kFloat32;
  p.beta_tok_stride = HV;
  p.state_v_first = state_v_first;
  p.o_tok_stride = HV * kHeadDim;
  p.o_head_stride = kHeadDim;
  p.extras_tok_stride = HV * kChunk;
  p.B = static_cast<int>(B);
  p.T = static_cast<int>(T);
  p.N = static_cast<int>(N);
  p.H = static_cast<int>(H);
  p.HV = static_cast<int>(HV);
  p.scale = static_cast<float>(scale);
  p.lower_bound = static_cast<float>(lower_bound);
  p.gate = gate_form;
  p.beta_scale = static_cast<float>(beta_scale);
  p.use_qk_l2norm = use_qk_l2norm;
  p.use_beta_sigmoid = use_beta_sigmoid;
  p.cu_seqlens = varlen ? cu.data : nullptr;
  p.cu_seqlens_int64 = varlen && cu.dtype == dtype::kInt64;
  p.device = q.device.device_id;
  p.stream = current_stream(q.device);
  py::gil_scoped_release release;
  run_kda_fwd(p);
}

void kda_combine_api(py::handle seg_H_obj, py::handle seg_M_obj) {
  TensorArg H = tensor_arg(seg_H_obj, "seg_H");
  expect_dtype(H, {dtype::kFloat32});
  expect_ndim(H, 5);
  if (H.size(3) != kHeadDim || H.size(4) != kHeadDim) {
    throw py::value_error("seg_H: expected shape (P - 1, N, HV, 128, 128), got " + H.shape_str());
  }
  expect_contiguous(H);
  expect_aligned(H, 16);  // 16-byte copies and accesses
  expect_cuda(H);
  int64_t const slots = H.size(0), N = H.size(1), HV = H.size(2);
  TensorArg M = tensor_arg(seg_M_obj, "seg_M");
  std::string const what = "(P - 2, N, HV, 128, 128) = (" + std::to_string(slots > 0 ? slots - 1 : 0) + ", " +
                           std::to_string(N) + ", " + std::to_string(HV) + ", 128, 128)";
  expect_tensor(M, {dtype::kFloat32}, {slots > 0 ? slots - 1 : 0, N, HV, kHeadDim, kHeadDim}, what.c_str(), &H, 16);
  if (slots > INT32_MAX) throw py::value_error("seg_H: too many segments, got shape " + H.shape_str());
  KdaCombineParams p{};
  p.seg_H = H.ptr<float>();
  p.seg_M = M.ptr<float>();
  p.slots = static_cast<int>(slots);
  p.pairs = N * HV;
  p.device = H.device.device_id;
  p.stream = current_stream(H.device);
  py::gil_scoped_release release;
  run_kda_combine(p);
}


void kda_bwd_wy_api(py::handle q_obj, py::handle k_obj, py::handle v_obj, py::handle v_new_obj, py::handle g_obj,
                    py::handle beta_obj, py::handle A_obj, py::handle h_obj, py::handle do_obj, py::handle dh_obj,
                    py::handle dv_obj, py::handle dq_obj, py::handle dk_obj, py::handle dv2_obj, py::handle dg_obj,
                    py::handle db_obj, py::handle dA_obj, double scale, bool state_v_first, py::handle cu_obj,
                    py::handle chunk_indices_obj, bool intra, py::handle gate_shift_obj, py::handle q_rstd_obj,
                    py::handle k_rstd_obj, py::handle dqx_obj, py::handle dkx_obj) {
  TensorArg q = tensor_arg(q_obj, "q"), k = tensor_arg(k_obj, "k"), v = tensor_arg(v_obj, "v");
  HeadDims const d = expect_qk_and_heads(q, k, v, {dtype::kBFloat16});
  auto const [B, T, H, HV] = d;
  auto value_rows = [&, B = B, T = T, HV = HV](py::handle obj, char const* name, DLDataType dt) {  // [B, T, HV, 128]
    TensorArg x = tensor_arg(obj, name);
    expect_tensor(x, {dt}, {B, T, HV, kHeadDim}, "(B, T, HV, 128) as v", &q, 16);
    return x;
  };
  TensorArg const v_new = value_rows(v_new_obj, "v_new", dtype::kBFloat16);
  TensorArg const dout = value_rows(do_obj, "do", dtype::kBFloat16), dv = value_rows(dv_obj, "dv", dtype::kBFloat16);
  TensorArg const g = value_rows(g_obj, "g", dtype::kFloat32);
  TensorArg beta = tensor_arg(beta_obj, "beta");
  expect_tensor(beta, {dtype::kFloat32}, {B, T, HV}, "(B, T, HV)", &q);
  TensorArg A = tensor_arg(A_obj, "A");
  expect_tensor(A, {dtype::kBFloat16}, {B, T, HV, kChunk}, "(B, T, HV, 64)", &q, 16);

  KdaBwdWyParams p{};
  int64_t const chunks = chunk_list(p, cu_obj, chunk_indices_obj, q, d, "kda_bwd_wy");
  std::string const hw = "(B, NT, HV, 128, 128) with B * NT = chunks = " + std::to_string(chunks) + ", HV = " +
                         std::to_string(HV);
  TensorArg h = tensor_arg(h_obj, "h");
  TensorArg dh = tensor_arg(dh_obj, "dh");
  for (TensorArg* x : {&h, &dh}) {
    expect_dtype(*x, {dtype::kBFloat16});
    if (x->ndim != 5 || x->size(0) * x->size(1) != chunks || x->size(2) != HV || x->size(3) != kHeadDim ||
        x->size(4) != kHeadDim) {
      throw py::value_error(std::string(x == &h ? "h" : "dh") + ": expected shape " + hw + ", got " +
                            x->shape_str());
    }
    expect_contiguous(*x);
    expect_aligned(*x, 16);
    expect_same_device(*x, q);
  }
  TensorArg const dq = value_rows(dq_obj, "dq", dtype::kFloat32), dk = value_rows(dk_obj, "dk", dtype::kFloat32);
  TensorArg const dv2 = value_rows(dv2_obj, "dv2", dtype::kBFloat16), dg = value_rows(dg_obj, "dg", dtype::kFloat32);
  TensorArg db = tensor_arg(db_obj, "db");
  expect_tensor(db, {dtype::kFloat32}, {B, T, HV}, "(B, T, HV)", &q);
  if (intra) {  // the intra step in the same kernel (dAqk made there), no dA out
    if (!dA_obj.is_none()) throw py::value_error("kda_bwd_wy: dA must be None with intra=True (not written)");
    // None: no per-token bound (the intra step's unbounded form), passed on as 0
    double const gate_shift = gate_shift_obj.is_none() ? 0.0 : gate_shift_obj.cast<double>();
    if (!gate_shift_obj.is_none() && !(gate_shift > 0.0 && gate_shift <= 16.6)) {
      throw py::value_error("kda_bwd_wy: with intra=True, gate_shift must be in (0, 16.6] (safe_gate with -11.5 <= "
                            "lower_bound < 0) or None, got " + std::to_string(gate_shift));
    }
    p.intra = true;
    p.gate_shift = static_cast<float>(gate_shift);
  } else {
    TensorArg dA = tensor_arg(dA_obj, "dA");
    expect_tensor(dA, {dtype::kFloat32}, {B, T, HV, kChunk}, "(B, T, HV, 64)", &q, 16);
    p.dA = dA.ptr<float>();
  }
  int const given = int(!q_rstd_obj.is_none()) + int(!k_rstd_obj.is_none()) + int(!dqx_obj.is_none()) +
                    int(!dkx_obj.is_none());
  if (given != 0) {  // the l2norm backward fused too
    if (given != 4) throw py::value_error("kda_bwd_wy: q_rstd, k_rstd, dqx, dkx: all four or none");
    if (!intra) throw py::value_error("kda_bwd_wy: the fused l2norm backward needs intra=True (the intra step fused)");
    if (H != HV) {
      throw py::value_error("kda_bwd_wy: the fused l2norm backward needs H == HV, got H=" + std::to_string(H) +
                            ", HV=" + std::to_string(HV));
    }
    TensorArg q_rstd = tensor_arg(q_rstd_obj, "q_rstd"), k_rstd = tensor_arg(k_rstd_obj, "k_rstd");
    expect_tensor(q_rstd, {dtype::kFloat32}, {B, T, H}, "(B, T, H)", &q);
    expect_tensor(k_rstd, {dtype::kFloat32}, {B, T, H}, "(B, T, H)", &q);
    TensorArg dqx = tensor_arg(dqx_obj, "dqx"), dkx = tensor_arg(dkx_obj, "dkx");
    expect_tensor(dqx, {dtype::kBFloat16}, {B, T, H, kHeadDim}, "(B, T, H, 128) as q", &q, 16);
    expect_tensor(dkx, {dtype::kBFloat16}, {B, T, H, kHeadDim}, "(B, T, H, 128) as q", &q, 16);
    p.q_rstd = q_rstd.ptr<float>();
    p.k_rstd = k_rstd.ptr<float>();
    p.dqx = dqx.data;
    p.dkx = dkx.data;
  }

  p.q = q.data; p.k = k.data; p.v = v.data; p.v_new = v_new.data; p.dout = dout.data; p.dv = dv.data;
  p.g = g.ptr<float>(); p.beta = beta.ptr<float>(); p.A = A.data; p.h = h.data; p.dh = dh.data;
  p.dq = dq.ptr<float>(); p.dk = dk.ptr<float>(); p.dv2 = dv2.data; p.dg = dg.ptr<float>();
  p.db = db.ptr<float>();
  p.B = static_cast<int>(B);
  p.T = static_cast<int>(T);
  p.H = static_cast<int>(H);
  p.HV = static_cast<int>(HV);
  p.scale = static_cast<float>(scale);
  p.state_v_first = state_v_first;
  py::gil_scoped_release release;
  run_kda_bwd_wy(p);
}

void kda_bwd_dv_api(py::handle Aqk_obj, py::handle do_obj, py::handle dv_obj, py::handle cu_obj,
                    py::handle chunk_indices_obj) {
  TensorArg dout = tensor_arg(do_obj, "do");
  expect_dtype(dout, {dtype::kBFloat16});
  expect_ndim(dout, 4);
  if (dout.size(3) != kHeadDim) throw py::value_error("do: expected shape (B, T, HV, 128), got " + dout.shape_str());
  expect_contiguous(dout);
  expect_aligned(dout, 16);
  expect_cuda(dout);
  int64_t const B = dout.size(0), T = dout.size(1), HV = dout.size(2);
  TensorArg Aqk = tensor_arg(Aqk_obj, "Aqk"), dv = tensor_arg(dv_obj, "dv");
  expect_tensor(Aqk, {dtype::kBFloat16}, {B, T, HV, kChunk}, "(B, T, HV, 64) as do", &dout, 16);
  expect_tensor(dv, {dtype::kBFloat16}, {B, T, HV, kHeadDim}, "(B, T, HV, 128) as do", &dout, 16);
  KdaBwdDvParams p{};
  chunk_list(p, cu_obj, chunk_indices_obj, dout, {B, T, HV, HV}, "kda_bwd_dv");
  p.Aqk = Aqk.data;
  p.dout = dout.data;
  p.dv = dv.data;
  p.B = static_cast<int>(B);
  p.T = static_cast<int>(T);
  p.HV = static_cast<int>(HV);
  py::gil_scoped_release release;
  run_kda_bwd_dv(p);
}

void kda_bwd_intra_api(py::handle q_obj, py::handle k_obj, py::handle g_obj, py::handle beta_obj, py::handle dAqk_obj,
                       py::handle dAkk_obj, py::handle dq_obj, py::handle dk_obj, py::handle dg_obj,
                       py::handle db_obj, py::handle dq_out_obj, py::handle dk_out_obj, py::handle dg_out_obj,
                       py::handle db_out_obj, py::handle gate_shift_obj, py::handle cu_obj,
                       py::handle chunk_indices_obj) {
  TensorArg q = tensor_arg(q_obj, "q"), k = tensor_arg(k_obj, "k"), g = tensor_arg(g_obj, "g");
  HeadDims const d = expect_qk_and_heads(q, k, g, {dtype::kFloat32});
  auto const [B, T, H, HV] = d;
  auto expect_f32 = [&](py::handle obj, char const* name, std::initializer_list<int64_t> shape, char const* what,
                        int align = 0) {
    TensorArg x = tensor_arg(obj, name);
    expect_tensor(x, {dtype::kFloat32}, shape, what, &q, align);
    return x;
  };
  std::initializer_list<int64_t> const vs = {B, T, HV, kHeadDim}, bs = {B, T, HV}, as = {B, T, HV, kChunk};
  TensorArg const beta = expect_f32(beta_obj, "beta", bs, "(B, T, HV)");
  TensorArg const dAqk = expect_f32(dAqk_obj, "dAqk", as, "(B, T, HV, 64)", 16);  // cp.async rows
  TensorArg const dAkk = expect_f32(dAkk_obj, "dAkk", as, "(B, T, HV, 64)", 16);
  TensorArg const dq = expect_f32(dq_obj, "dq", vs, "(B, T, HV, 128) as g");
  TensorArg const dk = expect_f32(dk_obj, "dk", vs, "(B, T, HV, 128) as g");
  TensorArg const dg = expect_f32(dg_obj, "dg", vs, "(B, T, HV, 128) as g");
  TensorArg const dq_out = expect_f32(dq_out_obj, "dq_out", vs, "(B, T, HV, 128) as g");
  TensorArg const dk_out = expect_f32(dk_out_obj, "dk_out", vs, "(B, T, HV, 128) as g");
  TensorArg const dg_out = expect_f32(dg_out_obj, "dg_out", vs, "(B, T, HV, 128) as g");
  TensorArg const db = expect_f32(db_obj, "db", bs, "(B, T, HV)");
  TensorArg const db_out = expect_f32(db_out_obj, "db_out", bs, "(B, T, HV)");
  // None: no per-token bound (softplus or precomputed gates), passed on as 0
  double const gate_shift = gate_shift_obj.is_none() ? 0.0 : gate_shift_obj.cast<double>();
  if (!gate_shift_obj.is_none() && !(gate_shift > 0.0)) {
    throw py::value_error("gate_shift: expected > 0 (-lower_bound / ln 2 under safe_gate) or None, got " +
                          std::to_string(gate_shift));
  }
  KdaBwdIntraParams p{};
  chunk_list(p, cu_obj, chunk_indices_obj, q, d, "kda_bwd_intra");
  p.q = q.data; p.k = k.data; p.g = g.ptr<float>(); p.beta = beta.ptr<float>();
  p.dAqk = dAqk.ptr<float>(); p.dAkk = dAkk.ptr<float>();
  p.dq = dq.ptr<float>(); p.dk = dk.ptr<float>(); p.dg = dg.ptr<float>(); p.db = db.ptr<float>();
  p.dq_out = dq_out.ptr<float>(); p.dk_out = dk_out.ptr<float>(); p.dg_out = dg_out.ptr<float>();
  p.db_out = db_out.ptr<float>();
  p.B = static_cast<int>(B);
  p.T = static_cast<int>(T);
  p.H = static_cast<int>(H);
  p.HV = static_cast<int>(HV);
  p.gate_shift = static_cast<float>(gate_shift);
  py::gil_scoped_release release;
  run_kda_bwd_intra(p);
}
void kda_bwd_gate_api(py::handle dg_obj, py::handle g_raw_obj, py::handle A_log_obj, py::handle dt_bias_obj,
                      py::handle lower_bound_obj, py::handle dg_raw_obj, py::handle dA_part_obj,
                      py::handle dbias_part_obj, py::handle cu_obj, py::handle chunk_indices_obj) {
  TensorArg dg = tensor_arg(dg_obj, "dg");
  expect_dtype(dg, {dtype::kFloat32});
  expect_ndim(dg, 4);
  if (dg.size(3) != kHeadDim) throw py::value_error("dg: expected shape (B, T, HV, 128), got " + dg.shape_str());
  expect_contiguous(dg);
  expect_cuda(dg);
  int64_t const B = dg.size(0), T = dg.size(1), HV = dg.size(2);
  std::initializer_list<int64_t> const vs = {B, T, HV, kHeadDim};
  TensorArg g_raw = tensor_arg(g_raw_obj, "g_raw"), dg_raw = tensor_arg(dg_raw_obj, "dg_raw");
  expect_tensor(g_raw, {dtype::kBFloat16, dtype::kFloat32}, vs, "(B, T, HV, 128) as dg", &dg);
  expect_tensor(dg_raw, {g_raw.dtype}, vs, "(B, T, HV, 128) as dg, g_raw's dtype", &dg);
  bool const softplus = lower_bound_obj.is_none();  // None: the softplus form
  double const lower_bound = softplus ? 0.0 : lower_bound_obj.cast<double>();
  if (!softplus && !(lower_bound < 0.0)) {
    throw py::value_error("lower_bound: expected < 0 or None (the softplus form), got " + std::to_string(lower_bound));
  }
  if (softplus && A_log_obj.is_none()) {
    throw py::value_error("A_log: expected a tensor in the softplus form (lower_bound None), got None");
  }
  KdaBwdGateParams p{};
  int64_t const chunks = chunk_list(p, cu_obj, chunk_indices_obj, dg, {B, T, HV, HV}, "kda_bwd_gate");
  bool a_fp32 = true, b_fp32 = true;
  void const* a = nullptr;
  void const* b = nullptr;
  optional_gate_param(A_log_obj, "A_log", HV, "HV", dg, &a, &a_fp32);
  optional_gate_param(dt_bias_obj, "dt_bias", HV * kHeadDim, "HV * 128", dg, &b, &b_fp32);
  // a partial-sum output: fp32 of its shape when its gate parameter is given, else None
  auto partial = [&](py::handle obj, char const* name, bool given, std::initializer_list<int64_t> shape,
                     char const* what) -> float* {
    if (!given) {
      if (!obj.is_none()) throw py::value_error(std::string(name) + ": expected None without its gate parameter");
      return nullptr;
    }
    TensorArg x = tensor_arg(obj, name);
    expect_tensor(x, {dtype::kFloat32}, shape, what, &dg);
    return x.ptr<float>();
  };
  p.dA_part = partial(dA_part_obj, "dA_part", a != nullptr, {chunks, HV}, "(chunks, HV)");
  p.dbias_part = partial(dbias_part_obj, "dbias_part", b != nullptr, {chunks, HV * kHeadDim}, "(chunks, HV * 128)");
  p.dg = dg.ptr<float>();
  p.g_raw = g_raw.data;
  p.g_raw_fp32 = g_raw.dtype == dtype::kFloat32;
  p.A_log = a;
  p.dt_bias = b;
  p.A_log_fp32 = a_fp32;
  p.dt_bias_fp32 = b_fp32;
  p.softplus = softplus;
  p.lower_bound = static_cast<float>(lower_bound);
  p.dg_raw = dg_raw.data;
  p.B = static_cast<int>(B);
  p.T = static_cast<int>(T);
  p.HV = static_cast<int>(HV);
  py::gil_scoped_release release;
  run_kda_bwd_gate(p);
}
}  // namespace

void register_kda_fwd(py::module_& m) {
  m.def("kda_bwd_gate", &kda_bwd_gate_api, py::arg("dg"), py::arg("g_raw"), py::arg("A_log"), py::arg("dt_bias"),
        py::arg("lower_bound"), py::arg("dg_raw"), py::arg("dA_part"), py::arg("dbias_part"),
        py::arg("cu_seqlens") = py::none(), py::arg("chunk_indices") = py::none(),
        "Enqueue kda_bwd_gate (csrc/kda_sm90/kda_bwd.h) on the current stream of dg's device: FLA 0.6.0's\n"
        "chunk_local_cumsum(dg, reverse) and kda_gate_bwd in one pass. fp32 dg [B,T,HV,128] (the gradient w.r.t.\n"
        "the chunk-local cumsum of the gate), g_raw [B,T,HV,128] bf16 or fp32 (the gate's input), A_log [HV] /\n"
        "dt_bias [HV*128] (fp32 or bf16) or None, lower_bound < 0 (the gate lower_bound sigmoid(.)) or None (the\n"
        "softplus gate -exp(A_log) softplus(.), A_log required). Writes dg_raw (g_raw's shape and\n"
        "dtype) and, with A_log / dt_bias, fp32 dA_part [chunks, HV] / dbias_part [chunks, HV*128] (else None):\n"
        "per-chunk partial sums whose sums over the chunks are dA_log's and dt_bias's gradients. Varlen as\n"
        "kda_bwd_wy. All contiguous.\n"
        "TypeError / ValueError before any CUDA call, RuntimeError for CUDA errors.");
  m.def("kda_bwd_dv", &kda_bwd_dv_api, py::arg("Aqk"), py::arg("do"), py::arg("dv"),
        py::arg("cu_seqlens") = py::none(), py::arg("chunk_indices") = py::none(),
        "Enqueue kda_bwd_dv (csrc/kda_sm90/kda_bwd.h) on the current stream of do's device: the dv half of FLA\n"
        "0.6.0's chunk_kda_bwd_dAv, dv = M(Aqk)^T do per chunk (M: on and below the diagonal, rows of the sequence).\n"
        "bf16 Aqk [B,T,HV,64] (the forward's, entries above the diagonal not read), do [B,T,HV,128]; writes bf16 dv\n"
        "[B,T,HV,128] on the sequences' rows. Varlen as kda_bwd_wy. All contiguous. TypeError / ValueError before\n"
        "any CUDA call, RuntimeError for CUDA errors.");
  m.def("kda_bwd_intra", &kda_bwd_intra_api, py::arg("q"), py::arg("k"), py::arg("g"), py::arg("beta"),
        py::arg("dAqk"), py::arg("dAkk"), py::arg("dq"), py::arg("dk"), py::arg("dg"), py::arg("db"),
        py::arg("dq_out"), py::arg("dk_out"), py::arg("dg_out"), py::arg("db_out"), py::arg("gate_shift"),
        py::arg("cu_seqlens") = py::none(), py::arg("chunk_indices") = py::none(),
        "Enqueue kda_bwd_intra (csrc/kda_sm90/kda_bwd.h) on the current stream of q's device: FLA 0.6.0's\n"
        "chunk_kda_bwd_intra. bf16 q, k [B,T,H,128]; fp32 g [B,T,HV,128] (chunk-local cumsum, log2, per-token steps\n"
        ">= -gate_shift), beta [B,T,HV], dAqk, dAkk [B,T,HV,64], incoming dq, dk, dg [B,T,HV,128] and db [B,T,HV];\n"
        "writes dq_out, dk_out, dg_out, db_out (same shapes; may be the incoming tensors) on the sequences' rows.\n"
        "gate_shift = -lower_bound / ln 2 > 0 (safe_gate), or None where no per-token bound holds (softplus or\n"
        "precomputed gates: per-channel anchors, a block's channel past a span of 120 summed pairwise). Varlen as\n"
        "kda_bwd_wy. TypeError / ValueError before any CUDA call, RuntimeError for CUDA errors.");
  m.def("kda_bwd_wy", &kda_bwd_wy_api, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("v_new"), py::arg("g"),
        py::arg("beta"), py::arg("A"), py::arg("h"), py::arg("do"), py::arg("dh"), py::arg("dv"), py::arg("dq"),
        py::arg("dk"), py::arg("dv2"), py::arg("dg"), py::arg("db"), py::arg("dA"), py::arg("scale"),
        py::arg("state_v_first"), py::arg("cu_seqlens") = py::none(), py::arg("chunk_indices") = py::none(),
        py::arg("intra") = false, py::arg("gate_shift") = py::none(), py::arg("q_rstd") = py::none(),
        py::arg("k_rstd") = py::none(), py::arg("dqx") = py::none(), py::arg("dkx") = py::none(),
        "Enqueue kda_bwd_wy (csrc/kda_sm90/kda_bwd.h) on the current stream of q's device: FLA 0.6.0's\n"
        "chunk_kda_bwd_wy_dqkg_fused. bf16 q, k [B,T,H,128], v, v_new, do, dv [B,T,HV,128], A (Akk) [B,T,HV,64],\n"
        "h, dh [B, NT, HV, 128, 128] (V-first with state_v_first); fp32 g [B,T,HV,128], beta [B,T,HV]. Writes fp32\n"
        "dq, dk, dg [B,T,HV,128], db [B,T,HV], dA [B,T,HV,64] and bf16 dv2 [B,T,HV,128] on the sequences' rows.\n"
        "With intra=True: chunk_kda_bwd_intra fused in, its dAqk = scale M(do v_new^T) (chunk_kda_bwd_dAv's) made in\n"
        "the kernel; dq, dk, dg, db include its terms, dA must be None (not written); gate_shift = -lower_bound /\n"
        "ln 2 where a per-token bound holds (safe_gate), None where none does (kda_bwd_intra's unbounded form).\n"
        "With H == HV, fp32 q_rstd, k_rstd [B,T,H]\n"
        "and bf16 dqx, dkx [B,T,H,128] as well (q, k the l2-normalized ones): FLA's l2norm_bwd fused, dqx, dkx =\n"
        "rstd (dy - y (y . dy)) of the final dq, dk.\n"
        "Varlen: B = 1, cu_seqlens [N+1] and chunk_indices [chunks, 2] (FLA's prepare_chunk_indices), int32/int64.\n"
        "All contiguous. TypeError / ValueError before any CUDA call, RuntimeError for CUDA errors.");
  m.def("kda_combine", &kda_combine_api, py::arg("seg_H"), py::arg("seg_M"),
        "The exact sequence split's combine on the current stream of seg_H's device: fp32 seg_H [P-1, N, HV, 128,\n"
        "128] and seg_M [P-2, N, HV, 128, 128] (K-major, contiguous); in place, seg_H[s] += seg_M[s-1] @ seg_H[s-1]\n"
        "for s = 1 .. P-2 in order (fp32 FMA sums over the 128 inner terms in order). Does not synchronize.");
  m.def("kda_fwd", &kda_fwd_api, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"),
        py::arg("A_log"), py::arg("dt_bias"), py::arg("initial_state"), py::arg("cu_seqlens"), py::arg("o"),
        py::arg("final_state"), py::arg("Aqk"), py::arg("Akk"), py::arg("scale"), py::arg("lower_bound"),
        py::arg("use_qk_l2norm"), py::arg("use_beta_sigmoid"), py::arg("beta_scale"), py::arg("state_v_first"),
        py::arg("block_v") = 64, py::arg("phase_cycles") = py::none(), py::arg("wgmma") = false,
        py::arg("pass_kind") = 0, py::arg("rec") = py::none(), py::arg("chunks_per_cta") = 0, py::arg("units") = 1,
        py::arg("maps") = false, py::arg("seg_H") = py::none(), py::arg("seg_M") = py::none(),
        py::arg("h_inter") = py::none(), py::arg("chunk_offsets") = py::none(), py::arg("state_rs") = false,
        py::arg("q_hat") = py::none(), py::arg("k_hat") = py::none(), py::arg("q_rstd") = py::none(),
        py::arg("k_rstd") = py::none(), py::arg("seg_lo") = 0, py::arg("seg_hi") = 0, py::arg("gate") = "sigmoid_lb",
        py::arg("rec_ready") = py::none(),
        "Enqueue the fused KDA prefill forward v1 (csrc/kda_sm90/kda_fwd.h) on the current stream of q's device:\n"
        "bf16 q, k [B,T,H,128], v, raw gate g [B,T,HV,128], raw beta [B,T,HV] (bf16/fp32); gate\n"
        "a = lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) (A_log [HV], dt_bias [HV*128] or None);\n"
        "gate 'softplus' (a = -exp(A_log) * softplus(g + dt_bias)) or 'precomputed' (a = g): the prep pass only\n"
        "(pass_kind 1), lower_bound unused; 'sigmoid_lb' (default) as above.\n"
        "initial_state / final_state fp32 [N,HV,128,128] (V-first with state_v_first) or None; writes o\n"
        "(bf16 [B,T,HV,128]) and, when given, Aqk/Akk (bf16 [B,T,HV,64], FLA's layout). All contiguous.\n"
        "q_hat, k_hat (bf16 [B,T,H,128]) and q_rstd, k_rstd (fp32 [B,T,H]), all or none, with use_qk_l2norm and\n"
        "neither the state pass nor phase_cycles: FLA's l2norm_fwd outputs bf16(x rstd), rstd = 1 / sqrt(sum x^2 +\n"
        "1e-6) (grad extras).\n"
        "block_v (64 or 128): V columns per CTA (N*HV*128/block_v CTAs; 128 computes the K-side prep once per\n"
        "(sequence, value head), 64 twice but fills more SMs).\n"
        "wgmma: the state-side products (-W, V', O, the state update) on SM90 warpgroup MMA instead of\n"
        "mma.sync (same math; fp32 accumulation order inside the tensor core may differ).\n"
        "phase_cycles (int64 [CTAs of the pass, KDA_FWD_PHASES] or None): per CTA, clock64 cycles of each phase\n"
        "summed over its chunks (KDA_FWD_PHASE_NAMES).\n"
        "pass_kind 1 / 2: the two-kernel form (wgmma only). 1 (prep): chunks_per_cta chunks per CTA, units CTAs per\n"
        "(sequence, value head), writes rec (uint8 [HV, >= B*T/64 + N, KDA_REC_BYTES]) and Aqk/Akk when given; o and\n"
        "final_state None. 2 (state): reads rec; units = P segments of chunks_per_cta chunks (P = 1,\n"
        "chunks_per_cta 0: whole sequences), segment s > 0 starting from seg_H[s - 1]; maps=True: pass 1 of the\n"
        "split (units = 2 P - 3, block_v 128, o None), writing seg_H [P-1, N, HV, 128, 128] and seg_M [P-2, ...]\n"
        "(K-major, fp32).\n"
        "pass_kind 3: the prep (chunks_per_cta, units as pass 1) and pass 2 over whole sequences (state_rs, block_v\n"
        "64) in one launch, pass 2 waiting on rec_ready (int32 [HV, rec slots], zero-filled by the caller) for\n"
        "each record; 2 N * HV <= SMs / 2. Writes o, final_state and, when given, Aqk/Akk and the q_hat group.\n"
        "seg_lo, seg_hi (state_rs only): pass 2 runs segments [seg_lo, seg_hi) (seg_hi 0: P): [s, P) with s >= 1\n"
        "after the combine, or [0, 1) with P > 1, segment 0's end state then also to seg_H[0]; maps with seg_lo 1\n"
        "(P >= 3) leaves segment 0's end state to that pass (units stays 2 P - 3).\n"
        "h_inter (bf16 [B, NT, HV, 128, 128] in the state layout) or None: bf16 of the state at every chunk start\n"
        "(return_intermediate_states), written by the passes that write o; varlen needs chunk_offsets ([N+1]\n"
        "int32/int64, FLA's prepare_chunk_offsets) and NT = its last entry.\n"
        "state_rs: a state pass (no h_inter or phase_cycles) on kda_state_rs_kernel, the state transposed in\n"
        "wgmma registers (same rounding points as the default state kernel).\n"
        "TypeError / ValueError for bad arguments (before any CUDA call), RuntimeError for CUDA errors.\n"
        "Does not synchronize.");
  m.attr("KDA_FWD_PHASES") = kKdaFwdPhases;
  m.attr("KDA_REC_BYTES") = kKdaRecBytes;
  m.attr("KDA_FWD_PHASE_NAMES") = py::make_tuple("gate + block scan", "scan offsets + anchors + rstd",
                                                 "anchored factors", "Aqk+L", "state factors", "inverse", "-W",
                                                 "V' + Qg S", "Aqk V' + state", "v store + load wait");
}

}  // namespace fla_cula
