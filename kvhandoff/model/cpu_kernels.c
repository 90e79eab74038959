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
 *   shift: every AVX2 CPU); the attention reads a bf16 K/V pool, kept in pairs for it (with bf16 dot
 *   products too where the CPU has them, else widened on load); activations and sums stay fp32. A
 *   decode step reads half the bytes of fp32's, and every row's sums run in one order whatever the
 *   batch (batch-invariant), which torch's bf16 paths did not.
 *
 * Built by kvhandoff/model/kernels.py with the system's gcc and -march=native, once per machine
 * (the build cache key includes the CPU flags); loaded with ctypes into a process that already
 * runs torch, so `-fopenmp` binds to torch's own libgomp (same soname) and shares its thread pool.
 * Without AVX2/FMA this file does not compile and the engine runs on torch alone.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <immintrin.h>
#include <omp.h>
#include <stdatomic.h>
#include <time.h>
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

static inline float from_bf16(bf16 b) {
  union { uint32_t u; float f; } v = {(uint32_t)b << 16};
  return v.f;
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

/* Memory a matmul prefetches while it computes (decode_layer: K/V its attention will read): runs
   [first, end), run i the run_bytes at base + offsets[i]. */
struct side { const char* base; const int64_t* offsets; long first, end, run_bytes; };

/* Panels a tile of gemm_vnni_side's row tiles spans: one row on one thread 8 (8 weight streams at
   once), else 4 (4 x 4 tiles) */
static long tile_panels(long M, int threads) { return M == 1 && threads == 1 ? 8 : 4; }

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* Native bf16 dot products (AVX512-BF16) on weights packed once at load (pack_bf16_vnni): panels of
   16 outputs, each [K/2][16][2], so that one 64-byte load holds a pair of k for 16 outputs and one
   vdpbf16ps adds x[m][2p] w[n][2p] + x[m][2p+1] w[n][2p+1] to 16 outputs' sums at once: no
   horizontal sums (the torch layout's tiles spent ~15% of a 576-wide tile summing lanes), 0.5 loads
   per dot product in a 4 x 4 tile. x is rounded to bf16 once per call (round to nearest even, as
   torch's bf16 matmuls round their inputs). Each output is one chain of dot products in order of k,
   whatever the tile (rows x panels) computing it: a row's results are the same to the bit in any
   batch (batch-invariant). SmolLM2's 30 layers' linears, one thread, Zen 4 with AVX512-BF16, in one
   process alternated against the torch-layout tiles this replaced (2026-12-04): 1 row 9.5 against
   9.4 ms, 16 rows 22.5 against 24.5, 64 rows 71 against 89, 256 rows 286 against 345 (~100 GMAC/s
   against ~82; torch's oneDNN ran ~99 at the prefill's shapes). Tried and dropped first: keeping
   torch's layout with all 16 outputs of a 4 x 4 tile in registers, even then odd steps of k (the
   old sums to the bit): 1.5x slower at 16-256 rows. */
#define NATIVE_BF16 1

/* MR rows of x (bf16, [MR][K]) against NP panels `pstride` apart: y[MR][NP * 16], columns from the
   first panel's on, `nvalid` of them real (the last panel of a matrix can be partly padding). */
#define VNNI(MR, NP) \
static void vnni_##MR##_##NP(const bf16* x, long K, const bf16* pw, long pstride, float* y, long ldy, long nvalid, \
                              const char* pf, long pf_lines) { \
  __m512 acc[MR][NP]; \
  for (int i = 0; i < MR; i++) for (int j = 0; j < NP; j++) acc[i][j] = _mm512_setzero_ps(); \
  for (long kp = 0; kp < K / 2; kp++) { \
    if (2 * kp < pf_lines) { __builtin_prefetch(pf + 128 * kp, 0, 2); __builtin_prefetch(pf + 128 * kp + 64, 0, 2); } \
    __m512bh w[NP]; \
    for (int j = 0; j < NP; j++) w[j] = (__m512bh)_mm512_loadu_si512(pw + j * pstride + kp * 32); \
    for (int i = 0; i < MR; i++) { \
      int32_t pair; \
      memcpy(&pair, x + i * K + 2 * kp, sizeof pair); \
      __m512bh xi = (__m512bh)_mm512_set1_epi32(pair); \
      for (int j = 0; j < NP; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xi, w[j]); \
    } \
  } \
  for (int j = 0; j < NP; j++) { \
    long left = nvalid - 16 * j; \
    __mmask16 mask = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1); \
    for (int i = 0; i < MR; i++) _mm512_mask_storeu_ps(y + i * ldy + 16 * j, mask, acc[i][j]); \
  } \
}
VNNI(1, 8) VNNI(2, 8) VNNI(1, 4) VNNI(2, 4) VNNI(3, 4) VNNI(4, 4) VNNI(1, 1) VNNI(2, 1) VNNI(3, 1) VNNI(4, 1)
typedef void (*vnni_t)(const bf16*, long, const bf16*, long, float*, long, long, const char*, long);
static const vnni_t VNNI8[3] = {0, vnni_1_8, vnni_2_8};
static const vnni_t VNNI4[5] = {0, vnni_1_4, vnni_2_4, vnni_3_4, vnni_4_4};
static const vnni_t VNNI1[5] = {0, vnni_1_1, vnni_2_1, vnni_3_1, vnni_4_1};

/* A decode batch's linears (2-32 rows): columns. Up to 16 rows against one panel, the panel read
   once from memory, 16 dot products per 64-byte line of weights (a 4 x 4 tile needs 4 lines per
   16 and read them from memory faster than one core could: its first pass over a group of panels
   stalled), the weights prefetched WEIGHTS_AHEAD lines ahead into L2 (one line per 16 rows' steps
   is too thin a stream for the hardware prefetcher alone). x comes interleaved, [K/2][MR] pairs,
   so that every broadcast is one pointer and an offset: with a pointer per row, 16 rows ran out of
   general registers and spilled. The side runs one line every `threads` steps: the weights now take
   most of what memory gives, and the threads share it (16 sequences' whole steps, in one process:
   a line a step against none 0.97x on one thread, against one every two 1.03x on two threads, where
   one every two against none gave 0.97x; 2026-12-05). SmolLM2's linears (30 layers and the head),
   alternated in one process against the 4 x 4 tiles (2026-12-05, Zen 4 with AVX512-BF16): 16 rows
   1 thread 20.4 against 26.6 ms, 2 threads 12.8-13.5 against 16.0; 8 rows 12.2 against 18.1 and
   6.9 against 9.7; 2 rows 0.93-0.98x; 32 rows 0.87-0.89x; 48 rows 1.05-1.10x, 256 rows 1.10x (those
   stay 4 x 4: a prompt's rows reuse each panel from L1 anyway); 1 row 1.03x on 2 threads (stays). */
