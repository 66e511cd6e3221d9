// cp.async (16-byte global -> shared copies, completed in commit groups), shared by the KDA kernels; plain copies
// under the CPU emulator (FLA_CULA_KDA_HOST_EMULATION), where the waits are no-ops.
#pragma once

#include <cstdint>

namespace fla_cula::kda_sm90 {

// 16-byte global -> shared copy, zero-filled when !valid (no bytes read then). Completed by cp_async_wait_all.
__device__ __forceinline__ void cp_async16(void* smem, void const* gmem, bool valid) {
#ifdef FLA_CULA_KDA_HOST_EMULATION
  if (valid) {
    *static_cast<uint4*>(smem) = *static_cast<uint4 const*>(gmem);
  } else {
    *static_cast<uint4*>(smem) = make_uint4(0, 0, 0, 0);
  }
#else
  unsigned const s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0) : "memory");
#endif
}

// 4-byte global -> shared copy (through L1), zero-filled when !valid. Completed as cp_async16.
__device__ __forceinline__ void cp_async4(void* smem, void const* gmem, bool valid) {
#ifdef FLA_CULA_KDA_HOST_EMULATION
  *static_cast<uint32_t*>(smem) = valid ? *static_cast<uint32_t const*>(gmem) : 0u;
#else
  unsigned const s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 4 : 0) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#ifndef FLA_CULA_KDA_HOST_EMULATION
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// The copies this thread issued since its last commit become one group.
__device__ __forceinline__ void cp_async_commit() {
#ifndef FLA_CULA_KDA_HOST_EMULATION
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until at most N of this thread's committed groups are pending (groups complete in commit order).
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
#ifndef FLA_CULA_KDA_HOST_EMULATION
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

}  // namespace fla_cula::kda_sm90
