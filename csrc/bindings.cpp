// pybind11 module fla_cula._C. Torch-free on purpose (one build serves every torch version): tensors
// arrive as Python objects and are read through DLPack (common/dlpack_tensor.h), checked in C++,
// collected into one Params struct per kernel family and launched on the caller's current stream.
// Each family registers its functions here; fla_cula/_ext.py loads the module and refuses a stale one.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "common/dlpack_tensor.h"
#include "host/call_signature.h"
#include "kda_sm90/kda_fwd.h"
#include "varlen_schedule/varlen_schedule.h"

#ifndef FLA_CULA_VERSION
#error "FLA_CULA_VERSION must be defined by the build (setup.py)"
#endif
#ifndef FLA_CULA_BUILT_ARCH
#error "FLA_CULA_BUILT_ARCH must be defined by the build (setup.py)"
#endif

namespace py = pybind11;

namespace fla_cula {
void register_varlen_schedule(py::module_& m);
void register_kda_fwd(py::module_& m);
}

// Bumped whenever a function's signature or semantics changes; fla_cula/_ext.py refuses a stale build.
constexpr int kApiVersion = 12;

PYBIND11_MODULE(_C, m) {
  m.doc() = "fla_cula CUDA C++ kernels (sm_90a), torch-free pybind11 bindings over DLPack";

  m.def(
      "init_dlpack", [](py::object tensor_type) { return fla_cula::bind_exchange_api(tensor_type.ptr()); },
      py::arg("tensor_type"),
      "Bind the DLPack C exchange API of tensor_type (torch.Tensor) for tensor arguments and call_signature;\n"
      "returns '' or why it cannot be used (tensors then go through __dlpack__).");
  // The name fla_cula.routing uses.
  m.def(
      "init_call_signature", [](py::object tensor_type) { return fla_cula::bind_exchange_api(tensor_type.ptr()); },
      py::arg("tensor_type"), "Same as init_dlpack.");
  m.def(
      "call_signature",
      [](py::object args, py::object slow) {
        PyObject* r = fla_cula::call_signature(args.ptr(), slow.ptr());
        if (r == nullptr) throw py::error_already_set();
        return py::reinterpret_steal<py::object>(r);
      },
      py::arg("args"), py::arg("slow"),
      "fla_cula.routing.signature(args): each tensor's dtype, device, address % 16, shape and strides as\n"
      "bytes, other items as they are; slow(tensor) for a tensor the exchange API refuses.");

  fla_cula::register_varlen_schedule(m);
  fla_cula::register_kda_fwd(m);

  m.def(
      "kernels",
      [] {
        // One entry per kernel family: its name, the substring of its SASS symbols, its specializations.
        std::vector<py::dict> out;
        auto add_family = [&out](char const* name, char const* symbol, py::list specs) {
          py::dict f;
          f["name"] = name;
          f["symbol"] = symbol;
          f["specializations"] = specs;
          out.push_back(f);
        };
        py::list specs;
        for (auto const& s : fla_cula::kVarlenScheduleSpecialization) {
          py::dict d;
          d["threads"] = s.threads;
          d["items"] = s.items;
          d["max_seqs"] = s.max_seqs;
          d["smem_bytes"] = s.smem_bytes;
          d["symbol"] = "VarlenScheduleKernelILi" + std::to_string(s.threads) + "ELi" + std::to_string(s.items) + "E";
          specs.append(d);
        }
        add_family("varlen_schedule", "varlen_schedule_kernel", specs);
        py::list kda_specs;
        for (auto const& s : fla_cula::kKdaFwdSpecialization) {
          py::dict d;
          d["gate"] = s.gate;
          d["profile"] = s.profile;
          d["threads"] = s.threads;
          d["block_v"] = s.block_v;
          d["wgmma"] = s.wgmma;
          d["pass"] = s.pass;
          d["smem_bytes"] = s.smem_bytes;
          d["state_rs"] = s.state_rs;
          d["maps"] = s.maps;
          d["qk_hat"] = s.qk_hat;
          // mangled kda_fwd_kernel<GateForm::SigmoidLB, profile, block_v, wgmma, qk_hat>, kda_prep_kernel<gate,
          // profile, qk_hat>, kda_state_kernel<block_v, profile>, kda_state_rs_kernel<maps, block_v>,
          // kda_roles_kernel<gate, qk_hat> (GateForm: 0 sigmoid_lb, 1 softplus, 2 precomputed)
          std::string const gate = s.gate;
          char const* gate_digit = gate == "softplus" ? "1" : gate == "precomputed" ? "2" : "0";
          if (s.state_rs) {
            d["symbol"] = std::string("kda_state_rs_kernelILb") + (s.maps ? "1" : "0") + "ELi" +
                          std::to_string(s.block_v) + "EE";
          } else if (s.pass == fla_cula::kKdaRoles) {
            d["symbol"] = std::string("kda_roles_kernelILNS0_8GateFormE") + gate_digit + "ELb" +
                          (s.qk_hat ? "1" : "0") + "EE";
          } else if (s.pass == fla_cula::kKdaPrep) {
            d["symbol"] = std::string("kda_prep_kernelILNS0_8GateFormE") + gate_digit + "ELb" +
                          (s.profile ? "1" : "0") + "ELb" + (s.qk_hat ? "1" : "0") + "EE";
          } else if (s.pass == fla_cula::kKdaState) {
            d["symbol"] = "kda_state_kernelILi" + std::to_string(s.block_v) + "ELb" + (s.profile ? "1" : "0") + "EE";
          } else {
            d["symbol"] = std::string("kda_fwd_kernelILNS0_8GateFormE0ELb") + (s.profile ? "1" : "0") + "ELi" +
                          std::to_string(s.block_v) + "ELb" + (s.wgmma ? "1" : "0") + "ELb" + (s.qk_hat ? "1" : "0") +
                          "EE";
          }
          kda_specs.append(d);
        }
        add_family("kda_prefill", "kda_", kda_specs);
        return out;
      },
      "The C++ kernel families in this build, each with its specializations (CTA size, dynamic shared\n"
      "memory, SASS symbol). No CUDA call.");
  m.def(
      "usable_sm_count",
      [](int device) { return fla_cula::kda_usable_sms(device); },
      py::arg("device"),
      "SMs a launch on cuda:<device> may use from this process: the device's count, lowered by an MPS\n"
      "execution-affinity limit where the driver reports one.");
  m.def("version", [] { return std::string(FLA_CULA_VERSION); }, "fla_cula version this module was built from.");
  m.def("built_arch", [] { return std::string(FLA_CULA_BUILT_ARCH); }, "GPU architecture of the device code.");
  m.def("api_version", [] { return kApiVersion; }, "Version of this module's function signatures.");
  m.def(
      "cuda_version",
      [] {
        int v = fla_cula::cuda_build_version();
        return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
      },
      "CUDA runtime version the kernels were compiled against (statically linked).");
}