#define COLUMN_MIN_ROWS 2
#define COLUMN_MAX_ROWS 32
#define COLUMN_ROWS 16
#define WEIGHTS_AHEAD 128
#define COLUMN(MR) \
static void column_##MR(const bf16* x, long K, const bf16* pw, float* y, long ldy, long nvalid, const char* pf, \
                        long pf_lines, long pf_every) { \
  __m512 acc[MR]; \
  for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps(); \
  const int32_t* pairs = (const int32_t*)x; \
  for (long kp = 0; kp < K / 2; kp++) { \
    if (kp % pf_every == 0 && kp / pf_every < pf_lines) __builtin_prefetch(pf + 64 * (kp / pf_every), 0, 2); \
    __m512bh w = (__m512bh)_mm512_loadu_si512(pw + kp * 32); \
    _mm_prefetch((const char*)(pw + (kp + WEIGHTS_AHEAD) * 32), _MM_HINT_T1); \
    for (int i = 0; i < MR; i++) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(pairs[kp * MR + i]), w); \
  } \
  __mmask16 mask = nvalid >= 16 ? 0xFFFF : (__mmask16)((1u << nvalid) - 1); \
  for (int i = 0; i < MR; i++) _mm512_mask_storeu_ps(y + i * ldy, mask, acc[i]); \
}
COLUMN(2) COLUMN(3) COLUMN(4) COLUMN(5) COLUMN(6) COLUMN(7) COLUMN(8) COLUMN(9) COLUMN(10) COLUMN(11) COLUMN(12)
COLUMN(13) COLUMN(14) COLUMN(15) COLUMN(16)
typedef void (*column_t)(const bf16*, long, const bf16*, float*, long, long, const char*, long, long);
static const column_t COLUMNS[COLUMN_ROWS + 1] = {0, 0, column_2, column_3, column_4, column_5, column_6, column_7,
  column_8, column_9, column_10, column_11, column_12, column_13, column_14, column_15, column_16};

static int uses_columns(long M) { return M >= COLUMN_MIN_ROWS && M <= COLUMN_MAX_ROWS; }
static long column_chunks(long M) { return (M + COLUMN_ROWS - 1) / COLUMN_ROWS; }

/* A thread's share of the side runs, handed out `lines` at a time: where the next tile prefetches */
struct side_cursor { const struct side* side; long run, end, at; };
static struct side_cursor side_share(const struct side* side, long part, long parts) {
  if (!side)
    return (struct side_cursor){0, 0, 0, 0};
  long n = side->end - side->first;
  return (struct side_cursor){side, side->first + n * part / parts, side->first + n * (part + 1) / parts, 0};
}
static const char* side_take(struct side_cursor* c, long max_lines, long* lines) {
  *lines = 0;
  if (c->run >= c->end)
    return 0;
  long left = c->side->run_bytes - c->at;
  *lines = max_lines * 64 < left ? max_lines : (left + 63) / 64;
  const char* at = c->side->base + c->side->offsets[c->run] + c->at;
  c->at += *lines * 64;
  if (c->at >= c->side->run_bytes) { c->run++; c->at = 0; }
  return at;
}

