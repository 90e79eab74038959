/* kvhandoff's fp32 CPU kernels for the decode shapes where torch's CPU paths leave the machine idle.
 *
 * gemm_packed: y = x W^T for a weight re-laid once as panels of 16 output columns ([N/16][K][16]),
 *   so each step streams every weight once, in order, for the whole batch (1-6 rows per register
 *   tile). MKL's fp32 linear at 1-16 rows read the weights at about half the memory bandwidth on
 *   the AMD machines seen (issue 12); this keeps up with it at 1024 rows too, so prefill uses it.
 * paged_attention: each query row attends over its sequence's blocks where they lie in the KV pool
 *   (online softmax, one block at a time), instead of gathering them into a contiguous copy.
 * decode_layer: a whole decoder layer for a batch of decode rows in one call (norms, the four
 *   matmuls, RoPE and the K/V store, attention, SiLU, residual adds), for decode-only steps.
 * bf16 (issue 25): gemv_bf16 reads a bf16 weight in its own [N][K] layout (the one torch's bf16
 *   prefill uses: one copy of the weights), with the CPU's bf16 dot products where it has them (its
 *   input rounded to bf16, as torch rounds it) and else widening each weight to fp32 on load (a
 *   shift: every AVX2 CPU); the attention reads a bf16 K/V pool, widened on load; activations and
 *   sums stay fp32. A decode step reads half the bytes of fp32's, and every row's sums run in one
 *   order whatever the batch (batch-invariant), which torch's bf16 paths did not.
 *
 * Built by kvhandoff/model/kernels.py with the system's gcc and -march=native, once per machine
 * (the build cache key includes the CPU flags); loaded with ctypes into a process that already
 * runs torch, so `-fopenmp` binds to torch's own libgomp (same soname) and shares its thread pool.
 * Without AVX2/FMA this file does not compile and the engine runs on torch alone.
 */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <immintrin.h>
#if !defined(__AVX2__) || !defined(__FMA__)
#error "kvhandoff's CPU kernels need AVX2 and FMA; the engine falls back to torch"
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));   /* unaligned loads and stores */
typedef int v8i __attribute__((vector_size(32)));
typedef uint16_t bf16;

/* 8 bf16 -> 8 fp32: a bf16 is the top half of an fp32's bits */
static inline v8 widen8(const bf16* p) {
  return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
}

/* fp32 -> bf16, rounding to nearest even as torch does (a NaN stays a NaN) */
static inline bf16 to_bf16(float f) {
  union { float f; uint32_t u; } v = {f};
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return (bf16)((v.u >> 16) | 0x40);
  return (bf16)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* [sum(a[0]), ..., sum(a[7])] */
static inline v8 reduce8(const v8* a) {
  __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
  __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]), t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
  t0 = _mm256_hadd_ps(t0, t1); t1 = _mm256_hadd_ps(t2, t3);
  return (v8)_mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* ---- packed-weight matmul ------------------------------------------------------------------ */
#define PANEL 16
#define TILE(MR) \
static void tile##MR(long K, const float* restrict x, long ldx, const float* restrict panel, float* restrict y, long ldy) { \
  v8 lo[MR], hi[MR]; \
  for (int i = 0; i < MR; i++) { lo[i] = (v8){0}; hi[i] = (v8){0}; } \
  for (long k = 0; k < K; k++) { \
    v8 w0 = *(const v8*)(panel + PANEL * k), w1 = *(const v8*)(panel + PANEL * k + 8); \
    for (int i = 0; i < MR; i++) { float a = x[i * ldx + k]; lo[i] += a * w0; hi[i] += a * w1; } \
  } \
  for (int i = 0; i < MR; i++) { *(v8u*)(y + i * ldy) = lo[i]; *(v8u*)(y + i * ldy + 8) = hi[i]; } \
}
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
typedef void (*tile_t)(long, const float*, long, const float*, float*, long);
static const tile_t TILES[7] = {0, tile1, tile2, tile3, tile4, tile5, tile6};

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T, W packed as [N/16][K][16] (64-byte aligned). */
void gemm_packed(const float* x, long M, long K, long ldx, const float* packed, long N, float* y, long ldy,
                 int num_threads) {
  #pragma omp parallel for schedule(static) num_threads(num_threads)
  for (long j = 0; j < N / PANEL; j++) {
    const float* panel = packed + j * K * PANEL;       /* stays in L2 while every row passes over it */
    for (long m = 0; m < M; m += 6) {
      long rows = M - m < 6 ? M - m : 6;
      TILES[rows](K, x + m * ldx, ldx, panel, y + m * ldy + j * PANEL, ldy);
    }
  }
}

