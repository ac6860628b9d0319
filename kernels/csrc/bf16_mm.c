/* y = x @ W.T for bfloat16 x [M, K] and a dense row-major bfloat16 W [N, K] (an LM head, a streamed layer's matrix),
 * bfloat16 y [M, N], for the few rows of a decode step. See kernels/native.py for why and when it runs.
 *
 * The weight is read in place, tiles of 16 output features at a time (16 rows of W, in L1 while every row of x
 * passes over them): 32 inputs of a feature's row are 16 bfloat16 pairs, multiplied with the same 32 inputs of x
 * by AVX-512 BF16's dot product into 16 float32 partial sums, which add up once per feature at the end of its row.
 * Exact products summed in float32, rounded to bfloat16 once, as torch's bfloat16 GEMM does, or kept in float32 (an
 * LM head's logits, whose near-ties bfloat16's rounding would make exact ties).
 */
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"

#define TILE 16 /* output features a task computes */

/* x: [m, k] bf16; w: [n, k] bf16; y: [m, n] bf16, or float32 where f32. n % 16 == 0, k % 32 == 0. */
void bf16_mm(const uint16_t *x, const uint16_t *w, void *y, int64_t m, int64_t n, int64_t k, int f32, int threads) {
    const int64_t chunks = k / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < n / TILE; t++) {
        const uint16_t *wt = w + t * TILE * k;
        /* the next tile's weight, requested into L2 a share per row of x: from memory it streams in while this tile
         * computes, where the hardware's prefetchers leave a tile's first pass waiting on it */
        const int64_t lines = TILE * k * 2 / 64, per_row = (lines + m - 1) / m;
        const char *next = (const char *)(wt + TILE * k);
        for (int64_t r = 0; r < m; r++) {
            if (t + 1 < n / TILE)
                for (int64_t l = r * per_row; l < (r + 1) * per_row && l < lines; l++)
                    _mm_prefetch(next + l * 64, _MM_HINT_T1);
            const uint16_t *xr = x + r * k;
            __m512 acc[TILE];
            for (int f = 0; f < TILE; f++) acc[f] = _mm512_setzero_ps();
            for (int64_t c = 0; c < chunks; c++) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + c * 32);
                for (int f = 0; f < TILE; f++)
                    acc[f] = _mm512_dpbf16_ps(acc[f], (__m512bh)_mm512_loadu_si512(wt + f * k + c * 32), xv);
            }
            const __m512 sums = sum16(acc);
            if (f32)
                _mm512_storeu_ps((float *)y + r * n + t * TILE, sums);
            else
                _mm256_storeu_si256((__m256i *)((uint16_t *)y + r * n + t * TILE), (__m256i)_mm512_cvtneps_pbh(sums));
        }
    }
}