/* x (fp32, row stride ldx) rounded to bf16 into rows [M][K] */
static void bf16_convert(const float* x, long M, long K, long ldx, bf16* rows) {
  for (long m = 0; m < M; m++)
    for (long k = 0; k < K; k += 32) {
      __m512 lo = _mm512_loadu_ps(x + m * ldx + k), hi = _mm512_loadu_ps(x + m * ldx + k + 16);
      _mm512_storeu_si512(rows + m * K + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* x rounded to bf16 [M][K] (the caller frees it) */
static bf16* bf16_rows(const float* x, long M, long K, long ldx) {
  bf16* xb = aligned_alloc(64, ((M * K * sizeof(bf16) + 63) / 64) * 64);
  bf16_convert(x, M, K, ldx, xb);
  return xb;
}

/* x rounded to bf16 for column tiles, each chunk of rows [K/2][rows], in the calling thread's own
   buffer (reused, never freed). Each thread of a linear converts the whole input for itself: one
   thread's copy, read by the others, crossed between cores twice a linear (read, then invalidated
   by the next write), and when a VM's two cores sit on different CCDs a line crosses in ~170 ns
   against ~35 (a ping-pong between the two threads). SmolLM2 bf16, 16 sequences at 1,024 tokens,
   two threads: the serial conversion took 0.55 ms a step on one CCX and 2.0 ms across two. */
static const bf16* column_input(const float* x, long M, long K, long ldx) {
  static __thread bf16 *rows, *xb;
  static __thread long capacity;
  if (M * K > capacity) {
    free(rows);
    free(xb);
    capacity = M * K;
    rows = malloc(capacity * sizeof(bf16));
    xb = aligned_alloc(64, ((capacity * sizeof(bf16) + 63) / 64) * 64);
  }
  bf16_convert(x, M, K, ldx, rows);
  const int32_t* pairs = (const int32_t*)rows;
  for (long c = 0, chunks = column_chunks(M); c < chunks; c++) {
    long m0 = M * c / chunks, mr = M * (c + 1) / chunks - m0;
    int32_t* out = (int32_t*)(xb + m0 * K);
    for (long kp = 0; kp < K / 2; kp++)
      for (long i = 0; i < mr; i++) out[kp * mr + i] = pairs[(m0 + i) * (K / 2) + kp];
  }
  return xb;
}

#ifndef M_BLOCK_BYTES
#define M_BLOCK_BYTES (128 * 1024)
#endif
static inline void silu_pair(const float* g, const float* u, float* act);

/* y = x @ W^T, W packed by pack_bf16_vnni; x fp32 [M][K] (row stride ldx), K % 32 == 0; with `side`,
   its runs prefetched as the tiles go (decode_layer). With `silu_out` (column tiles only), W is an MLP's
   gate and up projections with their panels interleaved (gate panel j, then up panel j) and what is
   computed is silu_out [M][N / 2] = silu(gate) * up: each thread takes whole pairs and multiplies
   them while they are in L1, so the product is written by the thread that computed its inputs (no
   SiLU pass reading the other thread's halves, and no parallel region of its own). */
static void gemm_vnni_side(const float* x, long M, long K, long ldx, const bf16* pw, long N, float* y, long ldy,
                           int num_threads, const struct side* side, float* silu_out) {
  if (M == 0 || N == 0)
    return;
  long panels = (N + 15) / 16, pstride = 16 * K;
  if (uses_columns(M)) {
    long chunks = column_chunks(M), step = silu_out ? 2 : 1, units = panels / step;     /* (N % 32 == 0 with silu_out) */
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long part = 0; part < num_threads; part++) {
      const bf16* xb = column_input(x, M, K, ldx);
      struct side_cursor cursor = side_share(side, part, num_threads);
      float pair[COLUMN_ROWS][32] __attribute__((aligned(64)));       /* a chunk's gate and up panels */
      for (long unit = units * part / num_threads, ue = units * (part + 1) / num_threads; unit < ue; unit++)
        for (long c = 0; c < chunks; c++) {
          long m0 = M * c / chunks, m1 = M * (c + 1) / chunks, lines;
          for (long p = unit * step; p < (unit + 1) * step; p++) {
            const char* pf = side_take(&cursor, K / 2 / num_threads, &lines);
            float* out = silu_out ? pair[0] + 16 * (p - unit * step) : y + m0 * ldy + 16 * p;
            COLUMNS[m1 - m0](xb + m0 * K, K, pw + p * pstride, out, silu_out ? 32 : ldy, N - 16 * p, pf, lines,
                             num_threads);
          }
          if (silu_out)
            for (long i = 0; i < m1 - m0; i++)
              silu_pair(pair[i], pair[i] + 16, silu_out + (m0 + i) * (N / 2) + 16 * unit);
        }
    }
    return;
  }
  bf16* xb = bf16_rows(x, M, K, ldx);
  long np = tile_panels(M, num_threads);
  /* Many rows (a prompt's): MB rows at a time, so that their inputs stay in L2 while every panel
     passes over them. */
  long MB = M_BLOCK_BYTES / (K * (long)sizeof(bf16));
  MB = MB < 4 ? 4 : MB - MB % 4;
  for (long mb = 0; mb < M; mb += MB) {
    long me = mb + MB < M ? mb + MB : M;
    /* Each thread an equal run of panels (its groups, then single panels): split by whole groups, a
       576-wide o or down projection (9 groups of 4) went 5:4, and two threads' 16-row linears took
       1-2% longer (alternated in one process, SmolLM2's 30 layers). */
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long part = 0; part < num_threads; part++) {
      struct side_cursor cursor = side_share(side, part, num_threads);
      for (long p0 = panels * part / num_threads, pe = panels * (part + 1) / num_threads; p0 < pe; p0 += np) {
        long pn = pe - p0 < np ? pe - p0 : np;
        for (long m0 = mb; m0 < me; m0 += 4) {
          long mr = me - m0 < 4 ? me - m0 : 4;
          for (long p = p0; p < p0 + (pn == np ? 1 : pn); p++) {
            long lines;
            const char* pf = side_take(&cursor, K, &lines);
            if (pn == np)
              (np == 8 ? VNNI8 : VNNI4)[mr](xb + m0 * K, K, pw + p0 * pstride, pstride, y + m0 * ldy + 16 * p0, ldy,
                                           N - 16 * p0, pf, lines);
            else
              VNNI1[mr](xb + m0 * K, K, pw + p * pstride, pstride, y + m0 * ldy + 16 * p, ldy, N - 16 * p, pf, lines);
          }
        }
      }
    }
  }
  free(xb);
}

void gemm_bf16_vnni(const float* x, long M, long K, long ldx, const bf16* pw, long N, float* y, long ldy,
                    int num_threads) {
  gemm_vnni_side(x, M, K, ldx, pw, N, y, ldy, num_threads, 0, 0);
}
#endif

/* The packed layout of gemm_bf16_vnni (plain C, built on every CPU; used where NATIVE_BF16 is). */
long bf16_vnni_elements(long N, long K) { return (N + 15) / 16 * 16 * K; }

/* W bf16 [N][K] (row stride ldw) -> out [(N + 15) / 16][K / 2][16][2] (padding rows zero); K even.
   One thread: it runs at load, on the loading thread, which must not start an OpenMP team of its own
   beside the engine loop's (see LLMEngine.__init__). */
void pack_bf16_vnni(const bf16* w, long N, long K, long ldw, bf16* out) {
  long panels = (N + 15) / 16;
  for (long p = 0; p < panels; p++)
    for (long kp = 0; kp < K / 2; kp++)
      for (long j = 0; j < 16; j++) {
        long n = 16 * p + j;
        bf16* o = out + ((p * (K / 2) + kp) * 16 + j) * 2;
        o[0] = n < N ? w[n * ldw + 2 * kp] : 0;
        o[1] = n < N ? w[n * ldw + 2 * kp + 1] : 0;
      }
}

/* Which way a bf16 linear computes for an input width K: 1 native bf16 dot products on packed
   weights (gemm_bf16_vnni, x rounded to bf16), 0 widening the weights to fp32 (gemv_bf16). */
int gemv_bf16_native_for(long K) {
#ifdef NATIVE_BF16
  return K % 32 == 0;
#else
  (void)K;
  return 0;
#endif
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T, W bf16 [N][K] (row stride ldw), each
   bf16 widened to fp32 (CPUs without bf16 dot products); K % 8 == 0. */
void gemv_bf16(const float* x, long M, long K, long ldx, const bf16* w, long N, long ldw, float* y, long ldy,
               int num_threads) {
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

/* x * sigmoid(x), 8 at a time, from e^-|x| (exp8 takes x <= 0): scalar expf per element cost a
   16-row SmolLM2 step on one thread ~2.5 ms (16 x 1,536 x 30 of them). */
static inline v8 silu8(v8 x) {
  v8 e = exp8((v8)((v8i)x | (v8i)(v8){-0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f}));     /* e^-|x| */
  v8 positive = 1.f / (1.f + e);                  /* sigmoid(|x|) */
  v8i negative = x < 0.f;
  return x * (v8)((negative & (v8i)(e * positive)) | (~negative & (v8i)positive));
}

/* act[16j + i] = silu(gate) * up of a (gate, up) pair of 16 columns: g and u, 16 floats each */
static inline void silu_pair(const float* g, const float* u, float* act) {
  for (int i = 0; i < 16; i += 8)
    *(v8u*)(act + i) = silu8(*(const v8u*)(g + i)) * *(const v8u*)(u + i);
}

/* One block's scores s[0, n) of one query head into the online softmax whose running max is *m and
   running sum *l: s becomes e^(s - new max), zero from n up to the next multiple of 8, and the
   factor the head's accumulated values must be scaled by is returned. (32-byte aligned s.) Where
   the running max stays (most blocks after the first few), the factor is 1 without a call to expf
   (e^0 is exactly 1) and the callers skip scaling by it: the same bits, and SmolLM2 bf16, 16
   sequences at 1,024 tokens, whole steps alternated in one process: 0.982x on one thread, 0.996x
   on two threads sharing an L3, 0.982x on two CCDs. */
static inline float online_softmax(float* s, long n, float* m, float* l) {
  long n8 = (n + 7) & ~7L;
  for (long t = n; t < n8; t++) s[t] = -INFINITY;
  v8 top = *(v8*)&s[0];
  for (long t = 8; t < n8; t += 8) { v8 x = *(v8*)&s[t]; top = (v8)_mm256_max_ps((__m256)top, (__m256)x); }
  float bm = top[0];
  for (int j = 1; j < 8; j++) bm = top[j] > bm ? top[j] : bm;
  float mn = bm > *m ? bm : *m, corr = mn == *m ? 1.f : expf(*m - mn);
  *m = mn;
  v8 sum = {0};
  for (long t = 0; t < n8; t += 8) {
    v8 e = exp8(*(v8*)&s[t] - mn);
    *(v8*)&s[t] = e;
    sum += e;
  }
  *l = *l * corr + (sum[0] + sum[1] + sum[2] + sum[3] + sum[4] + sum[5] + sum[6] + sum[7]);
  return corr;
}

/* The online-softmax state of one (row, kv head): acc[G][DV] v8, then m[G], then l[G]. */
struct attend_state { v8 acc[MAX_GROUP * 16]; float m[MAX_GROUP], l[MAX_GROUP]; };

/* One block of one (row, kv head): `G` query heads share its K/V ([n][8 * DV] each, in place);
   `DV` = head_dim / 8. The V update keeps G * DT accumulators in flight (DT 8-float slices of the
   head at a time): with one per query head, as at first, each was a chain of dependent FMAs one per
   token, and the kernel ran at the FMA's latency rather than at memory speed. */
#define LOAD_F32(p) (*(const v8u*)(p))
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
  for (int g = 0; g < G; g++) { \
    float corr = online_softmax(s[g], n, &st->m[g], &st->l[g]); \
    if (corr != 1.f) for (int d = 0; d < DV; d++) acc[g][d] *= corr; \
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
typedef void (*attend_t)(const float*, struct attend_state*, const void*, const void*, long, const char*, const char*);
#define PAIR(T, G) {attend_##T##_##G##_4, attend_##T##_##G##_8, attend_##T##_##G##_16}
#define PAIRS(T) {{0, 0, 0}, PAIR(T, 1), PAIR(T, 2), PAIR(T, 3), PAIR(T, 4), PAIR(T, 5), PAIR(T, 6), PAIR(T, 7), PAIR(T, 8)}
static const attend_t ATTENDS[MAX_GROUP + 1][3] = PAIRS(float);

/* Which (group, head_dim) pairs paged_attention serves; the caller falls back to torch otherwise. */
int paged_attention_supports(long group, long head_dim, long block_size) {
  return group >= 1 && group <= MAX_GROUP && (head_dim == 32 || head_dim == 64 || head_dim == 128)
         && block_size <= MAX_BLOCK;
}

/* The online-softmax states of `hn` kv heads (`group` query heads each) before their first block */
static void start_heads(struct attend_state* st, long hn, long group, long D) {
  for (long h = 0; h < hn; h++)
    for (long g = 0; g < group; g++) {
      st[h].m[g] = -INFINITY; st[h].l[g] = 0.f;
      for (long d = 0; d < D / 8; d++) st[h].acc[g * (D / 8) + d] = (v8){0};
    }
}

/* ... after their last: each query head's values divided by its sum, into out ([hn * group][D]) */
static void finish_heads(const struct attend_state* st, long hn, long group, long D, float* out) {
  for (long h = 0; h < hn; h++)
    for (long g = 0; g < group; g++) {
      float inv = 1.f / st[h].l[g];
      float* o = out + (h * group + g) * D;
      for (long d = 0; d < D / 8; d++) *(v8u*)(o + 8 * d) = st[h].acc[g * (D / 8) + d] * inv;
    }
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
    start_heads(st, hn, group, D);
    for (long start = 0, blk = 0; start < len; start += block_size, blk++) {
      long n = len - start < block_size ? len - start : block_size, base = table[blk] * block_stride;
      long next = start + block_size < len ? table[blk + 1] * block_stride : -1;
      for (long h = 0; h < hn; h++) {
        long head = (h0 + h) * block_size * D;
        attend(q + (h0 + h) * group * D, &st[h], k_base + (base + head) * item, v_base + (base + head) * item, n,
               next < 0 ? 0 : k_base + (next + head) * item, next < 0 ? 0 : v_base + (next + head) * item);
      }
    }
    finish_heads(st, hn, group, D, out + h0 * group * D);
  }
}

/* bf16 K/V (issue 25) sit in a block in "paired" layouts, so that every product is a vertical one:
   a head's K of one block is [D/2][block_size][2] (dimensions 2p and 2p+1 of consecutive tokens side
   by side: one 64-byte load holds that pair for 16 tokens) and its V is [block_size/2][D][2] (tokens
   2i and 2i+1 of each dimension side by side); block sizes are even. q.K then adds, per pair of
   dimensions, the pair's products to 16 tokens' scores at once, and p.V two tokens' products to 16
   dimensions at once: no sums across lanes. In the token-major layout this replaced, the scores' lane
   sums and V's interleaving shuffles took ~40% of the kernel's time. SmolLM2's 16 rows of 1,024
   tokens, all 30 layers, one thread, Zen 4, alternated in one process: 15.2 -> 11.0 ms with the K/V in
   L2, 22.3 -> 18.9 ms from memory (exp16 below then: 9.7 and 18.7). paired_kv.py is this layout for
   torch's paths. */
#define PK_LOOP_TOKENS 32

#ifdef NATIVE_BF16
/* With the CPU's bf16 dot products: q and the probabilities rounded to bf16 (as torch's bf16 attention
   rounds them), sums in fp32, the next block's K (V) of the head prefetched into L2 as this one's is
   read. pk_scores: s = q.K for G query heads (qp: their q as bf16 pairs, [G][D/2]), 32 tokens at a time
   (two chains of G dot products in flight), then the online softmax's update and the probabilities as
   bf16 for pk_values (zero past n). */
/* e^x of 16 lanes, x <= 0: 2^(x log2 e) as 2^n (vscalefps) times 2^r, |r| <= 1/2, by its Taylor
   polynomial to r^6 (relative error < 2e-7); exactly 0 below -87, as exp8 gives. A third of exp8's
   instructions per element: the softmax took ~25% of this kernel's time in exp8's 8 lanes. */
static inline __m512 exp16(__m512 x) {
  __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ), p, n);
}

/* online_softmax in 16 lanes (64-byte aligned s; padded with -inf to the next multiple of 16) */
static inline float online_softmax16(float* s, long n, float* m, float* l) {
  long n16 = (n + 15) & ~15L;
  for (long t = n; t < n16; t++) s[t] = -INFINITY;
  __m512 top = _mm512_load_ps(s);
  for (long t = 16; t < n16; t += 16) top = _mm512_max_ps(top, _mm512_load_ps(s + t));
  float bm = _mm512_reduce_max_ps(top);
  float mn = bm > *m ? bm : *m, corr = mn == *m ? 1.f : expf(*m - mn);
  *m = mn;
  __m512 sum = _mm512_setzero_ps(), shift = _mm512_set1_ps(mn);
  for (long t = 0; t < n16; t += 16) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_load_ps(s + t), shift));
    _mm512_store_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  *l = *l * corr + _mm512_reduce_add_ps(sum);
  return corr;
}

