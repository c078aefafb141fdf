/* Paged attention on the CPU, fp32 or bf16, one query row at a time, reading K/V straight
 * from the block-table'd cache (no gather): a decode token is one row over its
 * sequence's L cached tokens; a prefill token at position p is one row over the
 * first p + 1 (causal). Built and loaded by cpu_kernel.py; see its docstring.
 * fp32 rows of one sequence that follow each other in a call (a prefill chunk) go in
 * groups of up to GROUP_ROWS instead, with K transposed per tile (group_avx512_impl).
 *
 * Shapes (row-major, element strides given where a view may be strided):
 *   q        [R, H, D]             q + r * q_stride
 *   k_cache  [NB, BS, KVH, D]      one layer's K: block b at k_cache + b * BSTR, each
 *                                  block's [BS, KVH, D] tile contiguous (the cache is
 *                                  block-major, kv_cache.py: BSTR = layers * 2 * BS *
 *                                  KVH * D; a plain [NB, BS, KVH, D] tensor has
 *                                  BSTR = BS * KVH * D)
 *   v_cache  [NB, BS, KVH, D]      the same, block stride BSTR
 *   tables   [n_tables, t_width]   int32 block ids, tables + seq * t_stride
 *   row_seq  [R] or NULL           int32: the table row of each query row
 *   lens     [R]                   int32: how many tokens row r attends (0: skip)
 *   out      [R, H, D]             out + r * out_stride
 * Query head h reads KV head h / (H / KVH) (GQA).
 *
 * Per row, both passes walk the blocks in order and read each token's whole
 * [KVH, D] row (contiguous within a block), so K and V are read once each:
 *   1. scores s[h, t] = scale * q[h] . k[t, h / G]          (s: [H, L] scratch)
 *   2. exact softmax per head: p = exp(s - max), 1 / sum(p)
 *   3. out[h] = sum_t p[h, t] * v[t, h / G] / sum
 * With AVX-512 and D a multiple of 16 (up to 256), 16 tokens go at a time:
 * the 16 dot products of a head end as 16 vectors reduced by one transpose-add
 * tree, and exp runs on vectors; otherwise plain loops (one_row_generic).
 *
 * bf16 (pagedserve_attend_bf16: q, K/V cache and out in bf16, everything else
 * fp32): the same three passes, accumulating in fp32; only the output is
 * rounded (to nearest even) back to bf16. With AVX-512 and D a multiple of 32
 * (up to 256) 32 bf16 values are one vector: as 16 32-bit lanes, lane i holds
 * elements 2i (low half) and 2i + 1 (high half), so `x << 16` and
 * `x & 0xffff0000` are the fp32 values of the even and the odd elements,
 * exactly, with no widening loads or shuffles. Scores q . k: one
 * _mm512_dpbf16_ps per 32 elements where the CPU has AVX512_BF16 (products of
 * bf16 are exact in fp32, sums in fp32: the same arithmetic as the two FMAs of
 * the plain AVX-512F path below it). Weighted V: p stays fp32 (rounding it to
 * bf16 for a dot-product instruction would double the error of the output) and
 * V's even and odd elements go to two fp32 accumulators, packed back into
 * element order as bf16 only at the end. Other D, or no AVX-512: plain loops
 * (one_row_generic_bf16), converting element by element.
 *
 * Work items are handed to threads one at a time (an atomic counter): a row, or,
 * in bf16 calls of fewer than SPLIT_ROWS_BELOW rows, a 256-token chunk of a row,
 * the chunks merged by their softmax maxima and sums afterwards (batch-1 decode
 * uses every thread; see SPLIT_ROWS_BELOW). Rows prefetch their K/V tiles ahead
 * (see prefetch_tile; bf16 also the next item's first K tile): decode reads K/V
 * from memory, scattered by the block table. fp32 rows are never split, and
 * prefetching moves no arithmetic, so fp32 decode rows are bit-identical to before;
 * fp32 prefill rows in groups (group_avx512_impl) sum their scores over D in another
 * order, within fp32 rounding of a row alone. Only the OpenMP
 * runtime's parallel region is used, with the caller's thread count (torch's),
 * so it runs on torch's own OpenMP threads.
 *
 * Measured (Zen 4, bf16, 9 heads over 3, D 64, one thread, K/V in cache): the
 * scores pass costs ~4.3 cycles per (token, head) (2 dpbf16 + the transpose-add
 * tree), the V pass ~5 (4 FMAs: the floor for fp32 sums of D = 64); sharing V's
 * widening between a GQA group's heads, or K loads, gained nothing measurable.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

/* exp(x) for x <= 0, vectorisable (Cephes expf polynomial, ~1 ulp); x < -87
 * clamps to exp(-87) ~ 1.6e-38, which only ever meets sums >= 1 here. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float r2 = r * r;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r2 + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* bf16 <-> fp32 (bf16_to_f32, f32_to_bf16): rounding to nearest even */
#include "../bf16.h"

#define LD_F32(x) (x)
#define ST_F32(x) (x)
#define LD_BF16(x) bf16_to_f32(x)
#define ST_BF16(x) f32_to_bf16(x)

/* Any D, no vector intrinsics (what other CPUs and head sizes get): one body,
 * instantiated for fp32 and for bf16 (elements of type T read through LD,
 * written through ST; the arithmetic is fp32 either way). */
