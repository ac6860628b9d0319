/* GGUF's own blocks multiplied and dequantized as they lie in the file: Q4_0, Q4_1 and Q8_0, 32 values a block along
 * a row's inputs (kernels/csrc/gguf_block.h has their layout; kernels/gguf_linear.py says when each kernel runs).
 *
 * gguf_mm: a block's 32 codes become one vector of bfloat16 (q - 8, q or the int8 code: exact in bfloat16), multiplied
 * with a row's 32 inputs by AVX-512 BF16's dot product into 16 float32 lanes (exact products), scaled by d and added
 * to the row's 16 sums; Q4_1's m multiplies the block's sum of inputs. A row's output is its lanes' sum, float32 or
 * rounded once to bfloat16. Q4_0's blocks go two at a time (`Q4_0 pairs` below). Every row takes the same
 * operations in the same order whatever rows are beside it, so an output does not depend on the batch around it.
 * Four output features are computed together (each block's inputs loaded once for them, sixteen independent sums in
 * registers), each by one thread: the same bits on any team.
 */
#include "gguf_block.h"
#include "scratch.h"
#include "team.h"

#define RB 4 /* rows whose sums stay in registers together */
#define FT 4 /* output features computed together */

/* Q4_0 pairs. Two blocks are one masked load of 36 bytes; their 32 code bytes, spread one to a 16-bit lane (vpermb),
 * give the low nibbles of both blocks by one permute through the nibble table and the high ones by another, and
 * their two d one vector (lanes 0-7 the first block's, 8-15 the second's): half the instructions a block that
 * decoding each block alone takes, which at one row made the product bound by them (60% of the rate these two
 * cores read memory at, on the 2-core AMD EPYC). The dot product adds a pair of inputs into a float32 lane, so
 * lanes 0-7 of both halves' products are the first block's and 8-15 the second's, the inputs arranged to match once
 * a call (`pair_inputs`); the products stay exact, summed in float32. A block left over (an odd count a row) goes
 * alone. Q4_1 stays a block at a time: as pairs it won at one and two rows (1.05-1.29x) and lost from three (0.86-0.96x
 * with m as scalars, 0.8x with m a vector of its own, which spilled the registers), and a prompt's rows take it. */
#define PAIR_BYTES 36 /* two Q4_0 blocks */

/* the pair's code bytes, one to a 16-bit lane's low byte (vpermb), and the words holding each block's d (vpermw) */
static const uint8_t PAIR_CODES[64] = {
    2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7, 0, 8, 0, 9, 0, 10, 0, 11, 0, 12, 0, 13, 0, 14, 0, 15, 0, 16, 0, 17, 0, 20, 0,
    21, 0, 22, 0, 23, 0, 24, 0, 25, 0, 26, 0, 27, 0, 28, 0, 29, 0, 30, 0, 31, 0, 32, 0, 33, 0, 34, 0, 35, 0
};
static const uint16_t PAIR_SCALES[32] = {
    0, 0, 0, 0, 0, 0, 0, 0, 9, 9, 9, 9, 9, 9, 9, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
};

/* x's rows with inputs 0-15, 32-47, 16-31, 48-63 of each 64 (two blocks), as the pairs' products take them */
static void pair_inputs(const uint16_t *x, int64_t m, int64_t k, uint16_t *xp) {
    const int64_t pairs = k / (2 * QK);
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *src = x + r * k;
        uint16_t *dst = xp + r * k;
        for (int64_t p = 0; p < pairs; p++) {
            const uint16_t *s = src + p * 2 * QK;
            uint16_t *o = dst + p * 2 * QK;
            memcpy(o, s, 32), memcpy(o + 16, s + 32, 32), memcpy(o + 32, s + 16, 32), memcpy(o + 48, s + 48, 32);
        }
        memcpy(dst + pairs * 2 * QK, src + pairs * 2 * QK, (size_t)(k - pairs * 2 * QK) * 2); /* a block alone */
    }
}

/* F output features (rows of blocks `wr`, `row` bytes apart) for R rows of x from r0: each block decoded once, each
 * row's inputs loaded once for the F features, F x R independent sums in registers. x: Q4_0's rows as pair_inputs
 * leaves them, the other types' as given */