/* ---- bf16 weights, row-major ------------------------------------------------------------------
   y[m][n] = sum_k x[m][k] w[n][k], one weight row at a time against up to 4 input rows (held in L1).
   One row at a time: on the EPYC here, a gemv reading 4 weight rows side by side streamed the head's
   56 MB from memory at ~9 GB/s, one row after the other at ~23 GB/s (a plain sum: 24). Two
   accumulators a row (even and odd steps of k) keep two chains of FMAs in flight. Each (m, n) is
   summed in the same order whatever M and the tiling: batch-invariant. */
#define DOT8(MR) \
static void dot8_##MR(long K, const float* x, long ldx, const bf16* w, float* y, long ldy) { \
  v8 acc[2][MR]; \
  for (int i = 0; i < MR; i++) acc[0][i] = acc[1][i] = (v8){0}; \
  long k = 0; \
  for (; k + 16 <= K; k += 16) \
    for (int h = 0; h < 2; h++) { \
      v8 wv = widen8(w + k + 8 * h); \
      for (int i = 0; i < MR; i++) acc[h][i] += *(const v8u*)(x + i * ldx + k + 8 * h) * wv; \
    } \
  if (k < K) { \
    v8 wv = widen8(w + k); \
    for (int i = 0; i < MR; i++) acc[0][i] += *(const v8u*)(x + i * ldx + k) * wv; \
  } \
  v8 sums[8]; \
  for (int i = 0; i < 8; i++) sums[i] = i < MR ? acc[0][i] + acc[1][i] : (v8){0}; \
  v8 total = reduce8(sums); \
  for (int i = 0; i < MR; i++) y[i * ldy] = total[i]; \
}
DOT8(1) DOT8(2) DOT8(3) DOT8(4)
typedef void (*dot8_t)(long, const float*, long, const bf16*, float*, long);
static const dot8_t DOTS8[5] = {0, dot8_1, dot8_2, dot8_3, dot8_4};

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* Native bf16 dot products (AVX512-BF16): x rounded to bf16 once per call (round to nearest even, as
   torch's bf16 matmuls round their inputs), 32 products a vdpbf16ps, summed in fp32: a decode step is
   then bound by the weights' bytes, not by widening them. */
#define NATIVE_BF16 1
#define DOT32(MR) \
static void dot32_##MR(long K, const bf16* x, const bf16* w, float* y, long ldy) { \
  __m512 acc[2][MR]; \
  for (int i = 0; i < MR; i++) acc[0][i] = acc[1][i] = _mm512_setzero_ps(); \
  long k = 0; \
  for (; k + 64 <= K; k += 64) \
    for (int h = 0; h < 2; h++) { \
      __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k + 32 * h); \
      for (int i = 0; i < MR; i++) \
        acc[h][i] = _mm512_dpbf16_ps(acc[h][i], (__m512bh)_mm512_loadu_si512(x + i * K + k + 32 * h), wv); \
    } \
  if (k < K) { \
    __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k); \
    for (int i = 0; i < MR; i++) acc[0][i] = _mm512_dpbf16_ps(acc[0][i], (__m512bh)_mm512_loadu_si512(x + i * K + k), wv); \
  } \
  for (int i = 0; i < MR; i++) y[i * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][i], acc[1][i])); \
}
DOT32(1) DOT32(2) DOT32(3) DOT32(4)
typedef void (*dot32_t)(long, const bf16*, const bf16*, float*, long);
static const dot32_t DOTS32[5] = {0, dot32_1, dot32_2, dot32_3, dot32_4};
#endif

/* Which way gemv_bf16 computes for an input width K: 1 native bf16 dot products (x rounded to bf16),
   0 widening (x in fp32). */
