/* GGUF's blocks multiplied on AMX tiles, where the CPU has them (kernels/csrc/gguf_block.h has the blocks' layout;
 * kernels/gguf_linear.py says when this runs).
 *
 * gguf_tiles_mm: y = x @ W.T as kernels/csrc/gguf_blocks.c's gguf_mm computes it, with the dot products on tiles.
 * Sixteen output features at a time: their blocks, CHUNK at a time, decoded into bfloat16 (q - 8, q or the int8
 * code: exact) as the rows of A tiles, one a block; x packed once, a tile's B operand a block of up to 16 of its rows
 * (pairs of inputs, as TDPBF16PS reads them). Each block's products (exact) are summed in float32 on the tile, the
 * 16 x 16 sums stored, and each feature's sums (a vector, one lane a row) scaled by its d and added to its total;
 * Q4_1's m multiplies the block's sum of inputs, kept apart and added at the end. Every row takes the same operations
 * in the same order whatever rows are beside it, so an output does not depend on the batch around it, and each
 * feature is computed whole by one thread: the same bits on any team. The sums are not gguf_mm's bits: a tile adds a
 * block's 16 pairs in order where AVX-512's dot product adds them lane by lane.
 *
 * A process may use tiles only once it asked the kernel for their state (`gguf_tiles_ready`, Linux's arch_prctl);
 * built for a CPU without them, this library says so and multiplies nothing.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_block.h"
#include "team.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux's arch_prctl request for an extended state's permission */
#define XFEATURE_XTILEDATA 18      /* ... and the tiles' state */
#define TF 16                      /* output features a tile computes: A's rows */
#define TR 16                      /* rows of x a tile computes at most: B's columns */
#define CHUNK 32                   /* blocks decoded at a time: 32 A tiles, 32 KiB, in the first-level cache */

#define C_TILE 0 /* the tiles by number: C 0-3, A 4-5, B 6-7 (the intrinsics take literals) */
#define A_TILE 4
#define B_TILE 6

/* block q's products into C tile cc from A tile aa and B tile bb (literal numbers) */
#define BLOCK_ON(cc, aa, bb, q)                                                                                        \
    do {                                                                                                               \
        _tile_loadd(aa, a + (q) * TF * QK, QK * 2);                                                                    \
        _tile_loadd(bb, xg + (b0 + (q)) * QK * R, R * 4);                                                              \
        _tile_zero(cc);                                                                                                \
        _tile_dpbf16ps(cc, aa, bb);                                                                                    \
    } while (0)

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* 1 when this process may use the tiles (asked once; the kernel grants it to the whole process), else 0 */
int gguf_tiles_ready(void) {
    static int ready = -1;
    if (ready < 0) ready = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ready;
}

/* this thread's tiles for `rows` rows of x: C 16 features x rows sums, A 16 features x one block, B one block's 16
 * pairs x rows */
static void configure(int rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) c.rows[C_TILE + t] = TF, c.colsb[C_TILE + t] = (uint16_t)(rows * 4);
    for (int t = 0; t < 2; t++) {
        c.rows[A_TILE + t] = TF, c.colsb[A_TILE + t] = QK * 2;
        c.rows[B_TILE + t] = QK / 2, c.colsb[B_TILE + t] = (uint16_t)(rows * 4);
    }
    _tile_loadconfig(&c);
}

/* x [m, k] as B tiles: group g (rows 16 g ...) at xp + 16 g k, its block b at 32 R b further, pair i of row r at
 * 2 (i R + r); and Q4_1's sums of each block's inputs, xs[(g nb + b) 16 + r] (0 beyond the group's rows) */
static void pack(const uint16_t *x, int type, int64_t m, int64_t k, uint16_t *xp, float *xs) {
    const int64_t nb = k / QK;
    for (int64_t r = 0; r < m; r++) {
        const int64_t g = r / TR, R = m - g * TR < TR ? m - g * TR : TR, c = r % TR;
        const uint16_t *src = x + r * k;
        uint16_t *dst = xp + g * TR * k;
        for (int64_t b = 0; b < nb; b++)
            for (int i = 0; i < QK / 2; i++) memcpy(dst + 2 * ((b * (QK / 2) + i) * R + c), src + b * QK + 2 * i, 4);
        if (type == Q4_1)
            for (int64_t b = 0; b < nb; b++) {
                const uint16_t *p = src + b * QK;
                const __m512 s = _mm512_add_ps(bf16x16_load(p, 0xFFFF), bf16x16_load(p + 16, 0xFFFF));
                xs[(g * nb + b) * TR + c] = _mm512_reduce_add_ps(s);
            }
    }
}

/* x: [m, k] bf16; w: [n, k / 32] blocks of `type`; y: [m, n] float32 (f32out) or bf16; xp: scratch of m k bf16;
 * xs: Q4_1's block sums, ceil(m / 16) (k / 32) 16 float32 zeroed (no other type reads it); threads: OpenMP
 * threads. k % 32 == 0.
 * Call only after gguf_tiles_ready() said 1. */
