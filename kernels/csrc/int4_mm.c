/* y = x @ W.T for bfloat16 x [M, K] and W [N, K] held as int4 codes in torch's CPU packing with per-group scales and
 * zero points (w = (q - 8) * scale + zero), bfloat16 y [M, N]. See kernels/native.py for why and when it runs.
 *
 * Torch's packing: per block of 64 output features, K rows of 32 bytes; byte j of row k holds feature j of the block
 * in its low nibble and feature j + 32 in its high one. The work is split in units of 32 output features (16 bytes
 * of each row: 16 features in the low nibbles, 16 in the high). For each 16 inputs a unit's codes become 16 vectors
 * of bfloat16 pairs (q - 8 of inputs k and k + 1 for each of 16 features; q - 8 is an integer in [-8, 7], exact in
 * bfloat16), decoded once, held in registers and multiplied with every row's pairs of x by AVX-512 BF16's dot product
 * into float32 (exact products, summed in float32): four rows at a time, whose eight sums stay in registers as
 * independent chains, so that the dot products follow each other without waiting on one another. A group's scale
 * and zero apply once per row and feature, to the sums still in registers at the group's last chunk:
 * y += scale * sum((q - 8) * x) + zero * sum(x).
 */
#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"
#include "scratch.h"
#include "team.h"

#define UNIT 16 /* output features of one nibble of a unit's 16 bytes */
#define BLOCK 64 /* output features in one block of torch's packing */
#define CHUNK 16 /* inputs decoded at a time: 8 pairs, both nibbles */
#define PAIRS (CHUNK / 2)
#define TILE_INPUTS 32 /* inputs int4_dequant_bf16 decodes into a tile at a time */
#define ROWS 64 /* rows of x a pass keeps partial sums for */
#define RB 4 /* rows whose sums stay in registers together */
#define PREFETCH 2 /* groups ahead whose scales are requested */

/* A group's scale and zero for a unit's 16 low-nibble and 16 high-nibble features. */
typedef struct {
    __m512 scale[2], zero[2];
} group_sz;

/* R rows' partial sums over a chunk: lo/hi += (q - 8) * x pair by pair, in order, from zero at a group's first chunk
 * (`first`), else from `acc`; at its last (`sz` not NULL) y += scale * sums + zero * sum(x) straight from the
 * registers, else the sums back to `acc`. Every row takes the same order whether alone (R = 1) or in a block of RB,
 * so an output does not depend on the batch around it. x: the rows' pairs of inputs, `stride` pairs apart; xsum: the
 * rows' sums of x over the group, `groups` apart. */
static inline __attribute__((always_inline)) void chunk_rows(const __m512i *lo, const __m512i *hi, const uint32_t *x,
                                                             int64_t stride, const int R, int first, __m512 *acc_lo,
                                                             __m512 *acc_hi, const group_sz *sz, const float *xsum,
                                                             int64_t groups, __m512 *y_lo, __m512 *y_hi) {
    __m512 a[RB], b[RB];
    for (int i = 0; i < R; i++) {
        a[i] = first ? _mm512_setzero_ps() : acc_lo[i];
        b[i] = first ? _mm512_setzero_ps() : acc_hi[i];
    }
    for (int p = 0; p < PAIRS; p++)
        for (int i = 0; i < R; i++) {
            const __m512bh v = (__m512bh)_mm512_set1_epi32((int)x[i * stride + p]);
            a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)lo[p], v);
            b[i] = _mm512_dpbf16_ps(b[i], (__m512bh)hi[p], v);
        }
    for (int i = 0; i < R; i++) {
        if (sz == NULL) {
            acc_lo[i] = a[i], acc_hi[i] = b[i];
            continue;
        }
        const __m512 s = _mm512_set1_ps(xsum[i * groups]);
        y_lo[i] = _mm512_fmadd_ps(sz->zero[0], s, _mm512_fmadd_ps(sz->scale[0], a[i], y_lo[i]));
        y_hi[i] = _mm512_fmadd_ps(sz->zero[1], s, _mm512_fmadd_ps(sz->scale[1], b[i], y_hi[i]));
    }
}