#define DEFINE_ONE_ROW_GENERIC(NAME, T, LD, ST)                                            \
static void NAME(const T *q, const T *k_cache, const T *v_cache,                        \
                                 const int32_t *table, int64_t L, int64_t H, int64_t KVH, \
                                 int64_t D, int64_t BS, int64_t BSTR, float scale, T *out, float *s,  \
                                 float *acc, float *inv) {                              \
    const int64_t G = H / KVH;                                                          \
    const int64_t row = KVH * D; /* floats per token within a block */                  \
                                                                                        \
    /* 1. scores: s [H, L] */                                                           \
    for (int64_t t0 = 0; t0 < L; t0 += BS) {                                            \
        const T *kb = k_cache + (int64_t)table[t0 / BS] * BSTR;                     \
        const int64_t n = L - t0 < BS ? L - t0 : BS;                                    \
        for (int64_t j = 0; j < n; ++j) {                                               \
            const T *kt = kb + j * row;                                                 \
            for (int64_t h = 0; h < H; ++h) {                                           \
                const T *kh = kt + (h / G) * D;                                         \
                const T *qh = q + h * D;                                                \
                float a = 0.0f;                                                         \
    _Pragma("omp simd reduction(+ : a)")                                                \
                for (int64_t i = 0; i < D; ++i) a += LD(qh[i]) * LD(kh[i]);             \
                s[h * L + t0 + j] = a * scale;                                          \
            }                                                                           \
        }                                                                               \
    }                                                                                   \
    /* 2. softmax numerators in place, 1 / denominators in inv */                       \
    for (int64_t h = 0; h < H; ++h) {                                                   \
        float *sh = s + h * L;                                                          \
        float m = sh[0];                                                                \
        for (int64_t t = 1; t < L; ++t) m = sh[t] > m ? sh[t] : m;                      \
        float sum = 0.0f;                                                               \
    _Pragma("omp simd reduction(+ : sum)")                                              \
        for (int64_t t = 0; t < L; ++t) {                                               \
            float e = exp_nonpos(sh[t] - m);                                            \
            sh[t] = e;                                                                  \
            sum += e;                                                                   \
        }                                                                               \
        inv[h] = 1.0f / sum;                                                            \
    }                                                                                   \
    /* 3. weighted V: acc [H, D] */                                                     \
    memset(acc, 0, (size_t)(H * D) * sizeof(float));                                    \
    for (int64_t t0 = 0; t0 < L; t0 += BS) {                                            \
        const T *vb = v_cache + (int64_t)table[t0 / BS] * BSTR;                     \
        const int64_t n = L - t0 < BS ? L - t0 : BS;                                    \
        for (int64_t j = 0; j < n; ++j) {                                               \
            const T *vt = vb + j * row;                                                 \
            for (int64_t h = 0; h < H; ++h) {                                           \
                const T *vh = vt + (h / G) * D;                                         \
                const float p = s[h * L + t0 + j];                                      \
                float *ah = acc + h * D;                                                \
    _Pragma("omp simd")                                                                 \
                for (int64_t i = 0; i < D; ++i) ah[i] += p * LD(vh[i]);                 \
            }                                                                           \
        }                                                                               \
    }                                                                                   \
    for (int64_t h = 0; h < H; ++h) {                                                   \
        const float c = inv[h];                                                         \
    _Pragma("omp simd")                                                                 \
        for (int64_t i = 0; i < D; ++i) out[h * D + i] = ST(acc[h * D + i] * c);        \
    }                                                                                   \
}

DEFINE_ONE_ROW_GENERIC(one_row_generic, float, LD_F32, ST_F32)
DEFINE_ONE_ROW_GENERIC(one_row_generic_bf16, uint16_t, LD_BF16, ST_BF16)

#ifdef __AVX512F__
#include <immintrin.h>

#include "../avx512_exp.h" /* exp512_reduced */

/* The 16 horizontal sums of v[0..15], in order: a transpose-and-add tree
 * (45 shuffles/adds instead of 16 separate reductions). */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i) /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) /* lane k: the 4 vectors' sums over their lane k */
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; ++i)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                         _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

/* exp(x) for x <= 0 on 16 lanes: the polynomial of exp_nonpos, and exactly 0
 * below -87 (so padding scores of -inf add nothing). */
static inline __m512 exp512_nonpos(__m512 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    return _mm512_maskz_mov_ps(keep, exp512_reduced(x, n));
}

/* Pass 2 on s [H, Lp] (Lp = L rounded up to 16): the scores past L become -inf,
 * then each head's row becomes exp(s - max) in place and inv[h] 1 / its sum
 * (and, where ms is not NULL, ms[h] the max and ms[H + h] the sum: a split row's
 * chunks are merged by them). */
static inline void softmax512(float *s, int64_t H, int64_t L, int64_t Lp, float *inv,
                              float *ms) {
    const __mmask16 tail = (__mmask16)((1u << (L - (Lp - 16))) - 1u);
    for (int64_t h = 0; h < H; ++h) {
        float *sh = s + h * Lp;
        _mm512_storeu_ps(sh + Lp - 16, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), tail,
                                                         _mm512_loadu_ps(sh + Lp - 16)));
        __m512 m = _mm512_loadu_ps(sh);
        for (int64_t t = 16; t < Lp; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sh + t));
        const float m1 = _mm512_reduce_max_ps(m);
        const __m512 vm = _mm512_set1_ps(m1);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < Lp; t += 16) {
            const __m512 e = exp512_nonpos(_mm512_sub_ps(_mm512_loadu_ps(sh + t), vm));
            _mm512_storeu_ps(sh + t, e);
            sum = _mm512_add_ps(sum, e);
        }
        const float total = _mm512_reduce_add_ps(sum);
        inv[h] = 1.0f / total;
        if (ms != NULL) ms[h] = m1, ms[H + h] = total;
    }
}

/* Each block's first token offset -> every token's element offset off[t], t < Lp
 * (the tile padding past L repeats token L - 1: real, finite data). */
static inline void token_offsets(const int32_t *table, int64_t L, int64_t Lp, int64_t BS,
                                 int64_t BSTR, int64_t row, int64_t *off) {
    for (int64_t t0 = 0, i = 0; t0 < L; t0 += BS, ++i) { /* no division per token */
        const int64_t base = (int64_t)table[i] * BSTR, n = L - t0 < BS ? L - t0 : BS;
        for (int64_t j = 0; j < n; ++j) off[t0 + j] = base + j * row;
    }
    for (int64_t t = L; t < Lp; ++t) off[t] = off[L - 1];
}

/* Software prefetch of the 16 token rows at element offsets off[0..15] (`bytes` each:
 * all KV heads of a token) of `cache` (elements of `elem` bytes). Decode reads K/V
 * from memory, block by block in table order; measured here (bf16, 64 rows x 200
 * tokens, 9 heads over 3, D 64, 1 thread, CPU time, quiet machine): the kernel read
 * them at ~5 GB/s where a plain loop over the same scattered blocks reads ~9.5, as
 * its loads are spread over compute and few misses are in flight at once. Per tile:
 * in the scores pass, the next tile of K and this tile of V into L2 (_MM_HINT_T1);
 * in the V pass, the next tile of V from L2 into L1. 1.85 -> 1.0 ms (~9.8 GB/s).
 * Prefetching K into L1 instead (_MM_HINT_T0) gave only 1.5 ms, two tiles ahead
 * 1.3, V to L3 (T2) 1.3, without the V pass's L1 prefetch 1.25. Bit-identical
 * results: only loads move. */