static inline __attribute__((always_inline)) void features_rows(const uint16_t *x, const uint8_t *wr, int64_t row,
                                                                int type, __m512i lut, const float *xsum, void *y,
                                                                int f32out, int64_t r0, const int R, int64_t j,
                                                                const int F, int64_t n, int64_t k) {
    const int64_t nb = k / QK, bs = BLOCK_BYTES[type], pairs = type == Q4_0 ? nb / 2 : 0;
    const __m512i pair_codes = _mm512_loadu_si512(PAIR_CODES), pair_scales = _mm512_loadu_si512(PAIR_SCALES);
    __m512 acc[FT][RB];
    float mins[FT][RB];
    for (int f = 0; f < F; f++)
        for (int r = 0; r < R; r++) acc[f][r] = _mm512_setzero_ps(), mins[f][r] = 0.0f;
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh lo[FT], hi[FT];
        __m512 d[FT];
        for (int f = 0; f < F; f++) {
            const uint8_t *blk = wr + f * row + p * PAIR_BYTES;
            _mm_prefetch((const char *)(blk + F * row), _MM_HINT_T0); /* as below */
            const __m512i v = _mm512_maskz_loadu_epi8((1ull << PAIR_BYTES) - 1, blk);
            const __m512i codes = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, pair_codes, v);
            lo[f] = (__m512bh)_mm512_permutexvar_epi16(codes, lut); /* the table reads a lane's low 5 bits */
            hi[f] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), lut);
            d[f] = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(pair_scales, v)));
        }
        for (int r = 0; r < R; r++) {
            const uint16_t *xr = x + (r0 + r) * k + p * 2 * QK;
            const __m512bh xl = (__m512bh)_mm512_loadu_si512(xr), xh = (__m512bh)_mm512_loadu_si512(xr + 32);
            for (int f = 0; f < F; f++) {
                const __m512 t = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), lo[f], xl), hi[f], xh);
                acc[f][r] = _mm512_fmadd_ps(d[f], t, acc[f][r]);
            }
        }
    }
    for (int64_t b = 2 * pairs; b < nb; b++) {
        __m512bh w[FT];
        __m512 d[FT];
        for (int f = 0; f < F; f++) {
            const uint8_t *blk = wr + f * row + b * bs;
            /* the same place in the next features' rows: a thread's four streams outrun the hardware's prefetch
             * (one row through a 14336 x 4096 expert from memory: 9 GB/s without, 14 with, on the 2-core Xeon) */
            _mm_prefetch((const char *)(blk + F * row), _MM_HINT_T0);
            w[f] = decode(blk, type, lut);
            d[f] = _mm512_set1_ps(f16_at(blk));
        }
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (r0 + r) * k + b * QK);
            for (int f = 0; f < F; f++)
                acc[f][r] = _mm512_fmadd_ps(d[f], _mm512_dpbf16_ps(_mm512_setzero_ps(), w[f], xv), acc[f][r]);
        }
        if (type == Q4_1)
            for (int f = 0; f < F; f++) {
                const float m = f16_at(wr + f * row + b * bs + 2);
                for (int r = 0; r < R; r++) mins[f][r] += m * xsum[(r0 + r) * nb + b];
            }
    }
    for (int f = 0; f < F; f++)
        for (int r = 0; r < R; r++) {
            const float s = _mm512_reduce_add_ps(acc[f][r]) + mins[f][r];
            if (f32out)
                ((float *)y)[(r0 + r) * n + j + f] = s;
            else
                ((uint16_t *)y)[(r0 + r) * n + j + f] = float_to_bf16(s);
        }
}

/* F features from j for every row of x */
static inline __attribute__((always_inline)) void features(const uint16_t *x, const uint8_t *wr, int64_t row,
                                                           int type, __m512i lut, const float *xsum, void *y,
                                                           int f32out, int64_t m, int64_t j, const int F, int64_t n,
                                                           int64_t k) {
    int64_t r0 = 0;
    for (; r0 + RB <= m; r0 += RB) features_rows(x, wr, row, type, lut, xsum, y, f32out, r0, RB, j, F, n, k);
    switch (m - r0) { /* the last rows in one pass too: each block decoded once for them */
    case 3: features_rows(x, wr, row, type, lut, xsum, y, f32out, r0, 3, j, F, n, k); break;
    case 2: features_rows(x, wr, row, type, lut, xsum, y, f32out, r0, 2, j, F, n, k); break;
    case 1: features_rows(x, wr, row, type, lut, xsum, y, f32out, r0, 1, j, F, n, k); break;
    }
}

