/* y = x @ W.T for bfloat16 x [M, K] and a dense row-major bfloat16 W [N, K] (an LM head, a streamed layer's matrix),
 * bfloat16 y [M, N], for the few rows of a decode step (an LM head's float32 logits, for any rows). See
 * kernels/native.py for why and when it runs.
 *
 * The weight is read in place, a tile of 16 output features (16 rows of W, in L1) at a time: for 4 rows of x and 4
 * features at once, 32 inputs of a feature's row are 16 bfloat16 pairs, multiplied with the same 32 inputs of each
 * row by AVX-512 BF16's dot product into 16 float32 partial sums, 16 sums in registers, 8 loads for 16 dot products;
 * a feature's partial sums add up once at the end of its row. Exact products summed in float32, each sum in the same
 * order whatever the rows around it, rounded to bfloat16 once, as torch's bfloat16 GEMM does, or kept in float32 (an
 * LM head's logits, whose near-ties bfloat16's rounding would make exact ties).
 */
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"
#include "team.h"

#define TILE 16 /* output features a task computes */
#define FB 4 /* features whose sums stay in registers together */
#define RB 4 /* rows whose sums stay in registers together */

/* R rows of x (k apart) by FB rows of W (k apart) over every chunk of 32 inputs: the partial sums into
 * out[row][f0 + feature]. Meanwhile lines first..last-1 of the next tile (`next`, NULL for none) are requested into
 * L2, a share per chunk: from memory the weight streams in while this tile computes. */
static inline __attribute__((always_inline)) void block(const uint16_t *x, const uint16_t *w, int64_t k,
                                                        int64_t chunks, const int R, __m512 out[RB][TILE], int f0,
                                                        const char *next, int64_t first, int64_t last) {
    const int64_t per_chunk = (last - first + chunks - 1) / chunks;
    __m512 acc[RB][FB];
    for (int i = 0; i < R; i++)
        for (int f = 0; f < FB; f++) acc[i][f] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        if (next != NULL)
            for (int64_t l = first + c * per_chunk; l < first + (c + 1) * per_chunk && l < last; l++)
                _mm_prefetch(next + l * 64, _MM_HINT_T1);
        __m512bh xv[RB];
        for (int i = 0; i < R; i++) xv[i] = (__m512bh)_mm512_loadu_si512(x + i * k + c * 32);
        for (int f = 0; f < FB; f++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + f * k + c * 32);
            for (int i = 0; i < R; i++) acc[i][f] = _mm512_dpbf16_ps(acc[i][f], wv, xv[i]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int f = 0; f < FB; f++) out[i][f0 + f] = acc[i][f];
}

/* x: [m, k] bf16; w: [n, k] bf16; y: [m, n] bf16, or float32 where f32. n % 16 == 0, k % 32 == 0. */
void bf16_mm(const uint16_t *x, const uint16_t *w, void *y, int64_t m, int64_t n, int64_t k, int f32, int threads) {
    const int64_t chunks = k / 32;
    team tm = team_begin(threads);
#pragma omp parallel num_threads(tm.threads)
    {
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < n / TILE; t++) {
            const uint16_t *wt = w + t * TILE * k;
            /* the next tile's lines, spread over this tile's blocks: where the hardware's prefetchers leave a tile's
             * first pass waiting on memory */
            const int64_t lines = TILE * k * 2 / 64, blocks = (m + RB - 1) / RB * (TILE / FB);
            const int64_t per_block = (lines + blocks - 1) / blocks;
            const char *next = t + 1 < n / TILE ? (const char *)(wt + TILE * k) : NULL;
            for (int64_t r0 = 0; r0 < m; r0 += RB) {
                __m512 sums[RB][TILE];
                const int64_t rows = m - r0 < RB ? m - r0 : RB;
                for (int f0 = 0; f0 < TILE; f0 += FB) {
                    const int64_t first = (r0 / RB * (TILE / FB) + f0 / FB) * per_block;
                    const int64_t last = first + per_block < lines ? first + per_block : lines;
                    const uint16_t *xr = x + r0 * k, *wf = wt + f0 * k;
                    if (rows == RB) /* R a constant in each call: the sums stay in registers */
                        block(xr, wf, k, chunks, RB, sums, f0, next, first, last);
                    else if (rows == 3)
                        block(xr, wf, k, chunks, 3, sums, f0, next, first, last);
                    else if (rows == 2)
                        block(xr, wf, k, chunks, 2, sums, f0, next, first, last);
                    else
                        block(xr, wf, k, chunks, 1, sums, f0, next, first, last);
                }
                for (int64_t i = 0; i < rows; i++) {
                    const __m512 s = sum16(sums[i]);
                    const int64_t r = r0 + i;
                    if (f32)
                        _mm512_storeu_ps((float *)y + r * n + t * TILE, s);
                    else
                        _mm256_storeu_si256((__m256i *)((uint16_t *)y + r * n + t * TILE),
                                            (__m256i)_mm512_cvtneps_pbh(s));
                }
            }
        }
        team_share_done(&tm);
    }
    team_end(&tm);
}
