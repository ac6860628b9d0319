/* bfloat16 <-> float32 for the C kernels (kernels/native.py digests this header with each source). */
#ifndef OFFLOAD_BF16_H
#define OFFLOAD_BF16_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* to nearest, ties to even, as torch rounds */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* 16 bfloat16 values (the lanes of `m`; the others 0) as float32 */
static inline __m512 bf16x16_load(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* 16 float32 values rounded to bfloat16 as float_to_bf16 rounds them (denormals kept, unlike the hardware's
 * conversion), as float32 */
static inline __m512 bf16x16_round(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd); /* to nearest, ties to even */
    const __m512i nan = _mm512_or_si512(u, _mm512_set1_epi32(0x400000)); /* quiet, as float_to_bf16 keeps a NaN */
    const __m512i r = _mm512_mask_mov_epi32(_mm512_add_epi32(u, bias), _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), nan);
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000)));
}

/* the lanes of `m` of bf16x16_round(f), stored as bfloat16 */
static inline void bf16x16_store(uint16_t *p, __m512 f, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(bf16x16_round(f)), 16)));
}

#endif
