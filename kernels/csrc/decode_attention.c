/* Attention of one query per row over its sequence's paged KV cache, bfloat16 in and out, on the CPU: a decode
 * step's tokens, and each query of a prompt chunk as a row of its own (kernels/cpu_attention.py). See
 * kernels/native.py for when it runs.
 *
 * A task is one row and one KV head: the query heads sharing that head score every visible key (AVX-512 BF16 dot
 * products: exact products summed in float32), take the softmax in float32 (exp by range reduction and a polynomial,
 * within 2 float32 ulps), and sum the values weighted by it in float32; the output is rounded to bfloat16 once. The
 * keys and values are read in place through the block table: nothing is gathered. Keys are scored 16 at a time, each
 * key's products in one vector whose lanes the 16 vectors sum together (sum16), and a position's row is found by
 * walking the block table, not by a division per position; a head's vectors stay in registers where its size is 64
 * or 128 (the task body inlined with that size a constant). The heads of a group share each key and value row as
 * it is read (1.3-1.5x for a prompt's rows on the Zen 4 EPYC against a walk per head), each head's sums in the order
 * it would take alone.
 *
 * A row may also attend picked positions after its range (a draft tree's node: its ancestors and itself, which sit
 * in slots apart; kernels/cpu_attention.py): they are walked after the range, one table lookup each, and scored as
 * the next positions of the range would be, so a node's output is the one a decode step over its own path gives.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "bf16.h"
#include "scratch.h"
#include "simd.h"
#include "team.h"

#define MAX_DIM 256 /* head size */
#define MAX_GROUP 128 /* query heads sharing a KV head */

typedef struct { /* one call's arguments, as decode_attention_bf16 takes them */
    const uint16_t *q, *k, *v;
    const int32_t *tables, *lens, *starts, *picks, *npicks; /* picks, npicks: NULL, or [n, pick_width], [n] */
    uint16_t *out;
    float *scores;
    int64_t width, hq, hkv, d, block_size, max_len, pick_width;
    float scale;
} job;

typedef struct { /* the rows of one KV head, position by position: a pointer step within a block, the block table
                  * read once a block; past the range's `contig` positions, the picked ones */
    const uint16_t *cache, *row;
    const int32_t *table, *picks;
    int64_t block, left, block_size, stride, offset, contig;
} walk;

static inline walk walk_from(const job *j, const uint16_t *cache, const int32_t *table, int64_t h, int64_t t,
                             int64_t contig, const int32_t *picks) {
    const int64_t block = t / j->block_size, slot = t % j->block_size, stride = j->hkv * j->d;
    const uint16_t *row = cache + ((int64_t)table[block] * j->block_size + slot) * stride + h * j->d;
    walk w = {cache, row, table, picks, block + 1, j->block_size - slot, j->block_size, stride, h * j->d, contig};
    return w;
}

static inline const uint16_t *next_row(walk *w) {
    if (w->contig == 0) { /* a picked position, through the table */
        const int64_t t = *w->picks++;
        return w->cache + ((int64_t)w->table[t / w->block_size] * w->block_size + t % w->block_size) * w->stride +
               w->offset;
    }
    w->contig--;
    if (w->left == 0) {
        w->row = w->cache + w->table[w->block++] * w->block_size * w->stride + w->offset;
        w->left = w->block_size;
    }
    const uint16_t *row = w->row;
    w->row += w->stride;
    w->left--;
    return row;
}

/* Sequence task / hkv, KV head task % hkv, heads of 32 * pairs values: inlined with pairs a constant, so that a
 * head's vectors stay in registers. The query heads sharing the KV head take each key and value row as it comes:
 * a block of 16 keys is read once and scored for every head (from L1 after the first), and a value row is read and
 * widened to float32 once for HEADS heads' sums. Each head's arithmetic, and its order, is the one it would take
 * alone: its output does not depend on the heads beside it. */