#define PK_NATIVE(G, D) \
static void pk_scores_##G##_##D(const int32_t* qp, struct attend_state* st, const bf16* K, long n, long bs, \
                                bf16* pbuf, const char* pf, long pf_lines) { \
  float s[G][MAX_BLOCK + 32] __attribute__((aligned(64))); \
  bf16 (*pb)[MAX_BLOCK + 32] = (bf16 (*)[MAX_BLOCK + 32])pbuf; \
  long steps = (n + PK_LOOP_TOKENS - 1) / PK_LOOP_TOKENS * (D / 2), per = pf ? (pf_lines + steps - 1) / steps : 0, done = 0; \
  for (long t = 0; t < n; t += PK_LOOP_TOKENS) { \
    long w = n - t; \
    __mmask16 m0 = w >= 16 ? 0xFFFF : (__mmask16)((1u << w) - 1); \
    __mmask16 m1 = w >= 32 ? 0xFFFF : w <= 16 ? 0 : (__mmask16)((1u << (w - 16)) - 1); \
    __m512 a0[G], a1[G]; \
    for (int g = 0; g < G; g++) { a0[g] = _mm512_setzero_ps(); a1[g] = _mm512_setzero_ps(); } \
    for (int p = 0; p < D / 2; p++) { \
      for (long i = 0; i < per && done < pf_lines; i++, done++) __builtin_prefetch(pf + 64 * done, 0, 2); \
      const bf16* run = K + (p * bs + t) * 2; \
      __m512bh k0 = (__m512bh)_mm512_maskz_loadu_epi32(m0, run), k1 = (__m512bh)_mm512_maskz_loadu_epi32(m1, run + 32); \
      for (int g = 0; g < G; g++) { \
        __m512bh qq = (__m512bh)_mm512_set1_epi32(qp[g * (D / 2) + p]); \
        a0[g] = _mm512_dpbf16_ps(a0[g], qq, k0); a1[g] = _mm512_dpbf16_ps(a1[g], qq, k1); \
      } \
    } \
    for (int g = 0; g < G; g++) { _mm512_store_ps(&s[g][t], a0[g]); _mm512_store_ps(&s[g][t + 16], a1[g]); } \
  } \
  long n16 = (n + 15) & ~15L, n32 = (n + 31) & ~31L; \
  for (int g = 0; g < G; g++) { \
    float corr = online_softmax16(s[g], n, &st->m[g], &st->l[g]); \
    if (corr != 1.f) for (int d = 0; d < D / 8; d++) st->acc[g * (D / 8) + d] *= corr; \
    for (long t = n16; t < n32; t++) s[g][t] = 0.f; \
    for (long t = 0; t < n32; t += 32) \
      _mm512_store_si512(&pb[g][t], (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(&s[g][t + 16]), _mm512_load_ps(&s[g][t]))); \
  } \
} \
/* acc[g][d] += p[t] V[t][d] + p[t+1] V[t+1][d], 16 dimensions a product; with n odd, the last pair's \
   second token is masked off (its slot may hold anything, and 0 * NaN is NaN). CB columns of 16 at a \
   time, so that G x CB sums stay in registers. */ \
