// The two-kernel form's state passes with the state transposed in registers (docs/kda_sm90.md "v4: the state pass in
// registers"): pass 2 over whole sequences or the segments of the exact split, and the split's maps pass, reading the
// prep's records.
//
// Per (sequence n, value head hv) and chunk of 64 tokens, with the record's tiles (akkb = X diag(b), -W, Qg, Aqk,
// Kd, gamma) and v of the chunk, the state S (128 channels x 128 columns, fp32) is kept as S^T:
//   V'^T = v^T akkb^T + bf16(S^T) (-W)^T            (64 columns x 64 tokens per warpgroup)
//   O^T  = bf16(S^T) Qg^T + bf16(V'^T) Aqk^T        (o rows < the chunk's length are stored)
//   S^T  = S^T diag(gamma) + bf16(V'^T) Kd
// Warpgroup w of a CTA's one or two owns 64 state columns (rows of S^T): its columns are an independent recurrence
// under the chunk's K-side operators, so two warpgroups share the record and never wait for each other's products.
// S^T and V'^T are wgmma accumulators whose 16-column blocks are also the A fragments of the next product (fp32
// packed to bf16 in registers), so the serial chain S -> V' -> S has no shared-memory round trip; every B operand is
// a record tile as the prep wrote it (128-byte swizzled; K-major, Kd token-major as an MN-major B), and v^T is read
// as an MN-major A from v's own rows.
// The rounding points and the order of every sum are those of kda_state_kernel (bf16(S), bf16(V'), fp32
// accumulation over 16-channel blocks in order), so the CPU emulation gives the same bits as that kernel's.
//
// Pipeline: two stages of (record, v rows) filled one chunk ahead, the record by one bulk copy (cp.async.bulk, thread
// 0, completing on the stage's mbarrier; the maps pass: two, for the tiles it reads), the v rows by cp.async; one CTA
// barrier per chunk publishes chunk c's stage and frees the other for chunk c + 1. O^T leaves through a per-warpgroup
// staging tile (stmatrix.trans, then 16-byte row stores).
#pragma once

#include "kda_sm90/kda_fwd_kernel.cuh"
#ifndef FLA_CULA_KDA_HOST_EMULATION
#include <cute/arch/copy_sm90_tma.hpp>
#endif

namespace fla_cula::kda_sm90 {

constexpr int kRsRecBytes = (kKdaRecBytes + 1023) / 1024 * 1024;  // a stage's record image, 1024-byte aligned tiles

// kWG warpgroups of 64 state columns each (block_v = 64 kWG). One CTA per SM (~178 / 157 KB): two stages and the
// output tiles.
template <int kWG>
struct StateRsStorage {
  struct Stage {
    alignas(1024) unsigned char rec[kRsRecBytes];  // the record, byte for byte (kRec* offsets are 1024-aligned)
    alignas(1024) bf16 v[kWG][kC][64];             // per warpgroup: v rows [token][its 64 columns], MN-major sw128
  } st[2];
  alignas(1024) bf16 o[kWG][kC][64];               // per warpgroup: O rows [token][its 64 columns], sw128
  uint64_t full[2];                                // per stage: the record's bytes landed (transaction mbarrier)
};
template <int kBV>
constexpr int kStateRsSmemBytes = int(sizeof(StateRsStorage<kBV / 64>));
static_assert(kStateRsSmemBytes<128> <= 227 * 1024, "shared memory over the SM90 opt-in maximum");
static_assert(kRecAkkb % 1024 == 0 && kRecWn % 1024 == 0 && kRecQg % 1024 == 0 && kRecAqk % 1024 == 0 &&
                  kRecKd % 1024 == 0 && kRecGamma % 16 == 0,
              "record tiles at 1024-byte offsets: the swizzle is a function of the shared-memory address");

#ifndef FLA_CULA_KDA_HOST_EMULATION
namespace wg {
template <int N>
using MmaRS = cute::conditional_t<
    N == 128, cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_RS<cute::GMMA::Major::K, cute::GMMA::Major::K>,
    cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_RS<cute::GMMA::Major::K, cute::GMMA::Major::K>>;
// B MN-major (Kd, token-major)
using MmaRSmn = cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_RS<cute::GMMA::Major::K, cute::GMMA::Major::MN>;

template <int N, size_t... I>
__device__ __forceinline__ void fma_rs(uint32_t const (&a)[4], uint64_t db, float* d, cute::GMMA::ScaleOut s,
                                       std::index_sequence<I...>) {
  MmaRS<N>::fma(a[0], a[1], a[2], a[3], db, d[I]..., s);
}
template <size_t... I>
__device__ __forceinline__ void fma_rs_mn(uint32_t const (&a)[4], uint64_t db, float* d, cute::GMMA::ScaleOut s,
                                          std::index_sequence<I...>) {
  MmaRSmn::fma(a[0], a[1], a[2], a[3], db, d[I]..., s);
}
}  // namespace wg
#endif

// registers a wgmma reads or writes (accumulators, A fragments): the compiler keeps its accesses on their side of
// the wgmma fence / wait
template <class T, int R, int C>
__device__ __forceinline__ void fence_regs(T (&a)[R][C]) {
#ifndef FLA_CULA_KDA_HOST_EMULATION
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int e = 0; e < C; ++e) cute::warpgroup_fence_operand(a[i][e]);
#endif
}