static inline __attribute__((always_inline)) void attend(const job *j, int64_t task, const int64_t pairs) {
    const int64_t group = j->hq / j->hkv, s = task / j->hkv, h = task % j->hkv;
    const int64_t len = j->lens[s], start = j->starts[s], picked = j->picks ? j->npicks[s] : 0;
    const int64_t count = len - start + picked;
    const int32_t *table = j->tables + s * j->width, *picks = j->picks ? j->picks + s * j->pick_width : 0;
    float *rows = j->scores + omp_get_thread_num() * group * j->max_len; /* this thread's: each query head's scores */
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000);
    const uint16_t *q0 = j->q + (s * j->hq + h * group) * j->d;
    __m512 best[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) best[g] = _mm512_set1_ps(-INFINITY);
    /* scores 16 keys at a time: a key's products in one vector's lanes, the 16 vectors' lanes summed at once */
    walk keys = walk_from(j, j->k, table, h, start, len - start, picks);
    for (int64_t t0 = 0; t0 < count; t0 += 16) {
        const int64_t n = count - t0 < 16 ? count - t0 : 16;
        const __mmask16 m = first_lanes(n);
        const uint16_t *kt[16];
        for (int64_t i = 0; i < n; i++) kt[i] = next_row(&keys);
        for (int64_t g = 0; g < group; g++) {
            const uint16_t *qg = q0 + g * j->d;
            __m512 acc[16];
            for (int64_t i = 0; i < 16; i++) {
                acc[i] = _mm512_setzero_ps();
                if (i < n)
                    for (int64_t c = 0; c < pairs; c++)
                        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(kt[i] + c * 32),
                                                  (__m512bh)_mm512_loadu_si512(qg + c * 32));
            }
            const __m512 x = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(j->scale));
            _mm512_mask_storeu_ps(rows + g * j->max_len + t0, m, x);
            best[g] = _mm512_mask_max_ps(best[g], m, best[g], x);
        }
    }
    /* each head's softmax numerators in place, and the inverse of their sum */
    float inv[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        float *row = rows + g * j->max_len;
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best[g]));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t i = 0; i < count; i += 16) {
            const __mmask16 m = first_lanes(count - i);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + i), top));
            _mm512_mask_storeu_ps(row + i, m, e);
            sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
        }
        inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    /* values as float32 32 at a time: a 32-bit lane's low half (shifted up) is the even one, its high half the odd
     * one, so the sums run over even and odd positions apart and interleave back as they are stored; HEADS heads'
     * sums at a time, in registers */
    const int64_t heads = pairs >= 8 ? 1 : 8 / pairs;
    for (int64_t g0 = 0; g0 < group; g0 += heads) {
        const int64_t hn = group - g0 < heads ? group - g0 : heads;
        __m512 even[8][MAX_DIM / 32], odd[8][MAX_DIM / 32];
        for (int64_t g = 0; g < hn; g++)
            for (int64_t c = 0; c < pairs; c++) even[g][c] = odd[g][c] = _mm512_setzero_ps();
        walk values = walk_from(j, j->v, table, h, start, len - start, picks);
        for (int64_t t = 0; t < count; t++) {
            const uint16_t *vt = next_row(&values);
            __m512 ve[MAX_DIM / 32], vo[MAX_DIM / 32];
            for (int64_t c = 0; c < pairs; c++) {
                const __m512i raw = _mm512_loadu_si512(vt + c * 32);
                ve[c] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
                vo[c] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
            }
            for (int64_t g = 0; g < hn; g++) {
                const __m512 p = _mm512_set1_ps(rows[(g0 + g) * j->max_len + t]);
                for (int64_t c = 0; c < pairs; c++) {
                    even[g][c] = _mm512_fmadd_ps(p, ve[c], even[g][c]);
                    odd[g][c] = _mm512_fmadd_ps(p, vo[c], odd[g][c]);
                }
            }
        }
        for (int64_t g = 0; g < hn; g++) {
            uint16_t *dst = j->out + (s * j->hq + h * group + g0 + g) * j->d;
            const __m512 scale = _mm512_set1_ps(inv[g0 + g]);
            for (int64_t c = 0; c < pairs; c++) {
                const __m512i e = _mm512_castps_si512(bf16x16_round(_mm512_mul_ps(even[g][c], scale)));
                const __m512i o = _mm512_castps_si512(bf16x16_round(_mm512_mul_ps(odd[g][c], scale)));
                _mm512_storeu_si512(dst + c * 32, _mm512_or_si512(_mm512_srli_epi32(e, 16), o));
            }
        }
    }
}

/* q: [n, hq, d] bf16, the queries in their sequences' order; k, v: [blocks, block_size, hkv, d] bf16; tables:
 * [n, width] int32 block ids; lens: [n] int32 context lengths (the query at lens - 1); starts: [n] int32 first
 * position attended (a window's start, else 0); picks: NULL or [n, pick_width] int32 positions a row attends after
 * its range, npicks: [n] int32 how many; out: [n, hq, d] bf16; max_len: the most positions a row attends (at least
 * 1). d % 32 == 0, d <= MAX_DIM, hq / hkv <= MAX_GROUP. Returns 0, or -1 where the heap had no room for the scores
 * (scratch.h). */
int decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int32_t *tables,
                          int64_t width, const int32_t *lens, const int32_t *starts, uint16_t *out, int64_t n,
                          int64_t hq, int64_t hkv, int64_t d, int64_t block_size, float scale, int64_t max_len,
                          int threads, const int32_t *picks, const int32_t *npicks, int64_t pick_width) {
    _Alignas(64) unsigned char stack[STACK_SCRATCH];
    void *heap = NULL; /* each thread's scores of every query head of a group */
    float *scores = scratch(stack, sizeof(float) * threads * (hq / hkv) * max_len, &heap);
    if (scores == NULL) return -1;
    const job j = {q,  k,   v, tables,     lens,    starts,     picks, npicks, out,
                   scores, width, hq, hkv, d, block_size, max_len, pick_width, scale};
    team t = team_begin(threads);
#pragma omp parallel num_threads(t.threads)
    {
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t task = 0; task < n * hkv; task++) {
            if (d == 64)
                attend(&j, task, 2);
            else if (d == 128)
                attend(&j, task, 4);
            else
                attend(&j, task, d / 32);
        }
        team_share_done(&t);
    }
    team_end(&t);
    free(heap);
    return 0;
}
