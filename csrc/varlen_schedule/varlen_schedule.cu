// Launcher of the varlen work list: size checks, choice of specialization, device, launch.
#include "varlen_schedule.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "../common/cuda_check.h"
#include "varlen_schedule_kernel.cuh"

namespace fla_cula {
namespace {

// Most batches have at most a few hundred sequences: a 128-thread CTA sorts them in a few
// microseconds; the 512-thread one (16 per thread: 96 registers, no spills; 1024 x 8 spills at
// the 64-register cap) serves up to kVarlenScheduleMaxSeqs.
using SmallKernel = varlen_schedule::VarlenScheduleKernel<128, 4>;
using LargeKernel = varlen_schedule::VarlenScheduleKernel<512, 16>;
static_assert(LargeKernel::kMaxSeqs == kVarlenScheduleMaxSeqs, "the limit is the large specialization's");

template <class Kernel>
void launch(VarlenScheduleParams const& a) {
  auto* kernel = varlen_schedule::varlen_schedule_kernel<Kernel>;
  if constexpr (Kernel::kSmemBytes > 48 * 1024) {  // beyond 48 KiB needs an opt-in, once per device
    opt_in_shared_memory<varlen_schedule::varlen_schedule_kernel<Kernel>>(a.device, Kernel::kSmemBytes);
  }
  int end_bit = 1;  // lengths are <= total_tokens
  while (end_bit < 31 && (int64_t(1) << end_bit) <= a.total_tokens) ++end_bit;
  typename Kernel::Params p{a.cu_seqlens,  a.cu_seqlens_int64, reinterpret_cast<int2*>(a.chunk_indices),
                            a.num_chunks,  a.chunk_offsets,    a.num_seqs,
                            a.max_chunks,  a.total_tokens,     a.chunk_size,
                            end_bit};
  kernel<<<1, Kernel::kThreads, Kernel::kSmemBytes, static_cast<cudaStream_t>(a.stream)>>>(p);
  FLA_CULA_CHECK_LAUNCH("varlen_schedule_kernel");
}

}  // namespace

VarlenScheduleSpecialization const kVarlenScheduleSpecialization[kVarlenScheduleSpecializations] = {
    {SmallKernel::kThreads, SmallKernel::kItems, SmallKernel::kMaxSeqs, SmallKernel::kSmemBytes},
    {LargeKernel::kThreads, LargeKernel::kItems, LargeKernel::kMaxSeqs, LargeKernel::kSmemBytes},
};

void run_varlen_schedule(VarlenScheduleParams const& a) {
  FLA_CULA_REQUIRE(a.num_seqs >= 0 && a.num_seqs <= kVarlenScheduleMaxSeqs,
                   "varlen_schedule: expected 0 <= num_seqs <= " + std::to_string(kVarlenScheduleMaxSeqs) +
                       ", got " + std::to_string(a.num_seqs));
  FLA_CULA_REQUIRE(a.chunk_size > 0, "varlen_schedule: expected chunk_size > 0, got " + std::to_string(a.chunk_size));
  FLA_CULA_REQUIRE(a.total_tokens >= 0,
                   "varlen_schedule: expected total_tokens >= 0, got " + std::to_string(a.total_tokens));
  int64_t const need = int64_t(a.total_tokens) / a.chunk_size + a.num_seqs;
  FLA_CULA_REQUIRE(a.max_chunks >= need, "varlen_schedule: expected max_chunks >= total_tokens // chunk_size + N = " +
                                             std::to_string(need) + ", got " + std::to_string(a.max_chunks));
  FLA_CULA_REQUIRE(a.cu_seqlens != nullptr && a.num_chunks != nullptr && a.chunk_offsets != nullptr &&
                       (a.chunk_indices != nullptr || a.max_chunks == 0),
                   "varlen_schedule: null device pointer");
  DeviceGuard guard(a.device);
  require_compute_capability(a.device, 9, 0, "varlen_schedule");
  if (a.num_seqs <= SmallKernel::kMaxSeqs) {
    launch<SmallKernel>(a);
  } else {
    launch<LargeKernel>(a);
  }
}

int cuda_build_version() { return CUDART_VERSION; }

}  // namespace fla_cula