#define prefetch_tile(cache, elem, off, bytes, hint)                                      \
    do {                                                                                  \
        for (int64_t j_ = 0; j_ < 16; ++j_) {                                             \
            const char *p_ = (const char *)(cache) + (off)[j_] * (int64_t)(elem);         \
            for (int64_t b_ = 0; b_ < (bytes); b_ += 64) _mm_prefetch(p_ + b_, hint);     \
        }                                                                                 \
    } while (0)

/* Rows of V up to this many bytes are prefetched into L2 during the scores pass
 * (half of Zen 4's 1 MiB L2: longer rows would evict their own first tiles before
 * the V pass reached them). */
#define V_PREFETCH_MAX_BYTES (512 << 10)

/* The K rows of the first 16 tokens of a row whose table and length are given
 * (the next row this thread will take), into L2: its scores pass then starts warm. */
static inline void prefetch_row_start(const void *k_cache, size_t elem, const int32_t *table,
                                      int64_t L, int64_t BS, int64_t BSTR, int64_t row) {
    for (int64_t t = 0; t < L && t < 16; ++t) {
        const char *p = (const char *)k_cache +
                        ((int64_t)table[t / BS] * BSTR + (t % BS) * row) * (int64_t)elem;
        for (int64_t b = 0; b < row * (int64_t)elem; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
    }
}

/* One 16-token tile of weighted V for one (row, head): ah [D] += sum over the tile's
 * tokens j of ph[j] * (V row of token off[j], at v_kh: the head's KV offset applied),
 * C = D / 16 vectors kept in registers. Shared by the one-row and grouped paths, which
 * must sum in the same order (a row attended alone or in a group: same weighted V). */
static inline __attribute__((always_inline)) void add_v_tile(float *ah, const float *ph,
                                                             const float *v_kh,
                                                             const int64_t *off,
                                                             const int64_t C) {
    __m512 a[16];
#pragma GCC unroll 16
    for (int64_t c = 0; c < C; ++c) a[c] = _mm512_loadu_ps(ah + 16 * c);
#pragma GCC unroll 16
    for (int64_t j = 0; j < 16; ++j) {
        const float *vr = v_kh + off[j];
        const __m512 p = _mm512_set1_ps(ph[j]);
#pragma GCC unroll 16
        for (int64_t c = 0; c < C; ++c)
            a[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 16 * c), a[c]);
    }
#pragma GCC unroll 16
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(ah + 16 * c, a[c]);
}

/* C = D / 16 vectors per head row; inlined with C = 1, 2, 4, 8, 16.
 * Tokens go 16 at a time; the last tile's rows past L repeat row L - 1 (real,
 * finite data) and their scores are set to -inf, so no tile needs a branch. */
static inline __attribute__((always_inline)) void one_row_avx512_impl(
    const float *q, const float *k_cache, const float *v_cache, const int32_t *table,
    int64_t L, int64_t H, int64_t KVH, int64_t BS, int64_t BSTR, float scale, float *out, float *s,
    float *acc, float *inv, int64_t *off, int pf, const int64_t C) {
    const int64_t D = 16 * C, G = H / KVH, row = KVH * D;
    const int64_t Lp = (L + 15) & ~(int64_t)15;
    const int v_ahead = pf && L * row * 4 <= V_PREFETCH_MAX_BYTES;
    token_offsets(table, L, Lp, BS, BSTR, row, off);

    /* 1. scores s [H, Lp], 16 tokens at a time (prefetching: see prefetch_tile) */
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t t0 = 0; t0 < Lp; t0 += 16) {
        if (pf && t0 + 16 < Lp)
            prefetch_tile(k_cache, 4, off + t0 + 16, row * 4, _MM_HINT_T1);
        if (v_ahead) prefetch_tile(v_cache, 4, off + t0, row * 4, _MM_HINT_T1);
        for (int64_t kh = 0; kh < KVH; ++kh) {
            for (int64_t g = 0; g < G; ++g) {
                const float *qh = q + (kh * G + g) * D;
                __m512 part[16];
#pragma GCC unroll 16
                for (int64_t j = 0; j < 16; ++j) {
                    const float *kr = k_cache + off[t0 + j] + kh * D;
                    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), _mm512_loadu_ps(kr));
#pragma GCC unroll 16
                    for (int64_t c = 1; c < C; ++c)
                        a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c),
                                            _mm512_loadu_ps(kr + 16 * c), a);
                    part[j] = a;
                }
                _mm512_storeu_ps(s + (kh * G + g) * Lp + t0,
                                 _mm512_mul_ps(sum16(part), vscale));
            }
        }
    }
    /* 2. softmax numerators in place (0 at the padding), 1 / denominators */
    softmax512(s, H, L, Lp, inv, NULL);
    /* 3. weighted V: acc [H, D] (padding rows have weight 0) */
    memset(acc, 0, (size_t)(H * D) * sizeof(float));
    for (int64_t t0 = 0; t0 < Lp; t0 += 16) {
        if (pf && t0 + 16 < Lp)
            prefetch_tile(v_cache, 4, off + t0 + 16, row * 4, _MM_HINT_T0);
        for (int64_t kh = 0; kh < KVH; ++kh) {
            for (int64_t g = 0; g < G; ++g) {
                const int64_t h = kh * G + g;
                add_v_tile(acc + h * D, s + h * Lp + t0, v_cache + kh * D, off + t0, C);
            }
        }
    }
    for (int64_t h = 0; h < H; ++h) {
        const __m512 c_inv = _mm512_set1_ps(inv[h]);
        for (int64_t c = 0; c < C; ++c)
            _mm512_storeu_ps(out + h * D + 16 * c,
                             _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + 16 * c), c_inv));
    }
}

/* kt [16][16] = the transpose of the 16 x 16 floats at src + off[j] (row j: 16
 * contiguous floats): kt[e][j] = src[off[j] + e]. Shuffles only: with AVX-512 gathers
 * instead (two 8-lane vgatherqps per element of D) the group kernel was slower than rows
 * one by one on the Skylake-SP Xeon here (gathers ~40 % of its time). After the two
 * unpack stages, vector 4i + m holds in its 128-bit lane L column 4L + m of rows
 * 4i..4i+3; the two 128-bit-lane shuffles then put column m's four row quads together. */
