/* Attention of one query per sequence over its paged KV cache, bfloat16 in and out, for a decode step on the CPU.
 * See kernels/native.py for when it runs.
 *
 * A task is one sequence and one KV head: the query heads sharing that head score every visible key (AVX-512 BF16 dot
 * products: exact products summed in float32), take the softmax in float32 (exp by range reduction and a polynomial,
 * within 2 float32 ulps), and sum the values weighted by it in float32; the output is rounded to bfloat16 once. The
 * keys and values are read in place through the block table: nothing is gathered.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "exp16.h"

#define MAX_GROUP 16 /* query heads per KV head */
#define MAX_DIM 256 /* head size */

static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* q: [n, hq, d] bf16, the queries in their sequences' order; k, v: [blocks, block_size, hkv, d] bf16; tables:
 * [n, width] int32 block ids; lens: [n] int32 context lengths (the query at lens - 1); starts: [n] int32 first position attended (a
 * window's start, else 0); out: [n, hq, d] bf16; scores: scratch of n * hkv * (hq / hkv) * max(lens) floats.
 * d % 32 == 0, d <= MAX_DIM, hq / hkv <= MAX_GROUP. */
void decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int32_t *tables,
                           int64_t width, const int32_t *lens, const int32_t *starts, uint16_t *out, int64_t n,
                           int64_t hq, int64_t hkv, int64_t d, int64_t block_size, float scale, float *scores,
                           int64_t max_len, int threads) {
    const int64_t group = hq / hkv, vecs = d / 16;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < n * hkv; task++) {
        const int64_t s = task / hkv, h = task % hkv, len = lens[s], start = starts[s], count = len - start;
        const int32_t *table = tables + s * width;
        float *sc = scores + task * group * max_len; /* [group, count] */
        __m512bh qv[MAX_GROUP][MAX_DIM / 32];
        for (int64_t g = 0; g < group; g++)
            for (int64_t c = 0; c < d / 32; c++)
                qv[g][c] = (__m512bh)_mm512_loadu_si512(q + (s * hq + h * group + g) * d + c * 32);
        float best[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) best[g] = -INFINITY;
        for (int64_t t = start; t < len; t++) {
            const uint16_t *kt = k + ((table[t / block_size] * block_size + t % block_size) * hkv + h) * d;
            __m512bh kv[MAX_DIM / 32];
            for (int64_t c = 0; c < d / 32; c++) kv[c] = (__m512bh)_mm512_loadu_si512(kt + c * 32);
            for (int64_t g = 0; g < group; g++) {
                __m512 acc = _mm512_setzero_ps();
                for (int64_t c = 0; c < d / 32; c++) acc = _mm512_dpbf16_ps(acc, kv[c], qv[g][c]);
                float x = _mm512_reduce_add_ps(acc) * scale;
                sc[g * count + (t - start)] = x;
                best[g] = x > best[g] ? x : best[g];
            }
        }
        __m512 o[MAX_GROUP][MAX_DIM / 16];
        float total[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) {
            float *row = sc + g * count;
            __m512 sum = _mm512_setzero_ps(), top = _mm512_set1_ps(best[g]);
            int64_t i = 0;
            for (; i + 16 <= count; i += 16) {
                __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + i), top));
                _mm512_storeu_ps(row + i, e);
                sum = _mm512_add_ps(sum, e);
            }
            if (i < count) {
                __mmask16 m = (__mmask16)((1u << (count - i)) - 1);
                __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + i), top));
                _mm512_mask_storeu_ps(row + i, m, e);
                sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
            }
            total[g] = _mm512_reduce_add_ps(sum);
            for (int64_t c = 0; c < vecs; c++) o[g][c] = _mm512_setzero_ps();
        }
        for (int64_t t = start; t < len; t++) {
            const uint16_t *vt = v + ((table[t / block_size] * block_size + t % block_size) * hkv + h) * d;
            __m512 vv[MAX_DIM / 16];
            for (int64_t c = 0; c < vecs; c++) vv[c] = bf16x16_to_f32(vt + c * 16);
            for (int64_t g = 0; g < group; g++) {
                __m512 p = _mm512_set1_ps(sc[g * count + (t - start)]);
                for (int64_t c = 0; c < vecs; c++) o[g][c] = _mm512_fmadd_ps(p, vv[c], o[g][c]);
            }
        }
        for (int64_t g = 0; g < group; g++) {
            __m512 inv = _mm512_set1_ps(1.0f / total[g]);
            uint16_t *dst = out + (s * hq + h * group + g) * d;
            for (int64_t c = 0; c < vecs; c++)
                _mm256_storeu_si256((__m256i *)(dst + c * 16), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[g][c], inv)));
        }
    }
}