static void pk_values_##G##_##D(struct attend_state* st, const bf16* V, long n, const bf16* pbuf, \
                                const char* pf, long pf_lines) { \
  enum { C = D / 16, CB = G * C <= 24 ? C : (24 / G < 1 ? 1 : 24 / G) }; \
  const int32_t (*pp)[(MAX_BLOCK + 32) / 2] = (const int32_t (*)[(MAX_BLOCK + 32) / 2])pbuf; \
  long per = pf ? (pf_lines + (n + 1) / 2 - 1) / ((n + 1) / 2) : 0, done = 0; \
  for (int c0 = 0; c0 < C; c0 += CB) { \
    int cn = C - c0 < CB ? C - c0 : CB; \
    __m512 acc[G][CB]; \
    for (int g = 0; g < G; g++) for (int c = 0; c < cn; c++) acc[g][c] = _mm512_loadu_ps((float*)st->acc + g * D + 16 * (c0 + c)); \
    for (long t = 0; t < n; t += 2) { \
      if (c0 == 0) for (long i = 0; i < per && done < pf_lines; i++, done++) __builtin_prefetch(pf + 64 * done, 0, 2); \
      const bf16* run = V + t * D + 32 * c0; \
      __mmask32 keep = t + 1 < n ? 0xFFFFFFFFu : 0x55555555u; \
      __m512bh v[CB]; \
      for (int c = 0; c < cn; c++) v[c] = (__m512bh)_mm512_maskz_loadu_epi16(keep, run + 32 * c); \
      for (int g = 0; g < G; g++) { \
        __m512bh p2 = (__m512bh)_mm512_set1_epi32(pp[g][t / 2]); \
        for (int c = 0; c < cn; c++) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], p2, v[c]); \
      } \
    } \
    for (int g = 0; g < G; g++) for (int c = 0; c < cn; c++) _mm512_storeu_ps((float*)st->acc + g * D + 16 * (c0 + c), acc[g][c]); \
  } \
}
#define PK_NATIVE_D(G) PK_NATIVE(G, 32) PK_NATIVE(G, 64) PK_NATIVE(G, 128)
PK_NATIVE_D(1) PK_NATIVE_D(2) PK_NATIVE_D(3) PK_NATIVE_D(4) PK_NATIVE_D(5) PK_NATIVE_D(6) PK_NATIVE_D(7) PK_NATIVE_D(8)
typedef void (*pk_scores_t)(const int32_t*, struct attend_state*, const bf16*, long, long, bf16*, const char*, long);
typedef void (*pk_values_t)(struct attend_state*, const bf16*, long, const bf16*, const char*, long);
#define PK_ROW(F, G) {F##_##G##_32, F##_##G##_64, F##_##G##_128}
#define PK_TABLE(F) {{0, 0, 0}, PK_ROW(F, 1), PK_ROW(F, 2), PK_ROW(F, 3), PK_ROW(F, 4), PK_ROW(F, 5), PK_ROW(F, 6), \
                     PK_ROW(F, 7), PK_ROW(F, 8)}
static const pk_scores_t PK_SCORES_FN[MAX_GROUP + 1][3] = PK_TABLE(pk_scores);
static const pk_values_t PK_VALUES_FN[MAX_GROUP + 1][3] = PK_TABLE(pk_values);

/* Query heads of kv heads [h0, h1) of one row over its `len` tokens of paired bf16 K/V: per block, the
   scores of every head the task owns (its K heads are one contiguous run), then their values.
   A task that reads every head of a block reads the block's whole range of the layer (K then V):
   where the next block is the adjacent one in the layer-major pool, the row's blocks are one stream,
   which the hardware prefetcher follows better than the software prefetch does a scattered next
   block (SmolLM2's paged attention alone, 16 rows at 1,024 tokens, one thread: adjacent blocks
   without software prefetch 0.74x the time of scattered blocks with it, 2026-12-05). */
static void attend_heads_paired(long group, long D, const float* q, float* out, long h0, long h1, const char* k_base,
                                const char* v_base, long block_stride, long block_size, const int64_t* table, long len) {
  long d = D == 32 ? 0 : D == 64 ? 1 : 2;
  pk_scores_t scores = PK_SCORES_FN[group][d];
  pk_values_t values = PK_VALUES_FN[group][d];
  struct attend_state st[HEADS_PER_PASS];
  bf16 probs[HEADS_PER_PASS][MAX_GROUP * (MAX_BLOCK + 32)] __attribute__((aligned(64)));
  int32_t qp[HEADS_PER_PASS][MAX_GROUP * 64] __attribute__((aligned(64)));    /* q as bf16 pairs */
  long item = sizeof(bf16), head_run = block_size * D, lines = head_run * item / 64;
  int whole = h0 == 0 && h1 * head_run * item == v_base - k_base && h1 <= HEADS_PER_PASS;
  for (; h0 < h1; h0 += HEADS_PER_PASS) {
    long hn = h1 - h0 < HEADS_PER_PASS ? h1 - h0 : HEADS_PER_PASS;
    start_heads(st, hn, group, D);
    for (long h = 0; h < hn; h++)
      for (long i = 0; i < group * D; i += 32)
        _mm512_store_si512(&qp[h][i / 2], (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + (h0 + h) * group * D + i + 16),
                                                                       _mm512_loadu_ps(q + (h0 + h) * group * D + i)));
    for (long start = 0, blk = 0; start < len; start += block_size, blk++) {
      long n = len - start < block_size ? len - start : block_size, base = table[blk] * block_stride;
      long next = start + block_size < len ? table[blk + 1] * block_stride : -1;
      if (whole && next >= 0 && next - base == block_stride && block_stride * item == 2 * (v_base - k_base))
        next = -1;                /* adjacent: the hardware streams it */
      for (long h = 0; h < hn; h++) {
        long head = base + (h0 + h) * head_run, ahead = next + (h0 + h) * head_run;
        scores(qp[h], &st[h], (const bf16*)(k_base + head * item), n, block_size, probs[h],
               next < 0 ? 0 : k_base + ahead * item, next < 0 ? 0 : lines);
      }
      for (long h = 0; h < hn; h++) {
        long head = base + (h0 + h) * head_run, ahead = next + (h0 + h) * head_run;
        values(&st[h], (const bf16*)(v_base + head * item), n, probs[h],
               next < 0 ? 0 : v_base + ahead * item, next < 0 ? 0 : lines);
      }
    }
    finish_heads(st, hn, group, D, out + h0 * group * D);
  }
}
#else
/* Without bf16 dot products (AVX2): each bf16 pair widened to two fp32 vectors by a shift and a mask
   (the even element is the 32-bit lane's low half), probabilities in fp32. */
static inline v8 pk_even(__m256i x) { return (v8)_mm256_slli_epi32(x, 16); }
static inline v8 pk_odd(__m256i x) { return (v8)_mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u)); }