static inline __attribute__((always_inline)) void transpose16(const float *src,
                                                              const int64_t *off, float *kt) {
    __m512 r[16], t[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_ps(src + off[j]);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
#pragma GCC unroll 4
    for (int m = 0; m < 4; ++m) {
        t[m] = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x88);
        t[4 + m] = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xDD);
        t[8 + m] = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x88);
        t[12 + m] = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xDD);
    }
#pragma GCC unroll 4
    for (int m = 0; m < 4; ++m) {
        _mm512_storeu_ps(kt + 16 * m, _mm512_shuffle_f32x4(t[m], t[8 + m], 0x88));
        _mm512_storeu_ps(kt + 16 * (8 + m), _mm512_shuffle_f32x4(t[m], t[8 + m], 0xDD));
        _mm512_storeu_ps(kt + 16 * (4 + m), _mm512_shuffle_f32x4(t[4 + m], t[12 + m], 0x88));
        _mm512_storeu_ps(kt + 16 * (12 + m), _mm512_shuffle_f32x4(t[4 + m], t[12 + m], 0xDD));
    }
}

/* Scores of NP (query row, head) pairs against one 16-token tile of K, transposed in kt
 * [D][16]: acc_p = sum_d q_p[d] * kt[d] (each q element broadcast, one FMA per element
 * and pair: no horizontal sums), then times scale into sp[p][0..15]. */
static inline __attribute__((always_inline)) void scores_pairs(const float *const *qp,
                                                               float *const *sp,
                                                               const float *kt, int64_t D,
                                                               __m512 vscale, const int NP) {
    __m512 acc[8];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[p] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
        const __m512 k = _mm512_loadu_ps(kt + 16 * d);
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) acc[p] = _mm512_fmadd_ps(_mm512_set1_ps(qp[p][d]), k, acc[p]);
    }
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(sp[p], _mm512_mul_ps(acc[p], vscale));
}

/* Several query rows of one sequence (a prefill chunk: consecutive positions, lengths
 * lens[0..n-1]) at once, C = D / 16 as above. Why: one_row_avx512_impl computes each
 * (row, head, token) score as a 16-lane partial dot product and sums 16 of them with
 * the transpose-add tree (sum16); with K/V in cache, as a prefill chunk's are, that
 * arithmetic is the cost (~20 cycles per (row, head, token) for both passes on the
 * Skylake-SP Xeon here, about a third of its FMA rate). Here, per 16-token tile and KV
 * head, K is transposed once into kt [D][16] (transpose16, D / 16 times) and
 * every (row, head) pair of the group takes its 16 scores as D broadcast FMAs, up to 8
 * pairs sharing each kt load: no horizontal sums. V is summed as before (p broadcast
 * times a V row), the tile's V rows in L1 for all rows of the group. The scores sum
 * over D in another order than one_row's, so they may differ from a row attended
 * alone in the last bits (tests/test_cpu_attention_kernel.py compares both with a
 * float64 reference). Each row's softmax is over its own length; the tokens in
 * [lens[i], Lp_i) of row i are the sequence's next tokens (finite), their weights 0.
 * Scratch: s [n][H, Lp_max] (row i's own stride Lp_i inside), acc [n][H, D], inv
 * [n][H], kt [D][16], off [Lp] for the longest row. */
static inline __attribute__((always_inline)) void group_avx512_impl(
    const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
    const int32_t *table, const int32_t *lens, int64_t n, int64_t H, int64_t KVH, int64_t BS,
    int64_t BSTR, float scale, float *out, int64_t out_stride, float *s, float *acc, float *inv,
    float *kt, int64_t *off, int64_t Lp_max, const int64_t C) {
    const int64_t D = 16 * C, G = H / KVH, row = KVH * D;
    int64_t L = 0;
    for (int64_t i = 0; i < n; ++i) L = lens[i] > L ? lens[i] : L;
    const int64_t Lp = (L + 15) & ~(int64_t)15;
    token_offsets(table, L, Lp, BS, BSTR, row, off);
#define ROW_LP(i) ((lens[i] + 15) & ~(int64_t)15)
    /* 1. scores: row i's s [H, Lp_i] at s + i * H * Lp_max */
    const __m512 vscale = _mm512_set1_ps(scale);
    const float *qp[8];
    float *sp[8];
    for (int64_t t0 = 0; t0 < Lp; t0 += 16) {
        for (int64_t kh = 0; kh < KVH; ++kh) {
            const float *kb = k_cache + kh * D;
            for (int64_t c = 0; c < C; ++c) transpose16(kb + 16 * c, off + t0, kt + 256 * c);
            int np = 0;
            for (int64_t i = 0; i < n; ++i) {
                const int64_t Lpi = ROW_LP(i);
                if (t0 >= Lpi) continue;
                for (int64_t g = 0; g < G; ++g) {
                    const int64_t h = kh * G + g;
                    qp[np] = q + i * q_stride + h * D;
                    sp[np] = s + i * H * Lp_max + h * Lpi + t0;
                    if (++np == 8) {
                        scores_pairs(qp, sp, kt, D, vscale, 8);
                        np = 0;
                    }
                }
            }
            for (int p = 0; p < np; ++p) scores_pairs(qp + p, sp + p, kt, D, vscale, 1);
        }
    }
    /* 2. each row's softmax over its own length */
    for (int64_t i = 0; i < n; ++i)
        softmax512(s + i * H * Lp_max, H, lens[i], ROW_LP(i), inv + i * H, NULL);
    /* 3. weighted V, tile by tile for every row */
    memset(acc, 0, (size_t)(n * H * D) * sizeof(float));
    for (int64_t t0 = 0; t0 < Lp; t0 += 16) {
        for (int64_t kh = 0; kh < KVH; ++kh) {
            for (int64_t i = 0; i < n; ++i) {
                const int64_t Lpi = ROW_LP(i);
                if (t0 >= Lpi) continue;
                for (int64_t g = 0; g < G; ++g) {
                    const int64_t h = kh * G + g;
                    add_v_tile(acc + (i * H + h) * D, s + i * H * Lp_max + h * Lpi + t0,
                               v_cache + kh * D, off + t0, C);
                }
            }
        }
    }
#undef ROW_LP
    for (int64_t i = 0; i < n; ++i)
        for (int64_t h = 0; h < H; ++h) {
            const __m512 c_inv = _mm512_set1_ps(inv[i * H + h]);
            for (int64_t c = 0; c < C; ++c)
                _mm512_storeu_ps(out + i * out_stride + h * D + 16 * c,
                                 _mm512_mul_ps(_mm512_loadu_ps(acc + (i * H + h) * D + 16 * c),
                                               c_inv));
        }
}