/* x: [m, k] bf16; codes: [n / 64, k, 32] bytes; sz: [k / group, n, 2] bf16 (scale, zero); y: [m, n] bf16;
 * threads: OpenMP threads (torch's count). n % 64 == 0, group % 32 == 0, k % group == 0. Returns 0, or -1 where
 * the heap had no room for the scratch (scratch.h). */
int int4_mm_bf16(const uint16_t *x, const uint8_t *codes, const uint16_t *sz, uint16_t *y, int64_t m, int64_t n,
                 int64_t k, int64_t group, int threads) {
    const int64_t groups = k / group;
    _Alignas(64) unsigned char stack[STACK_SCRATCH];
    void *heap = NULL;
    float *xsum = scratch(stack, sizeof(float) * m * groups, &heap); /* [m, groups]: each group's sum of inputs */
    if (xsum == NULL) return -1;
    /* serial: a few thousand values, where a second parallel region would cost another barrier; 16 at a time, their
     * lanes summed in a tree */
    for (int64_t i = 0; i < m * groups; i++) {
        const uint16_t *xp = x + (i / groups) * k + (i % groups) * group;
        __m512 s = _mm512_setzero_ps();
        for (int64_t j = 0; j < group; j += 16) s = _mm512_add_ps(s, bf16x16_load(xp + j, 0xFFFF));
        xsum[i] = _mm512_reduce_add_ps(s);
    }
    uint16_t table[32]; /* bf16 of q - 8 for a 16-bit lane whose low 5 bits are q (0..15) or 16 + q */
    for (int q = 0; q < 32; q++) table[q] = float_to_bf16((float)((q & 15) - 8)); /* exact */
    const __m512i lut = _mm512_loadu_si512(table);
    const int64_t units = n / (2 * UNIT); /* 32 features: both nibbles of 16 bytes of each row */
    team t = team_begin(threads);
#pragma omp parallel num_threads(t.threads)
    {
#pragma omp for schedule(static) nowait
        for (int64_t u = 0; u < units; u++) {
            const int64_t block = u / 2, half = u % 2; /* which 16 bytes of a block's rows */
            const int64_t first = block * BLOCK + half * UNIT; /* low nibbles: first..first+15; high: first+32.. */
            const uint8_t *rows = codes + block * k * 32 + half * 16;
            __m512 acc_y[2][ROWS], acc_g[2][ROWS];
            for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
                const int64_t rn = m - r0 < ROWS ? m - r0 : ROWS;
                for (int64_t r = 0; r < rn; r++) acc_y[0][r] = acc_y[1][r] = _mm512_setzero_ps();
                for (int64_t g = 0; g < groups; g++) {
                    /* a later group's scales: a cache line each, a row of scales apart, which the hardware prefetcher
                     * does not follow */
                    if (g + PREFETCH < groups)
                        for (int h = 0; h < 2; h++)
                            _mm_prefetch((const char *)(sz + ((g + PREFETCH) * n + first + 32 * h) * 2), _MM_HINT_T0);
                    /* the next block's codes for this group, requested into L2 by a block's second unit (the first has
                     * read these rows' lines already): from memory they stream in while this block computes */
                    if (half == 1 && block + 1 < n / BLOCK && r0 == 0)
                        for (int64_t l = g * group * 32; l < (g + 1) * group * 32; l += 64)
                            _mm_prefetch((const char *)(codes + (block + 1) * k * 32 + l), _MM_HINT_T1);
                    group_sz gs; /* the 16 features' (scale, zero) pairs of each nibble: 32 bf16 -> two vectors */
                    for (int h = 0; h < 2; h++) {
                        const __m512i pair = _mm512_loadu_si512(sz + (g * n + first + 32 * h) * 2);
                        gs.scale[h] = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
                        gs.zero[h] = _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32((int)0xFFFF0000)));
                    }
                    for (int64_t c = g * group; c < (g + 1) * group; c += CHUNK) {
                        /* inputs k and k + 1 of the unit's 16 bytes interleaved byte by byte, each byte zero-extended
                         * to a 16-bit lane: its low nibble (with the high one's low bit, which the table ignores) and
                         * its high nibble index the table */
                        __m512i lo[PAIRS], hi[PAIRS];
                        for (int p = 0; p < PAIRS; p++) {
                            const uint8_t *at = rows + (c + 2 * p) * 32;
                            const __m128i a = _mm_loadu_si128((const __m128i *)at);
                            const __m128i b = _mm_loadu_si128((const __m128i *)(at + 32));
                            const __m512i v = _mm512_cvtepu8_epi16(
                                _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
                            lo[p] = _mm512_permutexvar_epi16(v, lut);
                            hi[p] = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), lut);
                        }
                        const uint32_t *xc = (const uint32_t *)(x + r0 * k + c);
                        const int start = c == g * group;
                        const group_sz *end = c + CHUNK == (g + 1) * group ? &gs : NULL;
                        const float *xs = xsum + r0 * groups + g;
                        int64_t r = 0;
                        for (; r + RB <= rn; r += RB)
                            chunk_rows(lo, hi, xc + r * (k / 2), k / 2, RB, start, acc_g[0] + r, acc_g[1] + r, end,
                                       xs + r * groups, groups, acc_y[0] + r, acc_y[1] + r);
                        for (; r < rn; r++)
                            chunk_rows(lo, hi, xc + r * (k / 2), k / 2, 1, start, acc_g[0] + r, acc_g[1] + r, end,
                                       xs + r * groups, groups, acc_y[0] + r, acc_y[1] + r);
                    }
                }
                for (int h = 0; h < 2; h++)
                    for (int64_t r = 0; r < rn; r++)
                        _mm256_storeu_si256((__m256i *)(y + (r0 + r) * n + first + 32 * h),
                                            (__m256i)_mm512_cvtneps_pbh(acc_y[h][r]));
            }
        }
        team_share_done(&t);
    }
    team_end(&t);
    free(heap);
    return 0;
}