static void pk_scores_widened(const float* q, long G, long D, struct attend_state* st, const bf16* K, long n, long bs,
                              float (*s)[MAX_BLOCK + 8]) {
  for (long g = 0; g < G; g++) {
    for (long t = 0; t < n; t += 16) {
      long w = n - t;
      __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(w < 8 ? w : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(w < 16 ? w - 8 : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      v8 e0 = {0}, o0 = {0}, e1 = {0}, o1 = {0};
      for (long p = 0; p < D / 2; p++) {
        const int* run = (const int*)(K + (p * bs + t) * 2);
        __m256i x0 = _mm256_maskload_epi32(run, m0), x1 = _mm256_maskload_epi32(run + 8, m1);
        v8 qe = (v8)_mm256_set1_ps(q[g * D + 2 * p]), qo = (v8)_mm256_set1_ps(q[g * D + 2 * p + 1]);
        e0 += qe * pk_even(x0); o0 += qo * pk_odd(x0); e1 += qe * pk_even(x1); o1 += qo * pk_odd(x1);
      }
      *(v8*)&s[g][t] = e0 + o0;
      if (t + 8 < n) *(v8*)&s[g][t + 8] = e1 + o1;
    }
    float corr = online_softmax(s[g], n, &st->m[g], &st->l[g]);
    if (corr != 1.f) for (long d = 0; d < D / 8; d++) st->acc[g * (D / 8) + d] *= corr;
  }
}

static void pk_values_widened(long G, long D, struct attend_state* st, const bf16* V, long n, float (*s)[MAX_BLOCK + 8]) {
  for (long g = 0; g < G; g++)
    for (long c = 0; c < D / 8; c++) {
      v8 acc = st->acc[g * (D / 8) + c], acc2 = {0};
      for (long t = 0; t < n; t += 2) {
        __m256i x = _mm256_loadu_si256((const __m256i*)(V + t * D + 16 * c));
        acc += (v8)_mm256_set1_ps(s[g][t]) * pk_even(x);
        if (t + 1 < n) acc2 += (v8)_mm256_set1_ps(s[g][t + 1]) * pk_odd(x);
      }
      st->acc[g * (D / 8) + c] = acc + acc2;
    }
}

static void attend_heads_paired(long group, long D, const float* q, float* out, long h0, long h1, const char* k_base,
                                const char* v_base, long block_stride, long block_size, const int64_t* table, long len) {
  struct attend_state st[HEADS_PER_PASS];
  float s[MAX_GROUP][MAX_BLOCK + 8] __attribute__((aligned(32)));
  long item = sizeof(bf16), head_run = block_size * D;
  for (; h0 < h1; h0 += HEADS_PER_PASS) {
    long hn = h1 - h0 < HEADS_PER_PASS ? h1 - h0 : HEADS_PER_PASS;
    start_heads(st, hn, group, D);
    for (long start = 0, blk = 0; start < len; start += block_size, blk++) {
      long n = len - start < block_size ? len - start : block_size, base = table[blk] * block_stride;
      for (long h = 0; h < hn; h++) {
        long head = base + (h0 + h) * head_run;
        pk_scores_widened(q + (h0 + h) * group * D, group, D, &st[h], (const bf16*)(k_base + head * item), n,
                          block_size, s);
        pk_values_widened(group, D, &st[h], (const bf16*)(v_base + head * item), n, s);
      }
    }
    finish_heads(st, hn, group, D, out + h0 * group * D);
  }
}
#endif

/* Attention of query rows over paged K/V read in place.
   q: [rows, heads, D] (already scaled), row stride ldq; out: [rows, heads, D], row stride ldo. Row r
   attends to the first row_len[r] tokens of sequence row_seq[r] (r itself if row_seq is NULL), whose
   blocks are block_tables[row_seq[r] * max_blocks ...]. */
static void attention(const float* q, long ldq, float* out, long ldo, long rows, long heads, long kv_heads, long D,
                      const char* k_base, const char* v_base, long item, long block_stride, long block_size,
                      const int64_t* block_tables, long max_blocks, const int64_t* row_seq,
                      const int64_t* row_len, int num_threads) {
  long group = heads / kv_heads;
  attend_t attend = ATTENDS[group][D == 32 ? 0 : D == 64 ? 1 : 2];
  long splits = (2L * num_threads + rows - 1) / rows;       /* tasks per row: ~2 per thread in all */
  splits = splits < 1 ? 1 : splits > kv_heads ? kv_heads : splits;
  if (num_threads == 1)
    splits = 1;               /* (a row's heads apart would read its blocks' ranges in parts) */
  #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (long task = 0; task < rows * splits; task++) {
    long r = task / splits, part = task % splits;
    const int64_t* table = block_tables + (row_seq ? row_seq[r] : r) * max_blocks;
    long h0 = kv_heads * part / splits, h1 = kv_heads * (part + 1) / splits;
    if (item == 2) {
      attend_heads_paired(group, D, q + r * ldq, out + r * ldo, h0, h1, k_base, v_base, block_stride, block_size, table,
                          row_len[r]);
      continue;
    }
    attend_heads(attend, group, D, q + r * ldq, out + r * ldo, h0, h1, k_base, v_base, item, block_stride, block_size,
                 table, row_len[r]);
  }
}

/* K/V elements of `item` bytes: 4 (fp32) or 2 (bf16) */
void paged_attention(const float* q, float* out, long rows, long heads, long kv_heads, long D,
                     const void* k_base, const void* v_base, long item, long block_stride, long block_size,
                     const int64_t* block_tables, long max_blocks, const int64_t* row_seq,
                     const int64_t* row_len, int num_threads) {
  attention(q, heads * D, out, heads * D, rows, heads, kv_heads, D, (const char*)k_base, (const char*)v_base,
            item, block_stride, block_size, block_tables, max_blocks, row_seq, row_len, num_threads);
}

/* ---- the small ops around them, fused: each torch op costs microseconds of dispatch, and a decode
   step of a 30-layer model runs about forty of them per layer ------------------------------------ */

/* out[r] = weight * x[r] / sqrt(mean(x[r]^2) + eps); with delta, first x[r] += delta[r] (residual). */
/* Row loops of decode_layer share threads from 4 rows. RoPE with the K/V store (~1 us a row; not its
   bf16 conversions, which 8 at a time changed nothing) and SiLU (the intermediate width) have real
   work per row (16 SmolLM2 sequences on two threads, whole steps alternated in one process:
   0.978-0.982x; 4 sequences 0.988x). The norms and the residual add have little, but what they
   read is half the other thread's (each linear's output columns), and across two CCDs each line of
   it waits ~170 ns for its core: shared by rows, the two threads wait side by side (0.973-0.989x
   across CCDs, 0.995-0.998x on one CCX, 4 sequences 0.996-1.002x; 2026-12-05). At 1-3 rows
   starting a team costs more than the loop. */
#define PAR_ROWS 4

static void rms_norm_rows(float* x, const float* delta, long rows, long dim, long ldx, long ld_delta,
                          const float* weight, float eps, float* out, int threads) {
  #pragma omp parallel for schedule(static) num_threads(threads) if(rows >= PAR_ROWS)
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

void rms_norm(float* x, const float* delta, long rows, long dim, long ldx, long ld_delta, const float* weight,
              float eps, float* out) {
  rms_norm_rows(x, delta, rows, dim, ldx, ld_delta, weight, eps, out, 1);
}

/* Rotate-half RoPE on every q and k head of each row of qkv ([T][q heads | kv heads | kv heads] x D,
   row stride ld) in place, with row t's angles in row positions[t] of cos/sin [*][D/2] (row t where
   positions is 0); then store each row's K and V at (slot_block, slot_offset) of the pool. */
static void rope_store(float* qkv, long T, long ld, long heads, long kv_heads, long D, const float* cos,
                       const float* sin, const int64_t* positions, char* k_base, char* v_base, long item,
                       long block_stride, long block_size, const int64_t* slot_block, const int64_t* slot_offset,
                       float q_scale, int threads) {
  long half = D / 2;
  #pragma omp parallel for schedule(static) num_threads(threads) if(T >= PAR_ROWS)
  for (long t = 0; t < T; t++) {
    float* row = qkv + t * ld;
    const float* c = cos + (positions ? positions[t] : t) * half;
    const float* s = sin + (positions ? positions[t] : t) * half;
    for (long h = 0; h < heads + kv_heads; h++) {
      float* x = row + h * D;
      float scale = h < heads ? q_scale : 1.f;        /* (after the rotation: the rounding of rotating, then scaling) */
      for (long i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        float r1 = x1 * c[i] - x2 * s[i], r2 = x2 * c[i] + x1 * s[i];
        x[i] = r1 * scale;
        x[i + half] = r2 * scale;
      }
    }
    long slot = slot_block[t] * block_stride + slot_offset[t] * D, off = slot_offset[t];
    for (long j = 0; j < kv_heads; j++) {
      const float* k = row + (heads + j) * D;
      const float* v = row + (heads + kv_heads + j) * D;
      long at = (slot + j * block_size * D) * item;
      if (item == 2) {          /* the paired layouts (above paged attention) */
        long run = (slot_block[t] * block_stride + j * block_size * D) * item;
        bf16 *kd = (bf16*)(k_base + run), *vd = (bf16*)(v_base + run) + (off / 2) * 2 * D + off % 2;
        for (long i = 0; i < D; i++) { kd[((i / 2) * block_size + off) * 2 + i % 2] = to_bf16(k[i]); vd[2 * i] = to_bf16(v[i]); }
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
  rope_store(qkv, T, ld, heads, kv_heads, D, cos_rows, sin_rows, 0, (char*)k_base, (char*)v_base, sizeof(float),
             block_stride, block_size, slot_block, slot_offset, 1.f, 1);
}

/* The index of each row's maximum (x [rows][n], row stride ld) into out: the first, as numpy's and
   torch's argmax give it, where a NaN counts as the maximum (the first NaN). Two passes over a row
   that the head has just written (in L2): the maximum, then where it first occurs. */
void argmax_rows(const float* x, long rows, long n, long ld, int64_t* out) {
  for (long r = 0; r < rows; r++) {
    const float* row = x + r * ld;
    __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) {
      __m256 v = _mm256_loadu_ps(row + i);
      best = _mm256_max_ps(best, v);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float top = -INFINITY, lanes[8];
    int has_nan = _mm256_movemask_ps(nan) != 0;
    _mm256_storeu_ps(lanes, best);
    for (int j = 0; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;
    for (long k = i; k < n; k++) { has_nan |= row[k] != row[k]; top = row[k] > top ? row[k] : top; }
    long at = 0;
    if (has_nan) {
      while (row[at] == row[at]) at++;
    } else {
      __m256 t = _mm256_set1_ps(top);
      for (at = 0; at + 8 <= n; at += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + at), t, _CMP_EQ_OQ));
        if (hit) { at += __builtin_ctz(hit); break; }
      }
      if (at + 8 > n)
        while (at < n && row[at] != top) at++;
    }
    out[r] = at;
  }
}

/* Rows `ids` of an embedding table [V][H] (bf16, item 2, or fp32, item 4) in fp32: out [rows][H].
   Returns 0, or 1 + the first row whose id lies outside [0, V) (nothing written). */
long embed_rows(const char* table, long item, long V, long H, const int64_t* ids, long rows, float* out) {
  for (long r = 0; r < rows; r++)
    if (ids[r] < 0 || ids[r] >= V)
      return 1 + r;
  for (long r = 0; r < rows; r++) {
    const char* row = table + ids[r] * H * item;
    for (long i = 0; i < H; i++)
      out[r * H + i] = item == 2 ? from_bf16(((const bf16*)row)[i]) : ((const float*)row)[i];
  }
  return 0;
}

/* ---- one decoder layer for a batch of decode rows (one new token per sequence), in one call ----
   A decode step of a small model is mostly a few dozen small operations per layer; issued from
   Python each costs microseconds of dispatch and an allocation (about 14 ms of a 66 ms SmolLM2 step
   on one AVX2 core, issue 12). Here the layer's norms, matmuls, RoPE, K/V store, attention, SiLU
   and residual adds run back to back on scratch memory. The per-op path stays for prefill. */
/* n columns (padded to cols); fp32 panels for gemm_packed, or bf16: `vnni` (packed for gemm_bf16_vnni,
   CPUs with bf16 dot products; an MLP's gate_up with its gate and up panels interleaved, see
   gemm_vnni_side) or else `rows`, the [n][K] weight itself, for gemv_bf16 */
struct packed { const float* panels; const bf16* rows; long cols, n; const float* bias; const bf16* vnni; };

struct decode_layer_weights {
  const float *norm1, *norm2; float eps1, eps2;
  struct packed qkv, o, gate_up, down;
  long hidden, heads, kv_heads, head_dim, intermediate;
  char* k_base; char* v_base; long kv_item;        /* this layer's K and V in the pool, elements of kv_item bytes */
  long block_stride, block_size;                   /* (in elements) */
  char* next_k_base;                               /* the next layer's K (0 for the last layer) */
  long layer_index;                                /* (0: no layer before it prefetched its K/V) */
};

struct decode_batch {
  long rows;
  const float *cos, *sin; long table_rows;          /* RoPE's angles of positions [0, table_rows), [*][head_dim / 2] */
  const int64_t *positions;                         /* each row's */
  const int64_t *slot_block, *slot_offset;          /* where each row's new K/V goes */
  const int64_t *block_tables; long max_blocks;     /* [rows][max_blocks] */
  const int64_t *lens;                              /* tokens each row attends to, its own included */
  float scale;
  int num_threads;
};

static void linear(const float* x, long M, long K, long ldx, const struct packed* w, float* y, int threads,
                   const struct side* side) {
#ifdef NATIVE_BF16
  if (w->vnni)
    gemm_vnni_side(x, M, K, ldx, w->vnni, w->n, y, w->cols, threads, side, 0);
  else
#endif
  if (w->rows)
    gemv_bf16(x, M, K, ldx, w->rows, w->n, K, y, w->cols, threads);
  else
    gemm_packed(x, M, K, ldx, w->panels, w->cols, y, w->cols, threads);
  if (w->bias)
    for (long r = 0; r < M; r++)
      for (long j = 0; j < w->n; j++) y[r * w->cols + j] += w->bias[j];
}

/* How many runs of `run_bytes` a linear's tiles prefetch, as gemm_vnni_side hands them out: a 4 x 4
   tile K lines, a column tile K / 2 / threads */
static long side_capacity(long M, long K, const struct packed* w, long run_bytes, int threads) {
  if (!w->vnni) return 0;
  long panels = (w->n + 15) / 16;
#ifdef NATIVE_BF16
  if (uses_columns(M))
    return panels * column_chunks(M) * (K / 2 / threads) * 64 / run_bytes;
#endif
  long np = tile_panels(M, threads), calls = (panels + np - 1) / np * ((M + 3) / 4);
  return calls * K * 64 / run_bytes;
}

#define SIDE_MIN_ROWS 4

/* act [T][I] = silu(gate) * up of h's gate_up projection (gu: scratch for it, [T][gate_up.cols]); a
   vnni gate_up has its gate and up panels interleaved (see gemm_vnni_side) */
static void mlp_activation(const float* h, long T, long H, const struct packed* w, long I, float* gu, float* act,
                           int threads, const struct side* side) {
#ifdef NATIVE_BF16
  if (w->vnni && uses_columns(T)) {
    gemm_vnni_side(h, T, H, H, w->vnni, w->n, 0, 0, threads, side, act);
    return;
  }
#endif
  linear(h, T, H, H, w, gu, threads, side);
  int paired = w->vnni != 0;
  #pragma omp parallel for schedule(static) num_threads(threads) if(T >= PAR_ROWS)
  for (long r = 0; r < T; r++) {
    const float* g = gu + r * w->cols;
    long i = 0;
    if (paired)
      for (; i < I; i += 16) silu_pair(g + 2 * i, g + 2 * i + 16, act + r * I + i);
    for (; i + 8 <= I; i += 8) *(v8u*)(act + r * I + i) = silu8(*(const v8u*)(g + i)) * *(const v8u*)(g + I + i);
    for (; i < I; i++) act[r * I + i] = g[i] / (1.f + expf(-g[i])) * g[I + i];
  }
}

/* Scratch: rows * (hidden + qkv.cols + heads * head_dim + o.cols + gate_up.cols + intermediate + down.cols)
   floats. Returns 0, or 1 + the first row whose position lies outside RoPE's table (nothing done). */
long decode_layer(const struct decode_layer_weights* L, const struct decode_batch* B, float* x, float* scratch) {
  long T = B->rows, H = L->hidden, D = L->head_dim, q_size = L->heads * D, I = L->intermediate;
  for (long r = 0; r < T; r++)
    if (B->positions[r] < 0 || B->positions[r] >= B->table_rows)
      return 1 + r;
  int threads = B->num_threads;
  float *h = scratch, *qkv = h + T * H, *att = qkv + T * L->qkv.cols, *o = att + T * q_size;
  float *gu = o + T * L->o.cols, *act = gu + T * L->gate_up.cols, *down = act + T * I;

  /* While the linears compute (at 16 rows and more, compute-bound: memory idles), they prefetch into
     L2, whence they fall to L3, the K/V the attentions will read: the layer's o, gate_up and down
     the next layer's from its first block on, the next layer's qkv the rest. A run is one (row,
     block) of a layer, K of every head then V; a prompt's rows (one sequence, growing lengths) count
     once, by their last. SmolLM2 bf16, 16 sequences at 1,024 tokens, whole decode steps alternated in
     one process: with 4 x 4 tiles 3.7-4.1% faster on one thread, 5.7-6.3% on two, 8 sequences 3.3%;
     with column tiles, which leave memory less idle, ~3% on either (see COLUMN). One sequence's
     linears are memory-bound: there it made no difference beyond the noise (0.986-1.021), so rows
     below SIDE_MIN_ROWS prefetch nothing. */
  long runs = 0, run_bytes = 2 * L->kv_heads * L->block_size * D * L->kv_item;
  int64_t* offsets = malloc(sizeof(int64_t) * (T * B->max_blocks + 1));
  for (long r = 0; r < (T >= SIDE_MIN_ROWS ? T : 0); r++) {
    const int64_t* table = B->block_tables + r * B->max_blocks;
    if (r + 1 < T && table[B->max_blocks] == table[0])
      continue;
    for (long b = 0; b < (B->lens[r] + L->block_size - 1) / L->block_size; b++)
      offsets[runs++] = table[b] * L->block_stride * L->kv_item;
  }
  long o_cap = side_capacity(T, q_size, &L->o, run_bytes, threads), gu_cap = side_capacity(T, H, &L->gate_up, run_bytes, threads);
  long qkv_cap = side_capacity(T, H, &L->qkv, run_bytes, threads);
  long ahead_cap = o_cap + gu_cap + side_capacity(T, I, &L->down, run_bytes, threads);
  long start = L->layer_index == 0 ? 0 : ahead_cap < runs ? ahead_cap : runs;     /* what the last layer left */
  struct side own = {L->k_base, offsets, start, start + qkv_cap < runs ? start + qkv_cap : runs, run_bytes};
  struct side next_o = {L->next_k_base, offsets, 0, o_cap < runs ? o_cap : runs, run_bytes};
  struct side next_gu = {L->next_k_base, offsets, next_o.end, next_o.end + gu_cap < runs ? next_o.end + gu_cap : runs,
                         run_bytes};
  struct side next_down = {L->next_k_base, offsets, next_gu.end, runs, run_bytes};
  int ahead = L->next_k_base != 0;

  rms_norm_rows(x, 0, T, H, H, 0, L->norm1, L->eps1, h, threads);
  linear(h, T, H, H, &L->qkv, qkv, threads, &own);
  rope_store(qkv, T, L->qkv.cols, L->heads, L->kv_heads, D, B->cos, B->sin, B->positions, L->k_base, L->v_base,
             L->kv_item, L->block_stride, L->block_size, B->slot_block, B->slot_offset, B->scale, threads);
  attention(qkv, L->qkv.cols, att, q_size, T, L->heads, L->kv_heads, D, L->k_base, L->v_base, L->kv_item,
            L->block_stride, L->block_size, B->block_tables, B->max_blocks, 0, B->lens, threads);
  linear(att, T, q_size, q_size, &L->o, o, threads, ahead ? &next_o : 0);
  rms_norm_rows(x, o, T, H, H, L->o.cols, L->norm2, L->eps2, h, threads);     /* x += o, h = norm(x) */
  mlp_activation(h, T, H, &L->gate_up, I, gu, act, threads, ahead ? &next_gu : 0);
  linear(act, T, I, I, &L->down, down, threads, ahead ? &next_down : 0);
  #pragma omp parallel for schedule(static) num_threads(threads) if(T >= PAR_ROWS)
  for (long r = 0; r < T; r++)
    for (long i = 0; i < H; i++) x[r * H + i] += down[r * L->down.cols + i];
  free(offsets);
  return 0;
}

/* The machine, not the model: how long a cache line written by one thread takes to reach another
   (ns, one way), two OpenMP threads handing a flag back and forth `n` times. Where two threads'
   cores share an L3 (one CCX) a line crosses in ~30-50 ns; a VM's two vCPUs may be placed on cores of
   two CCDs, ~170 ns, and the host moves them between the two within minutes. Two-thread decode
   steps differ with it (what the threads hand each other costs more; each has its own L3 and
   memory path), so the limit probe records it beside each round. -1 with fewer than two threads. */
static _Atomic long handoff_flag __attribute__((aligned(64)));
double core_handoff_ns(long n) {
  double started = 0, finished = 0;
  int team = 0;
  atomic_store(&handoff_flag, 0);
  #pragma omp parallel num_threads(2)
  {
    #pragma omp single
    team = omp_get_num_threads();
    if (team == 2 && omp_get_thread_num() == 0) {
      struct timespec t;
      clock_gettime(CLOCK_MONOTONIC, &t);
      started = t.tv_sec * 1e9 + t.tv_nsec;
      for (long i = 0; i < n; i++) {
        atomic_store(&handoff_flag, 2 * i + 1);
        while (atomic_load(&handoff_flag) != 2 * i + 2) {}
      }
      clock_gettime(CLOCK_MONOTONIC, &t);
      finished = t.tv_sec * 1e9 + t.tv_nsec;
    } else if (team == 2) {
      for (long i = 0; i < n; i++) {
        while (atomic_load(&handoff_flag) != 2 * i + 1) {}
        atomic_store(&handoff_flag, 2 * i + 2);
      }
    }
  }
  return team == 2 && n > 0 ? (finished - started) / n / 2 : -1;
}