/* bf16, P = D / 32 vectors of 32 bf16 per head row; inlined with P = 1, 2, 4, 8.
 * acc holds each head's fp32 sums as [P][even 16 | odd 16] (see the top). */
static inline __m512 bf16_even(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
static inline __m512 bf16_odd(__m512i x) {
    return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}

/* Two fp32 vectors (even and odd elements) rounded to nearest even and packed as
 * 32 bf16 in element order. (The operands are sums of finite values: no NaN.) */
static inline __m512i bf16_pack(__m512 even, __m512 odd) {
    const __m512i e = _mm512_castps_si512(even), o = _mm512_castps_si512(odd);
    const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    const __m512i re = _mm512_add_epi32(
        e, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(e, 16), one)));
    const __m512i ro = _mm512_add_epi32(
        o, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(o, 16), one)));
    return _mm512_or_si512(_mm512_srli_epi32(re, 16),
                           _mm512_and_si512(ro, _mm512_set1_epi32((int)0xffff0000u)));
}

static inline __attribute__((always_inline)) void one_row_avx512_bf16_impl(
    const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,
    int64_t L, int64_t H, int64_t KVH, int64_t BS, int64_t BSTR, float scale, uint16_t *out, float *s,
    float *acc, float *inv, int64_t *off, float *part, int pf, const int32_t *next_table,
    int64_t next_L, const int64_t P) {
    const int64_t D = 32 * P, G = H / KVH, row = KVH * D;
    const int64_t Lp = (L + 15) & ~(int64_t)15;
    const int v_ahead = pf && L * row * 2 <= V_PREFETCH_MAX_BYTES;
    token_offsets(table, L, Lp, BS, BSTR, row, off);

    /* 1. scores s [H, Lp], 16 tokens at a time */
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t t0 = 0; t0 < Lp; t0 += 16) {
        if (pf && t0 + 16 < Lp)
            prefetch_tile(k_cache, 2, off + t0 + 16, row * 2, _MM_HINT_T1);
        if (v_ahead) prefetch_tile(v_cache, 2, off + t0, row * 2, _MM_HINT_T1);
        for (int64_t kh = 0; kh < KVH; ++kh) {
            for (int64_t g = 0; g < G; ++g) {
                const uint16_t *qh = q + (kh * G + g) * D;
                __m512i qv[8];
#pragma GCC unroll 8
                for (int64_t c = 0; c < P; ++c) qv[c] = _mm512_loadu_si512(qh + 32 * c);
                __m512 part[16];
#pragma GCC unroll 16
                for (int64_t j = 0; j < 16; ++j) {
                    const uint16_t *kr = k_cache + off[t0 + j] + kh * D;
                    __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 8
                    for (int64_t c = 0; c < P; ++c) {
                        const __m512i kv = _mm512_loadu_si512(kr + 32 * c);
#ifdef __AVX512BF16__
                        a = _mm512_dpbf16_ps(a, (__m512bh)qv[c], (__m512bh)kv);
#else
                        a = _mm512_fmadd_ps(bf16_even(qv[c]), bf16_even(kv), a);
                        a = _mm512_fmadd_ps(bf16_odd(qv[c]), bf16_odd(kv), a);
#endif
                    }
                    part[j] = a;
                }
                _mm512_storeu_ps(s + (kh * G + g) * Lp + t0,
                                 _mm512_mul_ps(sum16(part), vscale));
            }
        }
    }
    /* 2. softmax numerators in place (0 at the padding), 1 / denominators */
    softmax512(s, H, L, Lp, inv, part);

    /* 3. weighted V: acc [H, P, 2, 16] (padding rows have weight 0) */
    if (next_table != NULL) prefetch_row_start(k_cache, 2, next_table, next_L, BS, BSTR, row);
    memset(acc, 0, (size_t)(H * D) * sizeof(float));
    for (int64_t t0 = 0; t0 < Lp; t0 += 16) {
        if (pf && t0 + 16 < Lp)
            prefetch_tile(v_cache, 2, off + t0 + 16, row * 2, _MM_HINT_T0);
        for (int64_t kh = 0; kh < KVH; ++kh) {
            for (int64_t g = 0; g < G; ++g) {
                const int64_t h = kh * G + g;
                float *ah = acc + h * D;
                const float *ph = s + h * Lp + t0;
                __m512 ae[8], ao[8];
#pragma GCC unroll 8
                for (int64_t c = 0; c < P; ++c) {
                    ae[c] = _mm512_loadu_ps(ah + 32 * c);
                    ao[c] = _mm512_loadu_ps(ah + 32 * c + 16);
                }
#pragma GCC unroll 16
                for (int64_t j = 0; j < 16; ++j) {
                    const uint16_t *vr = v_cache + off[t0 + j] + kh * D;
                    const __m512 p = _mm512_set1_ps(ph[j]);
#pragma GCC unroll 8
                    for (int64_t c = 0; c < P; ++c) {
                        const __m512i x = _mm512_loadu_si512(vr + 32 * c);
                        ae[c] = _mm512_fmadd_ps(p, bf16_even(x), ae[c]);
                        ao[c] = _mm512_fmadd_ps(p, bf16_odd(x), ao[c]);
                    }
                }
#pragma GCC unroll 8
                for (int64_t c = 0; c < P; ++c) {
                    _mm512_storeu_ps(ah + 32 * c, ae[c]);
                    _mm512_storeu_ps(ah + 32 * c + 16, ao[c]);
                }
            }
        }
    }
    if (part != NULL) { /* a chunk of a split row: [max H | sum H | acc H * D] */
        memcpy(part + 2 * H, acc, (size_t)(H * D) * sizeof(float));
        return;
    }
    for (int64_t h = 0; h < H; ++h) {
        const __m512 c_inv = _mm512_set1_ps(inv[h]);
        for (int64_t c = 0; c < P; ++c) {
            const float *ah = acc + h * D + 32 * c;
            _mm512_storeu_si512(out + h * D + 32 * c,
                                bf16_pack(_mm512_mul_ps(_mm512_loadu_ps(ah), c_inv),
                                          _mm512_mul_ps(_mm512_loadu_ps(ah + 16), c_inv)));
        }
    }
}
#endif

/* Scratch one thread needs: s [H, Lp], acc [H, D], inv [H], then (8-byte
 * aligned) off [Lp] int64, Lp = max_len rounded up to 16. */
