/* Per-row operations on bfloat16 rows, vectorized, split over threads where there are many rows (a prefill's) and on
 * one where there are few (a decode step's: microseconds, less than a parallel region's start). See
 * kernels/native.py for when they run.
 *
 * RMSNorm with the residual add, in kernels/rms_norm.py's numerics (its module docstring):
 *
 *     h      = x + residual                       rounded to bfloat16 once
 *     normed = h * (1 / sqrt(mean(h^2) + eps))    in float32, rounded to bfloat16
 *     out    = weight * normed                    exact in float32, rounded to bfloat16 once
 *
 * Only the order of the float32 sum of squares differs from torch's.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "simd.h"

/* x, residual (or NULL), out, h: [rows, hidden] bf16, contiguous; weight: [hidden] bf16. h: x + residual (unused
 * where residual is NULL). Rows split over `threads` OpenMP threads where there are more than `serial`. */
void rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *out, uint16_t *h,
                   int64_t rows, int64_t hidden, float eps, int64_t serial, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > serial)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * hidden;
        const uint16_t *src = xr; /* the row normalized: x, or x + residual rounded to bfloat16 once */
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < hidden; j += 16) {
            const __mmask16 m = first_lanes(hidden - j);
            __m512 v = bf16x16_load(xr + j, m);
            if (residual != NULL) {
                v = bf16x16_round(_mm512_add_ps(v, bf16x16_load(residual + r * hidden + j, m)));
                bf16x16_store(h + r * hidden + j, v, m);
            }
            sum = _mm512_add_ps(sum, _mm512_mul_ps(v, v)); /* each square rounded, as torch's pow */
        }
        if (residual != NULL) src = h + r * hidden;
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sum) / (float)hidden + eps));
        for (int64_t j = 0; j < hidden; j += 16) {
            const __mmask16 m = first_lanes(hidden - j);
            const __m512 normed = bf16x16_round(_mm512_mul_ps(bf16x16_load(src + j, m), inv));
            bf16x16_store(out + r * hidden + j, _mm512_mul_ps(bf16x16_load(weight + j, m), normed), m);
        }
    }
}

/* Rotary embedding of bfloat16 heads in kernels/rotary.py's torch numerics, each product and the sum rounded to
 * bfloat16 as torch's ops round them: out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1).
 * x: [tokens, heads, d], rows of d contiguous, strides sx0, sx1 (elements); cos, sin: [tokens, d], rows sc0 apart;
 * out: [tokens, heads, d] contiguous. d even. Tokens split over `threads` OpenMP threads where there are more than
 * `serial`. */
void rotary_bf16(const uint16_t *x, int64_t sx0, int64_t sx1, const uint16_t *cos, const uint16_t *sin, int64_t sc0,
                 uint16_t *out, int64_t tokens, int64_t heads, int64_t d, int64_t serial, int threads) {
    const int64_t half = d / 2;
    const __m512 flip = _mm512_set1_ps(-0.0f);
#pragma omp parallel for schedule(static) num_threads(threads) if (tokens > serial)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos + t * sc0, *s = sin + t * sc0;
        for (int64_t hd = 0; hd < heads; hd++) {
            const uint16_t *xr = x + t * sx0 + hd * sx1;
            uint16_t *o = out + (t * heads + hd) * d;
            for (int64_t j = 0; j < half; j += 16) { /* j: a lane of the first half, j + half its partner */
                const __mmask16 m = first_lanes(half - j);
                const __m512 x1 = bf16x16_load(xr + j, m), x2 = bf16x16_load(xr + half + j, m);
                const __m512 c1 = bf16x16_load(c + j, m), c2 = bf16x16_load(c + half + j, m);
                const __m512 s1 = bf16x16_load(s + j, m), s2 = bf16x16_load(s + half + j, m);
                const __m512 lo = _mm512_add_ps(bf16x16_round(_mm512_mul_ps(x1, c1)),
                                                bf16x16_round(_mm512_mul_ps(_mm512_xor_ps(x2, flip), s1)));
                const __m512 hi =
                    _mm512_add_ps(bf16x16_round(_mm512_mul_ps(x2, c2)), bf16x16_round(_mm512_mul_ps(x1, s2)));
                bf16x16_store(o + j, lo, m);
                bf16x16_store(o + half + j, hi, m);
            }
        }
    }
}

/* SwiGLU's product silu(gate) * up in F.silu(gate) * up's roundings: silu(g) = g / (1 + e^-g) in float32 (e^x within
 * 2 float32 ulps of the exact value, where torch's is within 1), rounded to bfloat16, times up exactly in float32,
 * rounded to bfloat16 once. gate, up: [rows, n] with rows sg and su elements apart, each row contiguous; out: [rows,
 * n] contiguous. Rows split over `threads` OpenMP threads where there are more than `serial` values. */
void silu_mul_bf16(const uint16_t *gate, int64_t sg, const uint16_t *up, int64_t su, uint16_t *out, int64_t rows,
                   int64_t n, int64_t serial, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * n > serial)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate + r * sg, *u = up + r * su;
        uint16_t *o = out + r * n;
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 m = first_lanes(n - j);
            const __m512 x = bf16x16_load(g + j, m);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            bf16x16_store(o + j, _mm512_mul_ps(bf16x16_round(silu), bf16x16_load(u + j, m)), m);
        }
    }
}

/* The index of each float32 row's largest value, the first where several are, as torch's argmax names it; -1 for a
 * row holding a NaN (torch's argmax names the NaN: the caller asks torch for those). x: [rows, n], rows `stride`
 * elements apart; out: [rows]. Rows split over `threads` OpenMP threads where there are more than `serial` values.
 * Returns how many rows hold a NaN. */
int64_t argmax_f32(const float *x, int64_t stride, int64_t *out, int64_t rows, int64_t n, int64_t serial, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * n > serial)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * stride;
        const __m512 low = _mm512_set1_ps(-INFINITY); /* what a row's last lanes past its end hold */
        __m512 best = low;
        __mmask16 nan = 0;
        for (int64_t j = 0; j < n; j += 16) {
            const __m512 v = _mm512_mask_loadu_ps(low, first_lanes(n - j), xr + j);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            best = _mm512_max_ps(best, v);
        }
        out[r] = -1;
        if (nan) continue;
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
        for (int64_t j = 0; j < n; j += 16) { /* the first position holding it */
            const __mmask16 m = first_lanes(n - j);
            const __mmask16 at = _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, xr + j), top, _CMP_EQ_OQ);
            if (at) {
                out[r] = j + __builtin_ctz(at);
                break;
            }
        }
    }
    int64_t nan_rows = 0;
    for (int64_t r = 0; r < rows; r++) nan_rows += out[r] < 0;
    return nan_rows;
}
