/* y = x @ W.T for bfloat16 x [M, K] and W [N, K] held as int4 codes in torch's CPU packing with per-group scales and
 * zero points (w = (q - 8) * scale + zero), bfloat16 y [M, N]. See kernels/native.py for why and when it runs.
 *
 * Torch's packing: per block of 64 output features, K rows of 32 bytes; byte j of row k holds feature j of the block
 * in its low nibble and feature j + 32 in its high one. The work is split in units of 16 output features (a quarter
 * of a block: 16 bytes of each row, one nibble of each). For each 32 inputs a unit's codes become 16 vectors of
 * bfloat16 pairs (q - 8 of inputs k and k + 1 for each of its 16 features; q - 8 is an integer in [-8, 7], exact in
 * bfloat16), decoded once and multiplied with every row's pairs of x by AVX-512 BF16's dot product into float32
 * (exact products, summed in float32). A group's scale and zero apply once per row and feature:
 * y += scale * sum((q - 8) * x) + zero * sum(x).
 */
#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"

#define UNIT 16 /* output features a unit computes */
#define BLOCK 64 /* output features in one block of torch's packing */
#define CHUNK 32 /* inputs decoded at a time: 16 pairs */
#define ROWS 64 /* rows of x a pass keeps partial sums for */
#define PREFETCH 2 /* groups ahead whose scales are requested */

static inline __m512 dot16(const __m512i *w, const uint32_t *x, int from) {
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    for (int p = from; p < from + 8; p += 2) {
        a = _mm512_dpbf16_ps(a, (__m512bh)w[p], (__m512bh)_mm512_set1_epi32((int)x[p]));
        b = _mm512_dpbf16_ps(b, (__m512bh)w[p + 1], (__m512bh)_mm512_set1_epi32((int)x[p + 1]));
    }
    return _mm512_add_ps(a, b);
}

/* x: [m, k] bf16; codes: [n / 64, k, 32] bytes; sz: [k / group, n, 2] bf16 (scale, zero); y: [m, n] bf16;
 * xsum: scratch [m, k / group] float32; threads: OpenMP threads (torch's count). n % 64 == 0, group % 32 == 0,
 * k % group == 0. */
void int4_mm_bf16(const uint16_t *x, const uint8_t *codes, const uint16_t *sz, uint16_t *y, int64_t m, int64_t n,
                  int64_t k, int64_t group, float *xsum, int threads) {
    const int64_t groups = k / group;
    /* serial: a few thousand values, where a second parallel region would cost another barrier */
    for (int64_t i = 0; i < m * groups; i++) {
        const uint16_t *xp = x + (i / groups) * k + (i % groups) * group;
        float s = 0.0f;
        for (int64_t j = 0; j < group; j++) s += bf16_to_float(xp[j]);
        xsum[i] = s;
    }
    uint16_t table[32]; /* bf16 of q - 8, indexed by a 16-bit lane holding q (0..15) */
    for (int q = 0; q < 32; q++) table[q] = float_to_bf16((float)((q & 15) - 8)); /* exact */
    const __m512i lut = _mm512_loadu_si512(table);
    /* byte indices that interleave inputs k (bytes 0..15) and k + 1 (bytes 16..31) feature by feature, each byte
     * into the low half of a 16-bit lane (the mask zeroes the high halves) */
    uint8_t spread[64];
    for (int i = 0; i < 64; i++) spread[i] = (uint8_t)(i % 2 == 0 ? (i / 4) + 16 * ((i / 2) % 2) : 0);
    const __m512i idx = _mm512_loadu_si512(spread);
    const __mmask64 even = 0x5555555555555555ULL;
    const int64_t units = n / (2 * UNIT); /* 32 features: both nibbles of 16 bytes of each row */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < units; u++) {
        const int64_t block = u / 2, half = u % 2; /* which 16 bytes of a block's rows */
        const int64_t first = block * BLOCK + half * UNIT; /* low nibbles: first..first+15; high: first+32.. */
        const uint8_t *rows = codes + block * k * 32 + half * 16;
        const __m512i mask = _mm512_set1_epi8(0x0F);
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
                for (int64_t r = 0; r < rn; r++) acc_g[0][r] = acc_g[1][r] = _mm512_setzero_ps();
                for (int64_t c = g * group; c < (g + 1) * group; c += CHUNK) {
                    for (int h = 0; h < 2; h++) { /* low nibbles, then high */
                        __m512i w[CHUNK / 2];
                        for (int p = 0; p < CHUNK / 2; p++) {
                            const uint8_t *at = rows + (c + 2 * p) * 32;
                            __m256i ab = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(at + 32)),
                                                          _mm_loadu_si128((const __m128i *)at));
                            __m512i v = _mm512_castsi256_si512(ab);
                            v = _mm512_and_si512(h ? _mm512_srli_epi16(v, 4) : v, mask);
                            w[p] = _mm512_permutexvar_epi16(_mm512_maskz_permutexvar_epi8(even, idx, v), lut);
                        }
                        for (int64_t r = 0; r < rn; r++) {
                            const uint32_t *xr = (const uint32_t *)(x + (r0 + r) * k + c);
                            acc_g[h][r] = _mm512_add_ps(acc_g[h][r], _mm512_add_ps(dot16(w, xr, 0), dot16(w, xr, 8)));
                        }
                    }
                }
                for (int h = 0; h < 2; h++) { /* the 16 features' (scale, zero) pairs: 32 bf16 -> two vectors */
                    __m512i pair = _mm512_loadu_si512(sz + (g * n + first + 32 * h) * 2);
                    __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
                    __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32((int)0xFFFF0000)));
                    for (int64_t r = 0; r < rn; r++) {
                        acc_y[h][r] = _mm512_fmadd_ps(scale, acc_g[h][r], acc_y[h][r]);
                        acc_y[h][r] =
                            _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum[(r0 + r) * groups + g]), acc_y[h][r]);
                    }
                }
            }
            for (int h = 0; h < 2; h++)
                for (int64_t r = 0; r < rn; r++)
                    _mm256_storeu_si256((__m256i *)(y + (r0 + r) * n + first + 32 * h),
                                        (__m256i)_mm512_cvtneps_pbh(acc_y[h][r]));
        }
    }
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
        uint16_t tile[CHUNK][BLOCK];
        float scale[BLOCK], zero[BLOCK];
        for (int64_t c = 0; c < k; c += CHUNK) {
            if (c % group == 0)
                for (int j = 0; j < BLOCK; j++) {
                    const uint16_t *pair = sz + ((c / group) * n + blk * BLOCK + j) * 2;
                    scale[j] = bf16_to_float(pair[0]);
                    zero[j] = bf16_to_float(pair[1]);
                }
            for (int i = 0; i < CHUNK; i++) {
                const uint8_t *row = rows + (c + i) * 32;
                for (int j = 0; j < 32; j++) {
                    tile[i][j] = float_to_bf16(__builtin_fmaf((float)((row[j] & 15) - 8), scale[j], zero[j]));
                    tile[i][j + 32] = float_to_bf16(__builtin_fmaf((float)((row[j] >> 4) - 8), scale[j + 32], zero[j + 32]));
                }
            }
            for (int j = 0; j < BLOCK; j++)
                for (int i = 0; i < CHUNK; i++) w[(blk * BLOCK + j) * k + c + i] = tile[i][j];
        }
    }
}