int gemv_bf16_native_for(long K) {
#ifdef NATIVE_BF16
  return K % 32 == 0;
#else
  (void)K;
  return 0;
#endif
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T, W bf16 [N][K] (row stride ldw); K % 8 == 0. */
void gemv_bf16(const float* x, long M, long K, long ldx, const bf16* w, long N, long ldw, float* y, long ldy,
               int num_threads) {
#ifdef NATIVE_BF16
  if (gemv_bf16_native_for(K)) {
    bf16* xb = aligned_alloc(64, ((M * K * sizeof(bf16) + 63) / 64) * 64);
    for (long m = 0; m < M; m++)
      for (long k = 0; k < K; k += 32) {
        __m512 lo = _mm512_loadu_ps(x + m * ldx + k), hi = _mm512_loadu_ps(x + m * ldx + k + 16);
        _mm512_storeu_si512(xb + m * K + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long n = 0; n < N; n++)
      for (long m = 0; m < M; m += 4)
        DOTS32[M - m < 4 ? M - m : 4](K, xb + m * K, w + n * ldw, y + m * ldy + n, ldy);
    free(xb);
    return;
  }
#endif
  #pragma omp parallel for schedule(static) num_threads(num_threads)
  for (long n = 0; n < N; n++)
    for (long m = 0; m < M; m += 4)
      DOTS8[M - m < 4 ? M - m : 4](K, x + m * ldx, ldx, w + n * ldw, y + m * ldy + n, ldy);
}

/* ---- paged attention ----------------------------------------------------------------------- */
/* Measured on the AVX2-only EPYC (SmolLM2's shapes, 1,024 context): reading a block's layer one head
   at a time (an 8 KB run of K, another of V, then the next block pages away) streamed at ~7.7 GB/s on
   one thread, where the same bytes read as one 48 KB run per block streamed at ~12 GB/s and
   software prefetches of the next block only slowed it. So a task walks its sequence's blocks and,
   in each, all the heads it owns, K and V of one head after the other: the block's layer range is
   read front to back. With fewer rows than threads a row's heads are split over tasks instead, so
   one sequence still uses every thread. */
#define MAX_BLOCK 256
#define MAX_GROUP 8
#define HEADS_PER_PASS 8                     /* bounds the softmax state a task keeps on its stack */

/* e^x for x <= 0 (softmax after subtracting the max): 2^n * p(r), |r| < ln 2; 0 below -87. */
static inline v8 exp8(v8 x) {
  const v8 lo = {-87.f,-87.f,-87.f,-87.f,-87.f,-87.f,-87.f,-87.f};
  v8i below = x < lo;
  x = (v8)((below & (v8i)lo) | (~below & (v8i)x));
  v8 y = x * 1.44269504088896341f;
  v8i n = __builtin_convertvector(y, v8i);
  v8 nf = __builtin_convertvector(n, v8);
  v8 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  v8 p = 1.9875691500E-4f * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r * r + r + 1.0f;
  v8i bits = (n + 127) << 23;
  return (v8)(~below & (v8i)(p * (v8)bits));      /* e^-inf (a padded score) is exactly 0 */
}

/* The online-softmax state of one (row, kv head): acc[G][DV] v8, then m[G], then l[G]. */
struct attend_state { v8 acc[MAX_GROUP * 16]; float m[MAX_GROUP], l[MAX_GROUP]; };

/* One block of one (row, kv head): `G` query heads share its K/V ([n][8 * DV] each, in place);
   `DV` = head_dim / 8. The V update keeps G * DT accumulators in flight (DT 8-float slices of the
   head at a time): with one per query head, as at first, each was a chain of dependent FMAs one per
   token, and the kernel ran at the FMA's latency rather than at memory speed. */
#define LOAD_F32(p) (*(const v8u*)(p))
#define LOAD_BF16(p) widen8(p)
#define ATTEND(G, DV, T, LOAD) \
static void attend_##T##_##G##_##DV(const float* q, struct attend_state* st, const void* K_, const void* V_, long n, \
                                    const char* next_k, const char* next_v) { \
  const T* K = K_; const T* V = V_; \
  enum { D = 8 * DV, DT0 = G <= 1 ? 8 : G <= 3 ? 4 : G <= 6 ? 2 : 1, DT = DT0 < DV ? DT0 : DV }; \
  float s[G][MAX_BLOCK + 8] __attribute__((aligned(32))); \
  v8 (*acc)[DV] = (v8 (*)[DV])st->acc; \
  for (long t = 0; t < n; t += 8) { \
    const T* Kt = K + t * D; \
    long w = n - t < 8 ? n - t : 8; \
    if (next_k) for (long off = t * D * (long)sizeof(T); off < (t + 8) * D * (long)sizeof(T); off += 64) __builtin_prefetch(next_k + off); \
    for (int g = 0; g < G; g++) { \
      v8 a[8]; \
      for (int j = 0; j < 8; j++) a[j] = (v8){0}; \
      if (w == 8) /* the common case, branch-free; the tail below never reads past the block */ \
        for (int d = 0; d < DV; d++) { \
          v8 qv = *(const v8u*)(q + g * D + 8 * d); \
          for (int j = 0; j < 8; j++) a[j] += qv * LOAD(Kt + j * D + 8 * d); \
        } \
      else \
        for (int j = 0; j < w; j++) \
          for (int d = 0; d < DV; d++) a[j] += *(const v8u*)(q + g * D + 8 * d) * LOAD(Kt + j * D + 8 * d); \
      *(v8*)&s[g][t] = reduce8(a); \
    } \
  } \
  long n8 = (n + 7) & ~7L; \
  for (int g = 0; g < G; g++) { \
    for (long t = n; t < n8; t++) s[g][t] = -INFINITY; \
    v8 top = *(v8*)&s[g][0]; \
    for (long t = 8; t < n8; t += 8) { v8 x = *(v8*)&s[g][t]; top = (v8)_mm256_max_ps((__m256)top, (__m256)x); } \
    float bm = top[0]; \
    for (int j = 1; j < 8; j++) bm = top[j] > bm ? top[j] : bm; \
    float mn = bm > st->m[g] ? bm : st->m[g], corr = expf(st->m[g] - mn); \
    st->m[g] = mn; \
    v8 sum = {0}; \
    for (long t = 0; t < n8; t += 8) { \
      v8 e = exp8(*(v8*)&s[g][t] - mn); \
      *(v8*)&s[g][t] = e; \
      sum += e; \
    } \
    st->l[g] = st->l[g] * corr + (sum[0] + sum[1] + sum[2] + sum[3] + sum[4] + sum[5] + sum[6] + sum[7]); \
    for (int d = 0; d < DV; d++) acc[g][d] *= corr; \
  } \
  for (int d0 = 0; d0 < DV; d0 += DT) { \
    v8 r[G][DT]; \
    for (int g = 0; g < G; g++) for (int i = 0; i < DT; i++) r[g][i] = acc[g][d0 + i]; \
    for (long t = 0; t < n; t++) { \
      if (next_v && d0 == 0) for (long off = t * D * (long)sizeof(T); off < (t + 1) * D * (long)sizeof(T); off += 64) __builtin_prefetch(next_v + off); \
      v8 vv[DT]; \
      for (int i = 0; i < DT; i++) vv[i] = LOAD(V + t * D + 8 * (d0 + i)); \
      for (int g = 0; g < G; g++) { \
        v8 p = (v8)_mm256_broadcast_ss(&s[g][t]); \
        for (int i = 0; i < DT; i++) r[g][i] += p * vv[i]; \
      } \
    } \
    for (int g = 0; g < G; g++) for (int i = 0; i < DT; i++) acc[g][d0 + i] = r[g][i]; \
  } \
}
#define ATTEND_D(G, T, LOAD) ATTEND(G, 4, T, LOAD) ATTEND(G, 8, T, LOAD) ATTEND(G, 16, T, LOAD)
#define ATTEND_G(T, LOAD) ATTEND_D(1, T, LOAD) ATTEND_D(2, T, LOAD) ATTEND_D(3, T, LOAD) ATTEND_D(4, T, LOAD) \
  ATTEND_D(5, T, LOAD) ATTEND_D(6, T, LOAD) ATTEND_D(7, T, LOAD) ATTEND_D(8, T, LOAD)
ATTEND_G(float, LOAD_F32)
ATTEND_G(bf16, LOAD_BF16)
typedef void (*attend_t)(const float*, struct attend_state*, const void*, const void*, long, const char*, const char*);
#define PAIR(T, G) {attend_##T##_##G##_4, attend_##T##_##G##_8, attend_##T##_##G##_16}
#define PAIRS(T) {{0, 0, 0}, PAIR(T, 1), PAIR(T, 2), PAIR(T, 3), PAIR(T, 4), PAIR(T, 5), PAIR(T, 6), PAIR(T, 7), PAIR(T, 8)}
static const attend_t ATTENDS[2][MAX_GROUP + 1][3] = {PAIRS(float), PAIRS(bf16)};    /* [K/V in bf16] */

/* Which (group, head_dim) pairs paged_attention serves; the caller falls back to torch otherwise. */
int paged_attention_supports(long group, long head_dim, long block_size) {
  return group >= 1 && group <= MAX_GROUP && (head_dim == 32 || head_dim == 64 || head_dim == 128)
         && block_size <= MAX_BLOCK;
}

/* Query heads of kv heads [h0, h1) of one row over its `len` tokens; K of block b, kv head h at
   element table[b] * block_stride + h * block_size * D from k_base (V likewise), elements of `item`
   bytes (4: fp32, 2: bf16). q, out: the row's [heads][D]. */
static void attend_heads(attend_t attend, long group, long D, const float* q, float* out, long h0, long h1,
                         const char* k_base, const char* v_base, long item, long block_stride, long block_size,
                         const int64_t* table, long len) {
  struct attend_state st[HEADS_PER_PASS];
  for (; h0 < h1; h0 += HEADS_PER_PASS) {
    long hn = h1 - h0 < HEADS_PER_PASS ? h1 - h0 : HEADS_PER_PASS;
    for (long h = 0; h < hn; h++)
      for (long g = 0; g < group; g++) {
        st[h].m[g] = -INFINITY; st[h].l[g] = 0.f;
        for (long d = 0; d < D / 8; d++) st[h].acc[g * (D / 8) + d] = (v8){0};
      }
    for (long start = 0, blk = 0; start < len; start += block_size, blk++) {
      long n = len - start < block_size ? len - start : block_size, base = table[blk] * block_stride;
      long next = start + block_size < len ? table[blk + 1] * block_stride : -1;
      for (long h = 0; h < hn; h++) {
        long head = (h0 + h) * block_size * D;
        attend(q + (h0 + h) * group * D, &st[h], k_base + (base + head) * item, v_base + (base + head) * item, n,
               next < 0 ? 0 : k_base + (next + head) * item, next < 0 ? 0 : v_base + (next + head) * item);
      }
    }
    for (long h = 0; h < hn; h++)
      for (long g = 0; g < group; g++) {
        float inv = 1.f / st[h].l[g];
        float* o = out + ((h0 + h) * group + g) * D;
        for (long d = 0; d < D / 8; d++) *(v8u*)(o + 8 * d) = st[h].acc[g * (D / 8) + d] * inv;
      }
  }
}

/* Attention of query rows over paged K/V read in place.
   q: [rows, heads, D] (already scaled), row stride ldq; out: [rows, heads, D], row stride ldo. Row r
   attends to the first row_len[r] tokens of sequence row_seq[r] (r itself if row_seq is NULL), whose
   blocks are block_tables[row_seq[r] * max_blocks ...]. */
static void attention(const float* q, long ldq, float* out, long ldo, long rows, long heads, long kv_heads, long D,
                      const char* k_base, const char* v_base, long item, long block_stride, long block_size,
                      const int64_t* block_tables, long max_blocks, const int64_t* row_seq,
                      const int64_t* row_len, int num_threads) {
  long group = heads / kv_heads;
  attend_t attend = ATTENDS[item == 2][group][D == 32 ? 0 : D == 64 ? 1 : 2];
  long splits = (2L * num_threads + rows - 1) / rows;       /* tasks per row: ~2 per thread in all */
  splits = splits < 1 ? 1 : splits > kv_heads ? kv_heads : splits;
  #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (long task = 0; task < rows * splits; task++) {
    long r = task / splits, part = task % splits;
    attend_heads(attend, group, D, q + r * ldq, out + r * ldo, kv_heads * part / splits, kv_heads * (part + 1) / splits,
                 k_base, v_base, item, block_stride, block_size, block_tables + (row_seq ? row_seq[r] : r) * max_blocks,
                 row_len[r]);
  }
}

