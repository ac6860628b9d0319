/* GGUF's blocks as the C kernels read them (kernels/csrc/gguf_blocks.c, kernels/csrc/gguf_tiles.c): 32 values a
 * block along a row's inputs.
 *
 *     Q4_0  18 B: f16 d, 16 B of codes     w = d (q - 8)
 *     Q4_1  20 B: f16 d, f16 m, 16 B        w = d q + m
 *     Q8_0  34 B: f16 d, 32 int8 codes      w = d q
 *
 * Q4_0 and Q4_1 hold value j of a block in the low nibble of code byte j and value j + 16 in its high nibble. */
#ifndef OFFLOAD_GGUF_BLOCK_H
#define OFFLOAD_GGUF_BLOCK_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define QK 32 /* values a block */

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };
static const int64_t BLOCK_BYTES[3] = {18, 20, 34};

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* The table `decode` reads: bfloat16 of each nibble's value, indexed by a 16-bit lane's low 5 bits (exact). */
static inline __m512i nibble_table(int type) {
    uint16_t table[32];
    for (int q = 0; q < 32; q++) table[q] = float_to_bf16((float)((q & 15) - (type == Q4_0 ? 8 : 0)));
    return _mm512_loadu_si512(table);
}

/* A block's 32 codes as bfloat16: the table's value for each nibble (Q4_0: q - 8, Q4_1: q), Q8_0's int8 codes. */
static inline __m512bh decode(const uint8_t *b, int type, __m512i lut) {
    if (type == Q8_0) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2))));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18))));
        return _mm512_cvtne2ps_pbh(hi, lo); /* lanes 0-15 from lo */
    }
    const __m128i c = _mm_loadu_si128((const __m128i *)(b + (type == Q4_0 ? 2 : 4)));
    const __m128i low = _mm_and_si128(c, _mm_set1_epi8(15));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(c, 4), _mm_set1_epi8(15));
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm256_set_m128i(high, low)), lut);
}

#endif
