// Device code of the varlen work list (see varlen_schedule.h for what it computes).
//
// One CTA does everything, in four block-wide steps over the N sequences, thread t holding
// sequences t*kItems .. t*kItems + kItems-1 (CUB's blocked arrangement):
//   1. lengths: a running-maximum scan of cu_seqlens (clamped to [0, T]) gives each sequence's
//      begin; its length is end - begin, its chunk count ceil(length / C);
//   2. chunk_offsets: an exclusive sum of the chunk counts in sequence order (and the total);
//   3. longest first: a block radix sort of (length, sequence) by length, descending; the sort is
//      stable, so equal lengths keep sequence order; an exclusive sum of the sorted chunk counts
//      gives each sorted sequence its first row, kept in shared memory with its sequence index;
//   4. rows: thread t writes rows t, t + kThreads, ...; a row finds its sequence by binary search
//      over the sorted first rows (empty sequences sort last, so a valid row always lands on a
//      non-empty one) and stores (sequence, row - first row) as one 8-byte word; rows past the
//      total get (-1, -1).
// Steps 1-3 are O(N) work in shared memory; step 4 is O(max_chunks log N), coalesced stores.
#pragma once

#include <cstdint>

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

namespace fla_cula::varlen_schedule {

// Static specialization: the CTA size and sequences per thread; N <= kThreads * kItems.
template <int kThreads_, int kItems_>
struct VarlenScheduleKernel {
  static constexpr int kThreads = kThreads_;
  static constexpr int kItems = kItems_;
  static constexpr int kMaxSeqs = kThreads * kItems;

  using Scan = cub::BlockScan<int32_t, kThreads>;
  using Sort = cub::BlockRadixSort<uint32_t, kThreads, kItems, int32_t>;

  struct SharedStorage {
    union {
      typename Scan::TempStorage scan;
      typename Sort::TempStorage sort;
    } temp;
    int32_t first_row[kMaxSeqs];  // sorted position -> its first row in chunk_indices
    int32_t seq[kMaxSeqs];        // sorted position -> sequence index
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));

  struct Params {
    void const* cu_seqlens;  // [num_seqs + 1], int32 or int64
    bool cu_seqlens_int64;
    int2* chunk_indices;     // [max_chunks] (sequence, chunk) pairs
    int32_t* num_chunks;
    int32_t* chunk_offsets;  // [num_seqs + 1]
    int32_t num_seqs;
    int32_t max_chunks;
    int32_t total_tokens;
    int32_t chunk_size;
    int32_t end_bit;         // lengths are < 2^end_bit: the radix sort looks at these bits only
  };

  struct Max {
    __device__ int32_t operator()(int32_t a, int32_t b) const { return a > b ? a : b; }
  };

  static __device__ int32_t clamped_cu(Params const& p, int i) {
    int64_t const v = p.cu_seqlens_int64 ? static_cast<int64_t const*>(p.cu_seqlens)[i]
                                         : static_cast<int32_t const*>(p.cu_seqlens)[i];
    return static_cast<int32_t>(v < 0 ? 0 : (v > p.total_tokens ? p.total_tokens : v));
  }

  static __device__ int32_t ceil_div(uint32_t len, int32_t c) {
    return static_cast<int32_t>(len / uint32_t(c) + (len % uint32_t(c) != 0));
  }

  static __device__ void run(Params const& p, SharedStorage& smem) {
    int const tid = threadIdx.x;
    int const n = p.num_seqs;

    // 1. lengths
    int32_t end[kItems], begin[kItems];
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      int const i = tid * kItems + k;
      end[k] = i < n ? clamped_cu(p, i + 1) : 0;  // padding never precedes a real sequence
    }
    Scan(smem.temp.scan).ExclusiveScan(end, begin, clamped_cu(p, 0), Max{});  // begin = running max
    uint32_t len[kItems];
    int32_t count[kItems], offset[kItems];
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      int const i = tid * kItems + k;
      len[k] = i < n && end[k] > begin[k] ? uint32_t(end[k] - begin[k]) : 0u;
      count[k] = ceil_div(len[k], p.chunk_size);
    }

    // 2. chunk_offsets in sequence order
    __syncthreads();
    int32_t total;
    Scan(smem.temp.scan).ExclusiveSum(count, offset, total);
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      int const i = tid * kItems + k;
      if (i < n) p.chunk_offsets[i] = offset[k];
    }
    // The clamp bounds total by T / C + N <= max_chunks (checked on the host); min() for safety.
    int32_t const rows = total < p.max_chunks ? total : p.max_chunks;
    if (tid == 0) {
      p.chunk_offsets[n] = total;
      *p.num_chunks = rows;
    }

    // 3. longest first (stable: equal lengths stay in sequence order; padding has length 0 and
    // an index >= n, so it sorts after every real sequence)
    int32_t seq[kItems];
#pragma unroll
    for (int k = 0; k < kItems; ++k) seq[k] = tid * kItems + k;
    __syncthreads();
    Sort(smem.temp.sort).SortDescending(len, seq, 0, p.end_bit);
#pragma unroll
    for (int k = 0; k < kItems; ++k) count[k] = ceil_div(len[k], p.chunk_size);
    __syncthreads();
    Scan(smem.temp.scan).ExclusiveSum(count, offset);
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      int const pos = tid * kItems + k;
      if (pos < n) {
        smem.first_row[pos] = offset[k];
        smem.seq[pos] = seq[k];
      }
    }
    __syncthreads();

    // 4. rows
    for (int r = tid; r < p.max_chunks; r += kThreads) {
      int2 v = make_int2(-1, -1);
      if (r < rows) {
        int lo = 0, hi = n;  // first_row[lo] <= r, and hi == n or first_row[hi] > r
        while (hi - lo > 1) {
          int const mid = (lo + hi) >> 1;
          if (smem.first_row[mid] <= r) lo = mid; else hi = mid;
        }
        v = make_int2(smem.seq[lo], r - smem.first_row[lo]);
      }
      p.chunk_indices[r] = v;
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1) varlen_schedule_kernel(__grid_constant__ typename Kernel::Params const params) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Kernel::run(params, *reinterpret_cast<typename Kernel::SharedStorage*>(smem_raw));
}

}  // namespace fla_cula::varlen_schedule