void paged_attention(const float* q, float* out, long rows, long heads, long kv_heads, long D,
                     const float* k_base, const float* v_base, long block_stride, long block_size,
                     const int64_t* block_tables, long max_blocks, const int64_t* row_seq,
                     const int64_t* row_len, int num_threads) {
  attention(q, heads * D, out, heads * D, rows, heads, kv_heads, D, (const char*)k_base, (const char*)v_base,
            sizeof(float), block_stride, block_size, block_tables, max_blocks, row_seq, row_len, num_threads);
}

/* ---- the small ops around them, fused: each torch op costs microseconds of dispatch, and a decode
   step of a 30-layer model runs about forty of them per layer ------------------------------------ */

/* out[r] = weight * x[r] / sqrt(mean(x[r]^2) + eps); with delta, first x[r] += delta[r] (residual). */
void rms_norm(float* x, const float* delta, long rows, long dim, long ldx, long ld_delta, const float* weight,
              float eps, float* out) {
  for (long r = 0; r < rows; r++) {
    float* xr = x + r * ldx;
    float* o = out + r * dim;
    if (delta)
      for (long i = 0; i < dim; i++) xr[i] += delta[r * ld_delta + i];
    float sum = 0.f;
    #pragma omp simd reduction(+:sum)
    for (long i = 0; i < dim; i++) sum += xr[i] * xr[i];
    float inv = 1.f / sqrtf(sum / dim + eps);
    for (long i = 0; i < dim; i++) o[i] = weight[i] * (xr[i] * inv);
  }
}