/* W [n, k] in bfloat16 from int4 codes in torch's CPU packing: w = (q - 8) * scale + zero in float32 (one fused
 * multiply-add, as kernels/quant_linear.py's dequantize_cpu_int4), rounded to bfloat16 once. Each block of 64
 * features is decoded 32 inputs at a time into a tile [32 inputs][64 features] (one row of codes is 64 features of
 * one input), then written out transposed, a feature's 32 inputs at a time. group % 32 == 0, n % 64 == 0. */
void int4_dequant_bf16(const uint8_t *codes, const uint16_t *sz, uint16_t *w, int64_t n, int64_t k, int64_t group,
                       int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t blk = 0; blk < n / BLOCK; blk++) {
        const uint8_t *rows = codes + blk * k * 32;
        uint16_t tile[TILE_INPUTS][BLOCK];
        float scale[BLOCK], zero[BLOCK];
        for (int64_t c = 0; c < k; c += TILE_INPUTS) {
            if (c % group == 0)
                for (int j = 0; j < BLOCK; j++) {
                    const uint16_t *pair = sz + ((c / group) * n + blk * BLOCK + j) * 2;
                    scale[j] = bf16_to_float(pair[0]);
                    zero[j] = bf16_to_float(pair[1]);
                }
            for (int i = 0; i < TILE_INPUTS; i++) {
                const uint8_t *row = rows + (c + i) * 32;
                for (int j = 0; j < 32; j++) {
                    tile[i][j] = float_to_bf16(__builtin_fmaf((float)((row[j] & 15) - 8), scale[j], zero[j]));
                    const float high = (float)((row[j] >> 4) - 8);
                    tile[i][j + 32] = float_to_bf16(__builtin_fmaf(high, scale[j + 32], zero[j + 32]));
                }
            }
            for (int j = 0; j < BLOCK; j++)
                for (int i = 0; i < TILE_INPUTS; i++) w[(blk * BLOCK + j) * k + c + i] = tile[i][j];
        }
    }
}