static int64_t scratch_head_floats(int64_t H, int64_t D, int64_t Lp) {
    return (H * Lp + H * D + H + 1) & ~(int64_t)1;
}

/* The fp32 head sizes D = 16 * C with AVX-512 code: CASE(C) for each (CASE returns). */
#define F32_HEAD_SIZES(CASE)                                                                \
    switch (D) {                                                                            \
    case 16: CASE(1)                                                                        \
    case 32: CASE(2)                                                                        \
    case 64: CASE(4)                                                                        \
    case 128: CASE(8)                                                                       \
    case 256: CASE(16)                                                                      \
    }

static void one_row(const float *q, const float *k_cache, const float *v_cache,
                         const int32_t *table, int64_t L, int64_t H, int64_t KVH, int64_t D,
                         int64_t BS, int64_t BSTR, float scale, float *out, float *scratch, int64_t Lp_max,
                         int pf) {
    float *s = scratch;
    float *acc = s + H * Lp_max;
    float *inv = acc + H * D;
    int64_t *off = (int64_t *)(scratch + scratch_head_floats(H, D, Lp_max));
#ifdef __AVX512F__
#define AVX512_CASE(C)                                                                      \
    one_row_avx512_impl(q, k_cache, v_cache, table, L, H, KVH, BS, BSTR, scale, out, s, acc, \
                             inv, off, pf, C);                                              \
    return;
    F32_HEAD_SIZES(AVX512_CASE)
#undef AVX512_CASE
#endif
    (void)off, (void)pf;
    one_row_generic(q, k_cache, v_cache, table, L, H, KVH, D, BS, BSTR, scale, out, s, acc, inv);
}

/* Rows of one fp32 call grouped (see group_avx512_impl): at most this many rows a group
 * (its scratch: GROUP_ROWS * H * Lp_max floats of scores a thread). Measured on the
 * 2-core Skylake-SP Xeon (avx512f, no avx512_bf16; 1 thread, one layer of SmolLM2-135M:
 * 9 heads over 3, D 64), 32 rows over 256 cached tokens, thread CPU time, alternating
 * with the row-by-row kernel in one process: 0.52 vs 0.63 ms (best of 40; of the 0.52:
 * transposing K ~0.05, the score FMAs ~0.15, softmax + V + the rest ~0.32). Within one
 * engine step (the layer's K/V no longer in cache) the kernel's share of a step went
 * 33.1 -> 31.6 ms at 32 new tokens, 64.3 -> 60.0 at 64, 148.9 -> 130.6 for a 288-token
 * prompt (medians of 7, alternating): a small gain, as the row-by-row code was not
 * L2-bound (grouping rows with its own arithmetic, to reuse K/V tiles from L1, gained
 * nothing: 0.88 vs 0.92 ms) and V's FMAs are the same here. */
#define GROUP_ROWS 8

/* Whether fp32 rows of head size D take the AVX-512 code (the only one with groups). */
static int f32_vector_path(int64_t D) {
#ifdef __AVX512F__
    return D == 16 || D == 32 || D == 64 || D == 128 || D == 256;
#else
    (void)D;
    return 0;
#endif
}

/* Scratch floats of a group before its off array (see group_avx512_impl). */
static int64_t group_head_floats(int64_t H, int64_t D, int64_t Lp) {
    return (GROUP_ROWS * (H * Lp + H * D + H) + 16 * D + 1) & ~(int64_t)1;
}

static void group_rows(const float *q, int64_t q_stride, const float *k_cache,
                       const float *v_cache, const int32_t *table, const int32_t *lens, int64_t n,
                       int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t BSTR, float scale,
                       float *out, int64_t out_stride, float *scratch, int64_t Lp_max, int pf) {
#ifdef __AVX512F__
    float *s = scratch;
    float *acc = s + GROUP_ROWS * H * Lp_max;
    float *inv = acc + GROUP_ROWS * H * D;
    float *kt = inv + GROUP_ROWS * H;
    int64_t *off = (int64_t *)(scratch + group_head_floats(H, D, Lp_max));
    (void)pf; /* no prefetching: a group's K/V are mostly in cache (see prefetch_tile) */
#define AVX512_CASE(C)                                                                      \
    group_avx512_impl(q, q_stride, k_cache, v_cache, table, lens, n, H, KVH, BS, BSTR, scale, \
                      out, out_stride, s, acc, inv, kt, off, Lp_max, C);                    \
    return;
    F32_HEAD_SIZES(AVX512_CASE)
#undef AVX512_CASE
#endif
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)table, (void)lens, (void)n;
    (void)H, (void)KVH, (void)D, (void)BS, (void)BSTR, (void)scale, (void)out;
    (void)out_stride, (void)scratch, (void)Lp_max, (void)pf;
}

/* Whether bf16 rows of head size D take the AVX-512 code (the only one that can
 * run a chunk of a split row). */
static int bf16_vector_path(int64_t D) {
#ifdef __AVX512F__
    return D == 32 || D == 64 || D == 128 || D == 256;
#else
    (void)D;
    return 0;
#endif
}

/* part: NULL, or where a chunk of a split row leaves [max H | sum H | acc H * D]
 * instead of writing out (bf16_vector_path(D) only). pf: prefetch this row's tiles
 * (see prefetch_tile). next_table / next_L: the row this thread takes next (its
 * first K tile is prefetched), or NULL. */
static void one_row_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int32_t *table, int64_t L, int64_t H, int64_t KVH, int64_t D,
                         int64_t BS, int64_t BSTR, float scale, uint16_t *out, float *scratch,
                         int64_t Lp_max, float *part, int pf, const int32_t *next_table,
                         int64_t next_L) {
    float *s = scratch;
    float *acc = s + H * Lp_max;
    float *inv = acc + H * D;
    int64_t *off = (int64_t *)(scratch + scratch_head_floats(H, D, Lp_max));
#ifdef __AVX512F__
#define AVX512_CASE(P)                                                                      \
    one_row_avx512_bf16_impl(q, k_cache, v_cache, table, L, H, KVH, BS, BSTR, scale, out, s, acc, \
                             inv, off, part, pf, next_table, next_L, P);                    \
    return;
    switch (D) {
    case 32: AVX512_CASE(1)
    case 64: AVX512_CASE(2)
    case 128: AVX512_CASE(4)
    case 256: AVX512_CASE(8)
    }
#undef AVX512_CASE
#endif
    (void)off, (void)part, (void)pf, (void)next_table, (void)next_L;
    one_row_generic_bf16(q, k_cache, v_cache, table, L, H, KVH, D, BS, BSTR, scale, out, s, acc, inv);
}