/* Rotate-half RoPE on every q and k head of each row of qkv ([T][q heads | kv heads | kv heads] x D,
   row stride ld) in place, with row t's angles in cos_rows/sin_rows [T][D/2]; then store each row's
   K and V at (slot_block, slot_offset) of the pool. */
static void rope_store(float* qkv, long T, long ld, long heads, long kv_heads, long D, const float* cos_rows,
                       const float* sin_rows, char* k_base, char* v_base, long item,
                       long block_stride, long block_size, const int64_t* slot_block, const int64_t* slot_offset) {
  long half = D / 2;
  for (long t = 0; t < T; t++) {
    float* row = qkv + t * ld;
    const float* c = cos_rows + t * half;
    const float* s = sin_rows + t * half;
    for (long h = 0; h < heads + kv_heads; h++) {
      float* x = row + h * D;
      for (long i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
    long slot = slot_block[t] * block_stride + slot_offset[t] * D;
    for (long j = 0; j < kv_heads; j++) {
      const float* k = row + (heads + j) * D;
      const float* v = row + (heads + kv_heads + j) * D;
      long at = (slot + j * block_size * D) * item;
      if (item == 2) {
        bf16 *kd = (bf16*)(k_base + at), *vd = (bf16*)(v_base + at);
        for (long i = 0; i < D; i++) { kd[i] = to_bf16(k[i]); vd[i] = to_bf16(v[i]); }
      } else {
        float *kd = (float*)(k_base + at), *vd = (float*)(v_base + at);
        for (long i = 0; i < D; i++) { kd[i] = k[i]; vd[i] = v[i]; }
      }
    }
  }
}

void rope_store_kv(float* qkv, long T, long ld, long heads, long kv_heads, long D, const float* cos_rows,
                   const float* sin_rows, float* k_base, float* v_base,
                   long block_stride, long block_size, const int64_t* slot_block, const int64_t* slot_offset) {
  rope_store(qkv, T, ld, heads, kv_heads, D, cos_rows, sin_rows, (char*)k_base, (char*)v_base, sizeof(float),
             block_stride, block_size, slot_block, slot_offset);
}

/* ---- one decoder layer for a batch of decode rows (one new token per sequence), in one call ----
   A decode step of a small model is mostly a few dozen small operations per layer; issued from
   Python each costs microseconds of dispatch and an allocation (about 14 ms of a 66 ms SmolLM2 step
   on one AVX2 core, issue 12). Here the layer's norms, matmuls, RoPE, K/V store, attention, SiLU
   and residual adds run back to back on scratch memory. The per-op path stays for prefill. */
/* n columns (padded to cols); fp32 panels for gemm_packed, or (bf16) the [n][K] weight itself for gemv_bf16 */
struct packed { const float* panels; const bf16* rows; long cols, n; const float* bias; };

struct decode_layer_weights {
  const float *norm1, *norm2; float eps1, eps2;
  struct packed qkv, o, gate_up, down;
  long hidden, heads, kv_heads, head_dim, intermediate;
  char* k_base; char* v_base; long kv_item;        /* this layer's K and V in the pool, elements of kv_item bytes */
  long block_stride, block_size;                   /* (in elements) */
};

struct decode_batch {
  long rows;
  const float *cos_rows, *sin_rows;                 /* [rows][head_dim / 2] */
  const int64_t *slot_block, *slot_offset;          /* where each row's new K/V goes */
  const int64_t *block_tables; long max_blocks;     /* [rows][max_blocks] */
  const int64_t *lens;                              /* tokens each row attends to, its own included */
  float scale;
  int num_threads;
};

static void linear(const float* x, long M, long K, long ldx, const struct packed* w, float* y, int threads) {
  if (w->rows)
    gemv_bf16(x, M, K, ldx, w->rows, w->n, K, y, w->cols, threads);
  else
    gemm_packed(x, M, K, ldx, w->panels, w->cols, y, w->cols, threads);
  if (w->bias)
    for (long r = 0; r < M; r++)
      for (long j = 0; j < w->n; j++) y[r * w->cols + j] += w->bias[j];
}

/* Scratch: rows * (hidden + qkv.cols + heads * head_dim + o.cols + gate_up.cols + intermediate + down.cols) floats. */
void decode_layer(const struct decode_layer_weights* L, const struct decode_batch* B, float* x, float* scratch) {
  long T = B->rows, H = L->hidden, D = L->head_dim, q_size = L->heads * D, I = L->intermediate;
  int threads = B->num_threads;
  float *h = scratch, *qkv = h + T * H, *att = qkv + T * L->qkv.cols, *o = att + T * q_size;
  float *gu = o + T * L->o.cols, *act = gu + T * L->gate_up.cols, *down = act + T * I;

  rms_norm(x, 0, T, H, H, 0, L->norm1, L->eps1, h);
  linear(h, T, H, H, &L->qkv, qkv, threads);
  rope_store(qkv, T, L->qkv.cols, L->heads, L->kv_heads, D, B->cos_rows, B->sin_rows, L->k_base, L->v_base,
             L->kv_item, L->block_stride, L->block_size, B->slot_block, B->slot_offset);
  for (long r = 0; r < T; r++)
    for (long i = 0; i < q_size; i++) qkv[r * L->qkv.cols + i] *= B->scale;
  attention(qkv, L->qkv.cols, att, q_size, T, L->heads, L->kv_heads, D, L->k_base, L->v_base, L->kv_item,
            L->block_stride, L->block_size, B->block_tables, B->max_blocks, 0, B->lens, threads);
  linear(att, T, q_size, q_size, &L->o, o, threads);
  rms_norm(x, o, T, H, H, L->o.cols, L->norm2, L->eps2, h);          /* x += o, h = norm(x) */
  linear(h, T, H, H, &L->gate_up, gu, threads);
  for (long r = 0; r < T; r++) {
    const float *g = gu + r * L->gate_up.cols, *u = g + I;
    for (long i = 0; i < I; i++) act[r * I + i] = g[i] / (1.f + expf(-g[i])) * u[i];
  }
  linear(act, T, I, I, &L->down, down, threads);
  for (long r = 0; r < T; r++)
    for (long i = 0; i < H; i++) x[r * H + i] += down[r * L->down.cols + i];
}