// acc (accumulate ? += : =) A[0:64, 0:K] B[0:N, 0:K]^T, A from registers: a[kb] is the m64k16 fragment of columns
// 16 kb .. 16 kb + 15 (the accumulator layout of those columns, packed to bf16 pairs); B a K-major sw128 tile as in
// wg_mma_tn. Issued only: the caller fences, commits and waits.
template <int N, int K, int BRows = N>
__device__ __forceinline__ void wg_rs(float (&acc)[N / 8][4], uint32_t const (&a)[K / 16][4], bf16 const* B,
                                      bool accumulate) {
#ifdef FLA_CULA_KDA_HOST_EMULATION
  kda_emulated_wgmma_rs<N, K, BRows>(acc, a, B, accumulate);
#else
  cute::GmmaDescriptor const db = wg::desc<N>(B);
#pragma unroll
  for (int kb = 0; kb < K / 16; ++kb) {
    wg::fma_rs<N>(a[kb], wg::kblock(db, kb, BRows), &acc[0][0],
                  kb == 0 && !accumulate ? cute::GMMA::ScaleOut::Zero : cute::GMMA::ScaleOut::One,
                  std::make_index_sequence<N / 2>{});
  }
#endif
}

// acc += A[0:64, 0:64] B[0:128, 0:64]^T, A from registers as in wg_rs, B an MN-major [64 k][128 n] image: two
// [64 k][64 n] sw128 atoms 8 KB apart (element (n, k) at sw128(k, n % 64) of atom n / 64), one m64n64k16 per atom and
// k-block (accumulator columns 0-63, then 64-127). Issued only.
__device__ __forceinline__ void wg_rs_mn(float (&acc)[16][4], uint32_t const (&a)[4][4], bf16 const* B) {
#ifdef FLA_CULA_KDA_HOST_EMULATION
  kda_emulated_wgmma_rs<128, 64, 64, true>(acc, a, B, true);
#else
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    cute::GmmaDescriptor const db = wg::desc_mn(B + h * 64 * 64);
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) {
      wg::fma_rs_mn(a[kb], wg::mn_kblock(db, kb), &acc[8 * h][0], cute::GMMA::ScaleOut::One,
                    std::make_index_sequence<32>{});
    }
  }
#endif
}