/* Splitting rows. A decode step of fewer rows than threads left all but R threads
 * idle (batch 1: one core of two, whatever the context). Rows of a call with fewer
 * than SPLIT_ROWS_BELOW rows are cut into chunks of SPLIT_CHUNK tokens (bf16 on the
 * AVX-512 code only: fp32 decode stays bit-identical to what it was); each chunk is a work
 * item with its own softmax max and sum, and the chunks of a row are merged after
 * all items ran: out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) sum_c,
 * M = max_c m_c (merge_chunks). The rule depends on R and the lengths only, never
 * on the thread count, so one and two threads give identical results. 256 tokens:
 * a 1024-token row is 4 items (some load balance on a shared machine); rows of up
 * to 256 are not split, as waking a second thread for them cost more than it saved
 * (bf16, batch 1, 200 tokens: 15 us split into 128 + 72 against 12 us whole). The
 * merge reads 2 + D floats per head and chunk, nothing against a chunk's K/V. */
#define SPLIT_ROWS_BELOW 4
#define SPLIT_CHUNK 256

/* One work item: a whole row, or chunk c of a split row (tokens [c * chunk, ...)). */
typedef struct {
    int64_t row;
    const int32_t *table; /* from the item's first token */
    int64_t len;          /* tokens of the item; 0: nothing to do */
    int64_t part;         /* index of its partial result, or -1 (a whole row) */
} item_t;

/* first: NULL (item i is row i), or first[r] the first item of row r (R + 1 entries). */
static item_t item_at(int64_t i, const int64_t *first, int64_t R, const int32_t *tables,
                      int64_t t_stride, const int32_t *row_seq, const int32_t *lens,
                      int64_t chunk, int64_t BS) {
    int64_t r = i, c = 0;
    if (first != NULL) {
        for (r = 0; r + 1 < R && first[r + 1] <= i; ++r) {
        }
        c = i - first[r];
    }
    const int64_t seq = row_seq ? row_seq[r] : r;
    const int split = first != NULL && first[r + 1] - first[r] > 1;
    const int64_t t0 = split ? c * chunk : 0, L = lens[r];
    const int64_t len = split ? (L - t0 < chunk ? L - t0 : chunk) : L;
    return (item_t){r, tables + seq * t_stride + t0 / BS, len, split ? i : -1};
}

/* out [H, D] bf16 of a split row from its n chunk results (layout of one_row_bf16's
 * part; acc in the [P][even 16 | odd 16] order of the AVX-512 code). */
static void merge_chunks(const float *parts, int64_t n, int64_t H, int64_t D,
                         uint16_t *out) {
    const int64_t stride = 2 * H + H * D;
    for (int64_t h = 0; h < H; ++h) {
        float M = parts[h], total = 0.0f, a[256];
        for (int64_t c = 1; c < n; ++c)
            M = parts[c * stride + h] > M ? parts[c * stride + h] : M;
        for (int64_t i = 0; i < D; ++i) a[i] = 0.0f;
        for (int64_t c = 0; c < n; ++c) {
            const float *pc = parts + c * stride, w = exp_nonpos(pc[h] - M);
            total += w * pc[H + h];
            for (int64_t i = 0; i < D; ++i) a[i] += w * pc[2 * H + h * D + i];
        }
        for (int64_t i = 0; i < D; ++i) {
            const int64_t k = i % 32, e = 32 * (i / 32) + (k < 16 ? 2 * k : 2 * (k - 16) + 1);
            out[h * D + e] = f32_to_bf16(a[i] / total);
        }
    }
}

/* Whether fp32 row r joins the group of the rows before it (`run` of them): the same
 * sequence, both rows non-empty (a length-0 row breaks a group), room left. Counting
 * the groups and marking their starts (attend) must agree row for row: one predicate. */
static inline int joins_group(const int32_t *row_seq, const int32_t *lens, int64_t r,
                              int64_t run) {
    return r > 0 && run < GROUP_ROWS && row_seq[r] == row_seq[r - 1] && lens[r] > 0 &&
           lens[r - 1] > 0;
}

/* Attends R query rows (fp32 or bf16 elements). Row r: query q + r * q_stride, output out + r * out_stride,
 * the first lens[r] tokens of the sequence whose block table is row
 * (row_seq ? row_seq[r] : r) of `tables` (n_tables rows of t_width ids, row
 * stride t_stride); lens[r] == 0 skips the row (its output is left alone).
 * Returns 0; -1 when memory ran out (a thread that cannot allocate its scratch just
 * takes no items, the others do them all; -1 when none could, or the split rows'
 * partial results had no room); -2 - r when row r has a length
 * outside [0, t_width * BS], a sequence index outside [0, n_tables) or a block
 * id outside [0, NB) (all checked before anything is read or written). */
