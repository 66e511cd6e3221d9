// Python binding of the fused KDA prefill forward: tensors in (DLPack), checks, KdaFwdParams, launch on
// the caller's current stream of q's device. Every check reads metadata only and runs before any CUDA
// call, so the errors are the same (and testable) on a machine without a GPU.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "common/dlpack_tensor.h"
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

void kda_fwd_api(py::handle q_obj, py::handle k_obj, py::handle v_obj, py::handle g_obj, py::handle beta_obj,
                 py::handle A_log_obj, py::handle dt_bias_obj, py::handle h0_obj, py::handle cu_obj, py::handle o_obj,
                 py::handle ht_obj, py::handle Aqk_obj, py::handle Akk_obj, double scale, double lower_bound,
                 bool use_qk_l2norm, bool use_beta_sigmoid, double beta_scale, bool state_v_first,
                 int block_v, py::handle phase_cycles_obj, bool wgmma) {
  TensorArg q = tensor_arg(q_obj, "q");
  expect_dtype(q, {dtype::kBFloat16});
  expect_ndim(q, 4);
  int64_t const B = q.size(0), T = q.size(1), H = q.size(2);
  if (q.size(3) != kHeadDim) {
    throw py::value_error("q: expected head dim 128, got shape " + q.shape_str());
  }
  expect_contiguous(q);
  expect_aligned(q, 16);
  expect_cuda(q);
  TensorArg k = tensor_arg(k_obj, "k");
  expect_tensor(k, {dtype::kBFloat16}, {B, T, H, kHeadDim}, "(B, T, H, 128) as q", &q, 16);
  TensorArg v = tensor_arg(v_obj, "v");
  expect_dtype(v, {dtype::kBFloat16});
  expect_ndim(v, 4);
  int64_t const HV = v.size(2);
  if (v.size(0) != B || v.size(1) != T || v.size(3) != kHeadDim || HV < 1 || HV % H != 0) {
    throw py::value_error("v: expected shape (B, T, HV, 128) = (" + std::to_string(B) + ", " + std::to_string(T) +
                          ", HV, 128) with HV a multiple of H = " + std::to_string(H) + ", got " + v.shape_str());
  }
  expect_contiguous(v);
  expect_aligned(v, 16);
  expect_same_device(v, q);
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
  TensorArg o = tensor_arg(o_obj, "o");
  expect_tensor(o, {dtype::kBFloat16}, {B, T, HV, kHeadDim}, "(B, T, HV, 128)", &q, 4);
  if (!ht_obj.is_none()) {
    TensorArg ht = tensor_arg(ht_obj, "final_state");
    expect_tensor(ht, {dtype::kFloat32}, state_shape, state_what, &q);
    p.ht = ht.ptr<float>();
  }
  if (Aqk_obj.is_none() != Akk_obj.is_none()) {
    throw py::value_error("Aqk, Akk: expected both or neither (grad extras)");
  }
  if (!Aqk_obj.is_none()) {
    TensorArg Aqk = tensor_arg(Aqk_obj, "Aqk");
    expect_tensor(Aqk, {dtype::kBFloat16}, {B, T, HV, kChunk}, "(B, T, HV, 64)", &q, 4);
    TensorArg Akk = tensor_arg(Akk_obj, "Akk");
    expect_tensor(Akk, {dtype::kBFloat16}, {B, T, HV, kChunk}, "(B, T, HV, 64)", &q, 4);
    p.Aqk = Aqk.data;
    p.Akk = Akk.data;
  }
  if (block_v != 64 && block_v != 128) {
    throw py::value_error("block_v: expected 64 or 128, got " + std::to_string(block_v));
  }
  p.block_v = block_v;
  p.wgmma = wgmma;
  if (!phase_cycles_obj.is_none()) {
    TensorArg pc = tensor_arg(phase_cycles_obj, "phase_cycles");
    expect_tensor(pc, {dtype::kInt64}, {N * HV * (kHeadDim / block_v), kKdaFwdPhases},
                  "(N * HV * 128 / block_v, phases)", &q);
    p.phase_cycles = pc.ptr<long long>();
  }
  if (!(lower_bound >= -5.0 && lower_bound < 0.0)) {
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
  p.o = o.data;
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

}  // namespace

void register_kda_fwd(py::module_& m) {
  m.def("kda_fwd", &kda_fwd_api, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"),
        py::arg("A_log"), py::arg("dt_bias"), py::arg("initial_state"), py::arg("cu_seqlens"), py::arg("o"),
        py::arg("final_state"), py::arg("Aqk"), py::arg("Akk"), py::arg("scale"), py::arg("lower_bound"),
        py::arg("use_qk_l2norm"), py::arg("use_beta_sigmoid"), py::arg("beta_scale"), py::arg("state_v_first"),
        py::arg("block_v") = 64, py::arg("phase_cycles") = py::none(), py::arg("wgmma") = false,
        "Enqueue the fused KDA prefill forward v1 (csrc/kda_sm90/kda_fwd.h) on the current stream of q's device:\n"
        "bf16 q, k [B,T,H,128], v, raw gate g [B,T,HV,128], raw beta [B,T,HV] (bf16/fp32); gate\n"
        "a = lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) (A_log [HV], dt_bias [HV*128] or None);\n"
        "initial_state / final_state fp32 [N,HV,128,128] (V-first with state_v_first) or None; writes o\n"
        "(bf16 [B,T,HV,128]) and, when given, Aqk/Akk (bf16 [B,T,HV,64], FLA's layout). All contiguous.\n"
        "block_v (64 or 128): V columns per CTA (N*HV*128/block_v CTAs; 128 computes the K-side prep once per\n"
        "(sequence, value head), 64 twice but fills more SMs).\n"
        "wgmma: the state-side products (-W, V', O, the state update) on SM90 warpgroup MMA instead of\n"
        "mma.sync (same math; fp32 accumulation order inside the tensor core may differ).\n"
        "phase_cycles (int64 [N*HV*128/block_v, KDA_FWD_PHASES] or None): per CTA, clock64 cycles of each phase\n"
        "summed over its chunks (KDA_FWD_PHASE_NAMES).\n"
        "TypeError / ValueError for bad arguments (before any CUDA call), RuntimeError for CUDA errors.\n"
        "Does not synchronize.");
  m.attr("KDA_FWD_PHASES") = kKdaFwdPhases;
  m.attr("KDA_FWD_PHASE_NAMES") = py::make_tuple("gate + block scan", "scan offsets + anchors + rstd",
                                                 "anchored factors", "Aqk+L", "state factors", "inverse", "-W",
                                                 "V' + Qg S", "Aqk V' + state", "v store + load wait");
}

}  // namespace fla_cula