// The record's bulk copies: bytes [b0, b1) of a chunk's record from global src into the stage image dst, completing
// on the stage's mbarrier, whose transaction count the issuing thread set first (stage_expect). Under the CPU
// emulator a plain copy (complete at once; the CTA barrier orders it) and the mbarrier calls are no-ops.
__device__ __forceinline__ void stage_init(uint64_t* bar) {
#ifndef FLA_CULA_KDA_HOST_EMULATION
  cutlass::arch::ClusterTransactionBarrier::init(bar, 1);
#endif
}
__device__ __forceinline__ void stage_expect(uint64_t* bar, int bytes) {
#ifndef FLA_CULA_KDA_HOST_EMULATION
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(bar, uint32_t(bytes));
#endif
}
__device__ __forceinline__ void stage_copy(unsigned char* dst, unsigned char const* src, int b0, int b1,
                                           uint64_t* bar) {
#ifdef FLA_CULA_KDA_HOST_EMULATION
  std::memcpy(dst + b0, src + b0, size_t(b1 - b0));
#else
  cute::SM90_BULK_COPY_G2S::copy(src + b0, bar, dst + b0, b1 - b0);
#endif
}
__device__ __forceinline__ void stage_wait(uint64_t* bar, int phase) {
#ifndef FLA_CULA_KDA_HOST_EMULATION
  cutlass::arch::ClusterTransactionBarrier::wait(bar, uint32_t(phase));
#endif
}

__device__ __forceinline__ void wg_arrive() {
#ifndef FLA_CULA_KDA_HOST_EMULATION
  cute::warpgroup_arrive();
#endif
}
__device__ __forceinline__ void wg_commit_wait() {
#ifndef FLA_CULA_KDA_HOST_EMULATION
  cute::warpgroup_commit_batch();
  cute::warpgroup_wait<0>();
#endif
}

// the CTA's kNT threads (barrier 0 with a count: the roles kernel's pass-2 CTAs run one warpgroup of its 256 threads)
template <int kNT>
__device__ __forceinline__ void rs_cta_barrier() {
#ifdef FLA_CULA_KDA_HOST_EMULATION
  __syncthreads();
#else
  asm volatile("bar.sync 0, %0;\n" ::"n"(kNT) : "memory");
#endif
}

// the 128 threads of warpgroup w (named barrier 1 + w)
__device__ __forceinline__ void wg_barrier(int w) {
#ifdef FLA_CULA_KDA_HOST_EMULATION
  kda_emulated_wg_barrier(w);
#else
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + w) : "memory");
#endif
}

// bf16 A fragments of the 16-column blocks of a 64 x 16 KB accumulator (the accumulator layout: a[kb] = columns
// 16 kb .. 16 kb + 15, rows g and g + 8, column pairs 2 t and 2 t + 8)
template <int KB>
__device__ __forceinline__ void to_frag(uint32_t (&a)[KB][4], float const (&acc)[2 * KB][4]) {
#pragma unroll
  for (int kb = 0; kb < KB; ++kb) {
    a[kb][0] = pack_bf16(acc[2 * kb][0], acc[2 * kb][1]);
    a[kb][1] = pack_bf16(acc[2 * kb][2], acc[2 * kb][3]);
    a[kb][2] = pack_bf16(acc[2 * kb + 1][0], acc[2 * kb + 1][1]);
    a[kb][3] = pack_bf16(acc[2 * kb + 1][2], acc[2 * kb + 1][3]);
  }
}