void gguf_tiles_mm(const uint16_t *x, const uint8_t *w, int type, void *y, int f32out, int64_t m, int64_t n,
                   int64_t k, uint16_t *xp, float *xs, int threads) {
    const int64_t nb = k / QK, bs = BLOCK_BYTES[type], row = nb * bs, groups = (m + TR - 1) / TR;
    pack(x, type, m, k, xp, xs);
    const __m512i lut = nibble_table(type);
    team t = team_begin(threads); /* one thread while another process holds a core (team.h) */
#pragma omp parallel num_threads(t.threads)
    {
        uint16_t *a = aligned_alloc(64, CHUNK * TF * QK * 2);          /* CHUNK A tiles */
        float *c = aligned_alloc(64, 4 * TF * TR * 4);                 /* four blocks' sums, read back */
        float *d = aligned_alloc(64, 2 * CHUNK * TF * 4);              /* each block's d (and Q4_1's m) */
        float *sums = aligned_alloc(64, (size_t)groups * 2 * TF * TR * 4); /* each group's totals, m's apart */
        memset(c, 0, 4 * TF * TR * 4); /* lanes beyond a group's rows are read and never used */
        int rows = 0;
#pragma omp for schedule(static) nowait
        for (int64_t tile = 0; tile < (n + TF - 1) / TF; tile++) {
            const int64_t j = tile * TF, nf = n - j < TF ? n - j : TF;
            memset(sums, 0, (size_t)groups * 2 * TF * TR * 4);
            for (int64_t b0 = 0; b0 < nb; b0 += CHUNK) {
                const int64_t nc = nb - b0 < CHUNK ? nb - b0 : CHUNK;
                for (int64_t f = 0; f < TF; f++)
                    for (int64_t q = 0; q < nc; q++) {
                        const uint8_t *blk = w + (j + f) * row + (b0 + q) * bs;
                        const int here = f < nf;
                        /* the same feature's next chunk: sixteen streams in short runs outrun the hardware's prefetch */
                        if (here) _mm_prefetch((const char *)(blk + CHUNK * bs), _MM_HINT_T0);
                        _mm512_store_si512(a + (q * TF + f) * QK, here ? (__m512i)decode(blk, type, lut)
                                                                       : _mm512_setzero_si512());
                        d[q * TF + f] = here ? f16_at(blk) : 0.0f;
                        d[(CHUNK + q) * TF + f] = here && type == Q4_1 ? f16_at(blk + 2) : 0.0f;
                    }
                for (int64_t g = 0; g < groups; g++) {
                    const int R = (int)(m - g * TR < TR ? m - g * TR : TR);
                    if (R != rows) configure(R), rows = R;
                    float *total = sums + g * 2 * TF * TR, *mins = total + TF * TR;
                    __m512 acc[TF];
                    for (int f = 0; f < TF; f++) acc[f] = _mm512_load_ps(total + f * TR);
                    const uint16_t *xg = xp + g * TR * k;
                    int64_t q = 0;
                    for (; q + 4 <= nc; q += 4) { /* four blocks' chains in flight: a tile's latency is long */
                        BLOCK_ON(0, 4, 6, q);
                        BLOCK_ON(1, 5, 7, q + 1);
                        BLOCK_ON(2, 4, 6, q + 2);
                        BLOCK_ON(3, 5, 7, q + 3);
                        _tile_stored(0, c, TR * 4);
                        _tile_stored(1, c + TF * TR, TR * 4);
                        _tile_stored(2, c + 2 * TF * TR, TR * 4);
                        _tile_stored(3, c + 3 * TF * TR, TR * 4);
                        for (int u = 0; u < 4; u++)
                            for (int f = 0; f < TF; f++)
                                acc[f] = _mm512_fmadd_ps(_mm512_load_ps(c + (u * TF + f) * TR),
                                                         _mm512_set1_ps(d[(q + u) * TF + f]), acc[f]);
                    }
                    for (; q < nc; q++) {
                        BLOCK_ON(0, 4, 6, q);
                        _tile_stored(0, c, TR * 4);
                        for (int f = 0; f < TF; f++)
                            acc[f] = _mm512_fmadd_ps(_mm512_load_ps(c + f * TR), _mm512_set1_ps(d[q * TF + f]), acc[f]);
                    }
                    for (int f = 0; f < TF; f++) _mm512_store_ps(total + f * TR, acc[f]);
                    if (type == Q4_1)
                        for (int64_t q = 0; q < nc; q++) {
                            const __m512 s = _mm512_loadu_ps(xs + (g * nb + b0 + q) * TR);
                            for (int f = 0; f < TF; f++) {
                                const __m512 v = _mm512_load_ps(mins + f * TR);
                                _mm512_store_ps(mins + f * TR,
                                                _mm512_fmadd_ps(_mm512_set1_ps(d[(CHUNK + q) * TF + f]), s, v));
                            }
                        }
                }
            }
            for (int64_t g = 0; g < groups; g++) {
                const float *total = sums + g * 2 * TF * TR, *mins = total + TF * TR;
                for (int64_t r = g * TR; r < m && r < (g + 1) * TR; r++)
                    for (int64_t f = 0; f < nf; f++) {
                        const float s = total[f * TR + r - g * TR] + mins[f * TR + r - g * TR];
                        if (f32out)
                            ((float *)y)[r * n + j + f] = s;
                        else
                            ((uint16_t *)y)[r * n + j + f] = float_to_bf16(s);
                    }
            }
        }
        if (rows) _tile_release();
        free(a), free(c), free(d), free(sums);
        team_share_done(&t);
    }
    team_end(&t);
}

#else /* built for a CPU without AMX's bfloat16 tiles */

int gguf_tiles_ready(void) { return 0; }

void gguf_tiles_mm(const uint16_t *x, const uint8_t *w, int type, void *y, int f32out, int64_t m, int64_t n,
                   int64_t k, uint16_t *xp, float *xs, int threads) {
    (void)x, (void)w, (void)type, (void)y, (void)f32out, (void)m, (void)n, (void)k, (void)xp, (void)xs, (void)threads;
}

#endif