/* x: [m, k] bf16; w: [n, k / 32] blocks of `type`; y: [m, n] float32 (f32out) or bf16; threads: OpenMP threads
 * (torch's count). k % 32 == 0. Returns 0, or -1 where the heap had no room for the scratch (scratch.h). */
int gguf_mm(const uint16_t *x, const uint8_t *w, int type, void *y, int f32out, int64_t m, int64_t n, int64_t k,
            int threads) {
    const int64_t nb = k / QK, row = nb * BLOCK_BYTES[type];
    /* Q4_1: [m, k / 32] float32, the sums of each block's inputs; Q4_0: [m, k] bf16, its rows as its pairs take
     * them; Q8_0: none */
    const size_t bytes = type == Q4_1 ? sizeof(float) * m * nb : type == Q4_0 ? sizeof(uint16_t) * m * k : 0;
    _Alignas(64) unsigned char stack[STACK_SCRATCH];
    void *heap = NULL, *rows = scratch(stack, bytes, &heap);
    if (rows == NULL && bytes > 0) return -1;
    float *xsum = rows;
    uint16_t *xp = rows;
    if (type == Q4_1)
        for (int64_t i = 0; i < m * nb; i++) {
            const uint16_t *xb = x + (i / nb) * k + (i % nb) * QK;
            xsum[i] = _mm512_reduce_add_ps(_mm512_add_ps(bf16x16_load(xb, 0xFFFF), bf16x16_load(xb + 16, 0xFFFF)));
        }
    if (type == Q4_0) pair_inputs(x, m, k, xp), x = xp;
    const __m512i lut = nibble_table(type);
    team t = team_begin(threads); /* one thread while another process holds a core (team.h) */
#pragma omp parallel num_threads(t.threads)
    {
#pragma omp for schedule(static) nowait
        for (int64_t tile = 0; tile < (n + FT - 1) / FT; tile++) {
            const int64_t j = tile * FT;
            if (j + FT <= n)
                features(x, w + j * row, row, type, lut, xsum, y, f32out, m, j, FT, n, k);
            else
                for (int64_t f = j; f < n; f++)
                    features(x, w + f * row, row, type, lut, xsum, y, f32out, m, f, 1, n, k);
        }
        team_share_done(&t);
    }
    team_end(&t);
    free(heap);
    return 0;
}

/* W [n, k] in bfloat16 from blocks of `type`: each value in float32 (Q4_0: d (q - 8), Q8_0: d q, both exact; Q4_1:
 * d q + m rounded once), then rounded to bfloat16, as kernels/gguf_linear.py's dequantize_ref(...).to(bfloat16). */
void gguf_dequant_bf16(const uint8_t *w, int type, uint16_t *out, int64_t n, int64_t k, int threads) {
    const int64_t nb = k / QK, bs = BLOCK_BYTES[type];
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t j = 0; j < n; j++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + (j * nb + b) * bs;
            const __m512 d = _mm512_set1_ps(f16_at(blk));
            __m512 v[2];
            if (type == Q8_0) {
                for (int h = 0; h < 2; h++) {
                    const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 2 + 16 * h));
                    v[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
                }
            } else {
                const __m128i c = _mm_loadu_si128((const __m128i *)(blk + (type == Q4_0 ? 2 : 4)));
                const __m128i nib[2] = {_mm_and_si128(c, _mm_set1_epi8(15)),
                                        _mm_and_si128(_mm_srli_epi16(c, 4), _mm_set1_epi8(15))};
                for (int h = 0; h < 2; h++) {
                    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nib[h]));
                    v[h] = type == Q4_0 ? _mm512_mul_ps(_mm512_sub_ps(q, _mm512_set1_ps(8.0f)), d)
                                        : _mm512_fmadd_ps(q, d, _mm512_set1_ps(f16_at(blk + 2)));
                }
            }
            bf16x16_store(out + j * k + b * QK, v[0], 0xFFFF);
            bf16x16_store(out + j * k + b * QK + 16, v[1], 0xFFFF);
        }
}