// The state passes of the two-kernel form (Params::pass = kState, no h_inter): CTA = (n, unit, hv, V block) as
// kda_state_kernel<kBV>'s grid; kBV / 64 warpgroups of 64 state columns each (kBV 64: a pair's two CTAs share its
// records through L2 and fill twice the SMs on small grids). kMaps = Params::maps (kBV 128): pass 1 of the split, no
// o; unit u < P - 1 - seg_lo carries segment s = seg_lo + u from its start (h0 for s = 0, else 0) to seg_H[s], the
// next P - 2 units the transition map of segment m + 1 (v = 0 from the identity) to seg_M[m]. Otherwise pass 2 of
// segments seg_lo + unit: o, ht from the last segment, and with seg_H_out (segment 0 alone, beside the maps pass
// with seg_lo = 1) segment 0's end state to seg_H[0].
// bid: the CTA's index in the pass. With Params::rec_ready (the roles kernel) thread 0 copies a record only once its
// prep CTA has released it: at the chunk before it if it is ready then, else at the top of its own chunk.
template <bool kMaps, int kBV = 128>
__device__ __forceinline__ void kda_state_rs_body(KdaFwdParams const& p, int const bid) {
  static_assert(kBV == 64 || kBV == 128, "64 state columns per warpgroup, one or two warpgroups");
  static_assert(!kMaps || kBV == 128, "a map is 128 x 128");
  constexpr int kWG = kBV / 64, kNT = 128 * kWG;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  StateRsStorage<kWG>& sm = *reinterpret_cast<StateRsStorage<kWG>*>(smem_raw);
#ifndef FLA_CULA_KDA_HOST_EMULATION
  if (cute::cast_smem_ptr_to_uint(smem_raw) & 1023u) __trap();  // the swizzle needs a 1024-byte aligned base
#endif
  int const tid = threadIdx.x, w = tid >> 7, wi = (tid >> 5) & 3, lane = tid & 31;
  int const g8 = lane >> 2, t4 = lane & 3;
  int x = bid;
  int const vb = x % (128 / kBV);
  x /= 128 / kBV;
  int const hv = x % p.HV;
  x /= p.HV;
  int const unit = x % p.units;
  int const n = x / p.units;
  int const P = p.segments, ends = P - 1 - p.seg_lo;  // ends: the maps pass's segment-end units
  bool const mmap = kMaps && unit >= ends;             // a transition map: v = 0 from the identity
  int const seg = mmap ? unit - ends + 1 : p.seg_lo + unit;

  int64_t bos, eos;
  sequence_bounds(p, n, bos, eos);
  int const nchunks = int((eos - bos + kC - 1) / kC);
  int c_lo, c_hi, last_seg;
  unit_chunks(p.chunks_per_cta, seg, P - 1, nchunks, c_lo, c_hi, last_seg);
  // pass 2: nothing past the sequence's chunks (segment 0 of an empty sequence still writes ht = h0); a maps CTA always
  // writes (an empty segment's (M, H) is (I, 0))
  if (!kMaps && seg > last_seg) return;

  if (tid == 0) {
    stage_init(&sm.full[0]);
    stage_init(&sm.full[1]);
#ifndef FLA_CULA_KDA_HOST_EMULATION
    cutlass::arch::fence_barrier_init();
#endif
  }
  rs_cta_barrier<kNT>();

  unsigned char const* const rec0 =
      static_cast<unsigned char const*>(p.rec) + (int64_t(hv) * p.rec_slots + bos / kC + n) * kKdaRecBytes;
  bf16 const* const vg = static_cast<bf16 const*>(p.v) + hv * p.v_head_stride + kBV * vb;
  bf16* const og = kMaps ? nullptr : static_cast<bf16*>(p.o) + hv * p.o_head_stride + kBV * vb + 64 * w;

  // chunk c's record (thread 0's bulk copies onto full[s]) and v rows (rows past the sequence zero; one cp.async
  // commit group) into stage s. The maps pass reads neither Qg nor Aqk, and a map neither akkb nor v.
  int const* const ready = p.rec_ready != nullptr
                               ? p.rec_ready + int64_t(hv) * p.rec_slots + bos / kC + n : nullptr;  // chunk 0's flag
  int deferred = -1;  // thread 0: the chunk whose record waits for its flag
  auto copy_record = [&](int c) {
    int const s = (c - c_lo) & 1;
    unsigned char const* const src = rec0 + int64_t(c) * kKdaRecBytes;
    int const a0 = kMaps ? (mmap ? kRecWn : kRecAkkb) : 0, a1 = kMaps ? kRecQg : kKdaRecBytes;
    stage_expect(&sm.full[s], a1 - a0 + (kMaps ? kKdaRecBytes - kRecKd : 0));
    stage_copy(sm.st[s].rec, src, a0, a1, &sm.full[s]);
    if constexpr (kMaps) stage_copy(sm.st[s].rec, src, kRecKd, kKdaRecBytes, &sm.full[s]);
  };
  auto issue = [&](int c, int s) {
    if (tid == 0) {
      if (ready == nullptr || rec_flag_acquire(ready + c)) {
        copy_record(c);
      } else {
        deferred = c;
      }
    }
    int64_t const t0 = bos + int64_t(c) * kC;
    int64_t const left = eos - t0;
#pragma unroll
    for (int u = 0; u < kC * 8 / 128; ++u) {  // kWG x 64 rows x 8 pieces over kWG x 128 threads
      int const idx = tid + u * kNT, vw = idx >> 9, t = (idx >> 3) & 63, q = idx & 7;
      bool const in = t < left;
      if (!mmap) {
        cp_async16(&sm.st[s].v[vw][0][0] + sw128(t, 8 * q),
                   vg + (in ? (t0 + t) * p.v_tok_stride + 64 * vw + 8 * q : 0), in);
      }
    }
    cp_async_commit();
  };

  if (c_lo < c_hi) issue(c_lo, 0);  // the first chunk's loads overlap the start state's

  // S^T: rows 16 wi + g8 (+ 8) of warpgroup w are state columns col0 (+ 8), accumulator columns are channels d. The
  // start is h0 (segment 0), the combined seg_H of the segment before, or zero; element (d, col) of a state lies at
  // base[d * sd + col * sc] (h0 / ht in their layout, seg_H K-major)
  float S[16][4];
  int64_t const pair = int64_t(n) * p.HV + hv;
  int const sd = p.state_v_first ? 1 : 128, sc = p.state_v_first ? kK : 1;
  int const col0 = kBV * vb + 64 * w + 16 * wi + g8, d0 = 2 * t4;
  {
    // pass 2 of a later segment: the combined seg_H; the maps pass: h0 (segment 0 only) or the identity (a map)
    bool const from_seg = !kMaps && seg > 0;
    float const* const base = from_seg ? p.seg_H + (int64_t(seg - 1) * p.N * p.HV + pair) * kK * 128
                              : p.h0 != nullptr && seg == 0 && !mmap ? p.h0 + pair * kK * 128 : nullptr;
    int const bd = from_seg ? 128 : sd, bc = from_seg ? 1 : sc;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int const d = d0 + nt * 8 + (e & 1), col = col0 + (e >> 1) * 8;
        S[nt][e] = base != nullptr ? base[d * bd + col * bc] : mmap && d == col ? 1.f : 0.f;
      }
    }
  }

  for (int c = c_lo; c < c_hi; ++c) {
    int const s = (c - c_lo) & 1;
    if (deferred == c) {  // thread 0 only: chunk c's record was not ready when its stage was filled
      rec_flag_wait(ready + c);
      copy_record(c);
      deferred = -1;
    }
    stage_wait(&sm.full[s], ((c - c_lo) >> 1) & 1);  // chunk c's record landed (the stage's (c - c_lo) / 2-th use)
    cp_async_wait_group<0>();  // this thread's v copies of chunk c landed ...
    fence_async_shared();      // ... and become visible to wgmma after the barrier,
    rs_cta_barrier<kNT>();     // which also ends every read of the other stage (chunk c - 1)
    if (c + 1 < c_hi) issue(c + 1, s ^ 1);
    unsigned char const* const r = sm.st[s].rec;
    auto tile = [&](int off) { return reinterpret_cast<bf16 const*>(r + off); };

    // V'^T = v^T akkb^T + bf16(S^T) (-W)^T
    float vp[8][4];
    uint32_t aS[8][4];
    to_frag(aS, S);
    fence_regs(vp);
    fence_regs(aS);
    if (mmap) {  // a map: v = 0
      wg_arrive();
      wg_rs<64, 128, 64>(vp, aS, tile(kRecWn), false);
      wg_commit_wait();
    } else {
      wg_arrive();
      wg_mn_issue<64>(vp, &sm.st[s].v[w][0][0], tile(kRecAkkb), false);
      wg_rs<64, 128, 64>(vp, aS, tile(kRecWn), true);
      wg_commit_wait();
    }
    fence_regs(vp);

    // S^T = S^T diag(gamma) + bf16(V'^T) Kd;  O^T = bf16(S^T) Qg^T + bf16(V'^T) Aqk^T (S^T first: the chain)
    uint32_t aV[4][4];
    to_frag(aV, vp);
    float const* const gamma = reinterpret_cast<float const*>(r + kRecGamma);
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      float2 const gm = *reinterpret_cast<float2 const*>(gamma + nt * 8 + 2 * t4);
      S[nt][0] *= gm.x;
      S[nt][1] *= gm.y;
      S[nt][2] *= gm.x;
      S[nt][3] *= gm.y;
    }
    float oa[8][4];
    fence_regs(S);
    fence_regs(aV);
    if constexpr (!kMaps) fence_regs(oa);
    wg_arrive();
    wg_rs_mn(S, aV, tile(kRecKd));
    if constexpr (!kMaps) {
      wg_rs<64, 128, 64>(oa, aS, tile(kRecQg), false);
      wg_rs<64, 64>(oa, aV, tile(kRecAqk), true);
    }
    wg_commit_wait();
    fence_regs(S);
    if constexpr (kMaps) continue;  // no o
    fence_regs(oa);

    // O^T -> O rows: stmatrix.trans of (tokens 8 nt .. + 7) x (columns 16 wi (+ 8)), then rows < the chunk's length
    {
      int const m = lane >> 3, j = lane & 7;
      bf16* const ot = &sm.o[w][0][0];
#pragma unroll
      for (int nt = 0; nt < 8; nt += 2) {
        stmatrix_x4_trans(ot + sw128((nt + (m >> 1)) * 8 + j, 16 * wi + (m & 1) * 8), pack_bf16(oa[nt][0], oa[nt][1]),
                          pack_bf16(oa[nt][2], oa[nt][3]), pack_bf16(oa[nt + 1][0], oa[nt + 1][1]),
                          pack_bf16(oa[nt + 1][2], oa[nt + 1][3]));
      }
      wg_barrier(w);
      int64_t const t0 = bos + int64_t(c) * kC;
      int64_t const left = eos - t0;
#pragma unroll
      for (int u = 0; u < kC * 8 / 128; ++u) {
        int const idx = (tid & 127) + 128 * u, t = idx >> 3, q = idx & 7;
        if (t < left) {
          *reinterpret_cast<uint4*>(og + (t0 + t) * p.o_tok_stride + 8 * q) =
              *reinterpret_cast<uint4 const*>(ot + sw128(t, 8 * q));
        }
      }
    }
  }

  // the final state (pass 2, the last segment) in the h0 layout, or the maps pass's seg_H / seg_M (K-major); S^T's
  // rows are state columns
  float* base = nullptr;
  int bd = 128, bc = 1;
  if constexpr (kMaps) {
    base = (mmap ? p.seg_M + int64_t(seg - 1) * p.N * p.HV * kK * 128 : p.seg_H + int64_t(seg) * p.N * p.HV * kK * 128)
           + pair * kK * 128;
  } else if (p.ht != nullptr && seg == last_seg) {
    base = p.ht + pair * kK * 128;
    bd = sd;
    bc = sc;
  }
  auto store = [&](float* b, int sd_, int sc_) {
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) b[(d0 + nt * 8 + (e & 1)) * sd_ + (col0 + (e >> 1) * 8) * sc_] = S[nt][e];
    }
  };
  if (base != nullptr) store(base, bd, bc);
  // pass 2 of segment 0 beside the maps pass: its end state is seg_H[0] (also when it is the sequence's last: the
  // combine reads every pair's slot)
  if (!kMaps && p.seg_H_out) store(p.seg_H + pair * kK * 128, 128, 1);
}

template <bool kMaps, int kBV = 128>
__global__ void __launch_bounds__(kBV * 2, 1) kda_state_rs_kernel(__grid_constant__ KdaFwdParams const p) {
  kda_state_rs_body<kMaps, kBV>(p, blockIdx.x);
}

}  // namespace fla_cula::kda_sm90
