/* Per-row operations on bfloat16 rows. See kernels/native.py for when they run. RMSNorm and rotary take a decode
 * step's few rows, serially: they take microseconds, less than a parallel region's start.
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
 * where residual is NULL). */
void rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *out, uint16_t *h,
                   int64_t rows, int64_t hidden, float eps) {
    float row[hidden]; /* the row as float32: hidden <= 65536, 256 KiB at most */
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * hidden;
        float sum = 0.0f;
        for (int64_t j = 0; j < hidden; j++) {
            float v = bf16_to_float(xr[j]);
            if (residual != NULL) {
                uint16_t b = float_to_bf16(v + bf16_to_float(residual[r * hidden + j]));
                h[r * hidden + j] = b;
                v = bf16_to_float(b);
            }
            row[j] = v;
            sum += v * v;
        }
        float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        for (int64_t j = 0; j < hidden; j++) {
            float normed = bf16_to_float(float_to_bf16(row[j] * inv));
            out[r * hidden + j] = float_to_bf16(bf16_to_float(weight[j]) * normed);
        }
    }
}

/* Rotary embedding of bfloat16 heads in kernels/rotary.py's torch numerics, each product and the sum rounded to
 * bfloat16 as torch's ops round them: out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1).
 * x: [tokens, heads, d], rows of d contiguous, strides sx0, sx1 (elements); cos, sin: [tokens, d], rows sc0 apart;
 * out: [tokens, heads, d] contiguous. */
void rotary_bf16(const uint16_t *x, int64_t sx0, int64_t sx1, const uint16_t *cos, const uint16_t *sin, int64_t sc0,
                 uint16_t *out, int64_t tokens, int64_t heads, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos + t * sc0, *s = sin + t * sc0;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xr = x + t * sx0 + h * sx1;
            uint16_t *o = out + (t * heads + h) * d;
            for (int64_t j = 0; j < d; j++) {
                float rot = j < half ? -bf16_to_float(xr[j + half]) : bf16_to_float(xr[j - half]);
                float a = bf16_to_float(float_to_bf16(bf16_to_float(xr[j]) * bf16_to_float(c[j])));
                float b = bf16_to_float(float_to_bf16(rot * bf16_to_float(s[j])));
                o[j] = float_to_bf16(a + b);
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
            const __mmask16 m = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
            const __m512 x = bf16x16_load(g + j, m);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            bf16x16_store(o + j, _mm512_mul_ps(bf16x16_round(silu), bf16x16_load(u + j, m)), m);
        }
    }
}
