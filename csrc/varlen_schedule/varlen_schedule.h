// Host interface of the varlen work list (the chunk schedule of a packed batch). Plain C++, no CUDA
// headers: the binding (varlen_schedule_api.cpp) compiles with the host compiler alone.
//
// From cu_seqlens [N+1] it builds, on the GPU and without a host synchronization:
//   chunk_indices [max_chunks, 2] int32: (sequence, chunk within the sequence) for every chunk of
//       every sequence, longest sequence first (ties: lower sequence index first), each sequence's
//       chunks in order; rows from num_chunks on are (-1, -1). max_chunks >= total_tokens / C + N
//       always suffices (a sequence of L tokens has ceil(L / C) <= L / C + 1 chunks).
//   num_chunks [] int32: the number of valid rows.
//   chunk_offsets [N+1] int32: exclusive prefix sum of the chunk counts in sequence order (FLA's
//       prepare_chunk_offsets); chunk_offsets[N] == num_chunks.
// Lengths come from cu_seqlens clamped to [0, total_tokens] and made non-decreasing (a running
// maximum), so a malformed cu_seqlens yields a schedule of some valid one, never an out-of-bounds
// write. For a valid cu_seqlens (0 <= cu[0] <= ... <= cu[N] <= total_tokens) it changes nothing.
#pragma once

#include <cstdint>

namespace fla_cula {

struct VarlenScheduleParams {
  void const* cu_seqlens;   // [num_seqs + 1], int32 or int64, device memory
  bool cu_seqlens_int64;
  int32_t* chunk_indices;   // [max_chunks, 2], row-major
  int32_t* num_chunks;      // [1]
  int32_t* chunk_offsets;   // [num_seqs + 1]
  int32_t num_seqs;         // N, 0 <= N <= kVarlenScheduleMaxSeqs
  int32_t max_chunks;       // rows of chunk_indices
  int32_t total_tokens;     // T: the packed length (q.shape[1])
  int32_t chunk_size;       // C > 0
  int device;               // CUDA device ordinal of every tensor
  void* stream;             // cudaStream_t of the caller on that device
};

// One CTA sorts the sequences by length (CUB block radix sort): up to this many sequences.
constexpr int kVarlenScheduleMaxSeqs = 8192;

// Enqueues the schedule on params.stream; never synchronizes. Throws std::invalid_argument for
// bad sizes, std::runtime_error for CUDA failures (wrong GPU, launch errors).
void run_varlen_schedule(VarlenScheduleParams const& params);

// The compiled specializations, for fla_cula info: their SASS symbol contains
// "VarlenScheduleKernelILi<threads>ELi<items>E".
struct VarlenScheduleSpecialization {
  int threads;           // CTA size
  int items;             // sequences per thread
  int max_seqs;          // threads * items; the smallest that fits N is launched
  int smem_bytes;        // dynamic shared memory per CTA
};
constexpr int kVarlenScheduleSpecializations = 2;
extern VarlenScheduleSpecialization const kVarlenScheduleSpecialization[kVarlenScheduleSpecializations];

// CUDART_VERSION the launchers were compiled against (e.g. 13000).
int cuda_build_version();

}  // namespace fla_cula