static int attend(int bf16, const void *q, int64_t q_stride, const void *k_cache,
                  const void *v_cache, int64_t NB, const int32_t *tables, int64_t n_tables,
                  int64_t t_stride, int64_t t_width, const int32_t *row_seq,
                  const int32_t *lens, int64_t R, int64_t H, int64_t KVH, int64_t D,
                  int64_t BS, int64_t BSTR, float scale, void *out, int64_t out_stride,
                  int num_threads) {
    int64_t max_len = 1;
    for (int64_t r = 0; r < R; ++r) {
        const int64_t L = lens[r], seq = row_seq ? row_seq[r] : r;
        if (L < 0 || L > t_width * BS || seq < 0 || seq >= n_tables) return (int)(-2 - r);
        const int32_t *table = tables + seq * t_stride;
        for (int64_t i = 0; i < (L + BS - 1) / BS; ++i)
            if (table[i] < 0 || table[i] >= NB) return (int)(-2 - r);
        max_len = L > max_len ? L : max_len;
    }
    if (R <= 0) return 0;
    /* Work items (see SPLIT_ROWS_BELOW): rows, or chunks of rows when R is small. */
    const int64_t chunk =
        bf16 && R < SPLIT_ROWS_BELOW && bf16_vector_path(D) && SPLIT_CHUNK % BS == 0
            ? SPLIT_CHUNK
            : 0;
    int64_t first_buf[SPLIT_ROWS_BELOW + 1], *first = NULL, n_items = R;
    if (chunk) {
        first = first_buf;
        first[0] = 0;
        for (int64_t r = 0; r < R; ++r)
            first[r + 1] = first[r] + (lens[r] > chunk ? (lens[r] + chunk - 1) / chunk : 1);
        n_items = first[R];
        if (n_items == R) first = NULL; /* no row is longer than a chunk */
        else max_len = max_len < chunk ? max_len : chunk; /* no item is */
    }
    float *parts = NULL;
    const int64_t part_floats = 2 * H + H * D;
    if (first != NULL) {
        parts = malloc((size_t)(n_items * part_floats) * sizeof(float));
        if (parts == NULL) return -1;
    }
    /* fp32: consecutive rows of one sequence (a prefill chunk) in groups of up to
     * GROUP_ROWS (see group_avx512_impl); then item i is rows gs[i] .. gs[i + 1]. */
    int64_t *gs = NULL, widest = 1;
    if (!bf16 && row_seq != NULL && f32_vector_path(D)) {
        int64_t n_groups = 0, run = 0;
        for (int64_t r = 0; r < R; ++r) {
            run = joins_group(row_seq, lens, r, run) ? run + 1 : 1;
            n_groups += run == 1;
            widest = run > widest ? run : widest;
        }
        if (widest > 1) {
            gs = malloc((size_t)(n_groups + 1) * sizeof(int64_t));
            if (gs == NULL) {
                free(parts);
                return -1;
            }
            n_groups = 0, run = 0;
            for (int64_t r = 0; r < R; ++r) {
                run = joins_group(row_seq, lens, r, run) ? run + 1 : 1;
                if (run == 1) gs[n_groups++] = r;
            }
            gs[n_groups] = R;
            n_items = n_groups;
        }
    }
    const int64_t Lp_max = (max_len + 15) & ~(int64_t)15;
    const int64_t head_floats =
        gs != NULL ? group_head_floats(H, D, Lp_max) : scratch_head_floats(H, D, Lp_max);
    const size_t scratch_bytes = (size_t)(head_floats + 2 * Lp_max) * sizeof(float);
    int64_t next = 0, done = 0;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > n_items) num_threads = (int)n_items;
#pragma omp parallel num_threads(num_threads)
    {
        float *s = malloc(scratch_bytes);
        /* Each thread claims its next item before it runs the current one, so the
         * current one can prefetch the next one's first K tile (bf16). Prefetching
         * pays only where K/V come from memory: an item over the same table as this
         * thread's previous one (the rows of one prefill) finds them in cache, and
         * there the prefetch instructions cost ~20% (prefill 512, 1 thread). */
        const int32_t *prev = NULL;
        int64_t i = s != NULL ? __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED) : n_items;
        while (i < n_items) {
            const int64_t ni = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
            if (gs != NULL && gs[i + 1] - gs[i] > 1) { /* fp32 rows of one sequence */
                const int64_t r = gs[i];
                const int32_t *table = tables + (int64_t)row_seq[r] * t_stride;
                group_rows((const float *)q + r * q_stride, q_stride, k_cache, v_cache, table,
                           lens + r, gs[i + 1] - r, H, KVH, D, BS, BSTR, scale,
                           (float *)out + r * out_stride, out_stride, s, Lp_max,
                           table != prev);
                prev = table;
                __atomic_fetch_add(&done, 1, __ATOMIC_RELAXED);
                i = ni;
                continue;
            }
            const item_t it = item_at(gs != NULL ? gs[i] : i, first, R, tables, t_stride,
                                      row_seq, lens, chunk, BS);
            if (it.len > 0) {
                const int64_t r = it.row;
                if (bf16) {
                    item_t nx = {0, NULL, 0, -1};
                    if (ni < n_items)
                        nx = item_at(ni, first, R, tables, t_stride, row_seq, lens, chunk, BS);
                    one_row_bf16((const uint16_t *)q + r * q_stride, k_cache, v_cache,
                                 it.table, it.len, H, KVH, D, BS, BSTR, scale,
                                 (uint16_t *)out + r * out_stride, s, Lp_max,
                                 it.part < 0 ? NULL : parts + it.part * part_floats,
                                 it.table != prev,
                                 nx.len > 0 && nx.table != it.table ? nx.table : NULL, nx.len);
                } else
                    one_row((const float *)q + r * q_stride, k_cache, v_cache, it.table,
                            it.len, H, KVH, D, BS, BSTR, scale, (float *)out + r * out_stride, s,
                            Lp_max, it.table != prev);
                prev = it.table;
            }
            __atomic_fetch_add(&done, 1, __ATOMIC_RELAXED);
            i = ni;
        }
        free(s);
    }
    if (done == n_items && first != NULL)
        for (int64_t r = 0; r < R; ++r)
            if (first[r + 1] - first[r] > 1)
                merge_chunks(parts + first[r] * part_floats, first[r + 1] - first[r], H, D,
                             (uint16_t *)out + r * out_stride);
    free(parts);
    free(gs);
    return done == n_items ? 0 : -1;
}

int pagedserve_attend_f32(const float *q, int64_t q_stride, const float *k_cache,
                          const float *v_cache, int64_t NB, const int32_t *tables,
                          int64_t n_tables, int64_t t_stride, int64_t t_width,
                          const int32_t *row_seq, const int32_t *lens, int64_t R, int64_t H,
                          int64_t KVH, int64_t D, int64_t BS, int64_t BSTR, float scale, float *out,
                          int64_t out_stride, int num_threads) {
    return attend(0, q, q_stride, k_cache, v_cache, NB, tables, n_tables, t_stride, t_width,
                  row_seq, lens, R, H, KVH, D, BS, BSTR, scale, out, out_stride, num_threads);
}

/* The same in bf16: q, the caches and out hold bf16 (as uint16_t), strides in
 * elements; fp32 arithmetic inside, out rounded to nearest even. */
int pagedserve_attend_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                           const uint16_t *v_cache, int64_t NB, const int32_t *tables,
                           int64_t n_tables, int64_t t_stride, int64_t t_width,
                           const int32_t *row_seq, const int32_t *lens, int64_t R, int64_t H,
                           int64_t KVH, int64_t D, int64_t BS, int64_t BSTR, float scale, uint16_t *out,
                           int64_t out_stride, int num_threads) {
    return attend(1, q, q_stride, k_cache, v_cache, NB, tables, n_tables, t_stride, t_width,
                  row_seq, lens, R, H, KVH, D, BS, BSTR, scale, out, out_stride, num_threads);
}
