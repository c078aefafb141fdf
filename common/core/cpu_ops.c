/* Fused elementwise ops of the decoder on the CPU, bf16 and fp32: one pass over the data,
 * each bf16 rounding exactly where transformers' bf16 forward rounds. Built and loaded by
 * cpu_ops.py; see its docstring for why and for what each op replaces. The fp32 row
 * helpers (the "-- fp32 --" parts) are the same formulas without the roundings to bf16,
 * each product, sum and quotient rounded to fp32 in torch's order (-ffp-contract=off
 * keeps the compiler from fusing them); one macro instantiates the entry points for
 * both types (DEFINE_ENTRY_POINTS, at the end). In fp32 the sums of squares are in
 * double as for bf16, and SiLU's exp is the same polynomial, so those two differ from
 * torch's by a few fp32 ulps (cpu_ops.py).
 *
 *   rms_norm       h = w * bf16(x * 1/sqrt(mean(x^2) + eps))            (w*... rounded)
 *   add_rms_norm   s = bf16(x + y);  h = rms_norm(s)
 *   silu_and_mul   out = bf16(bf16(g / (1 + exp(-g))) * u),  [g | u] = one row of gate_up
 *   rope           (optionally rms_norm each head first: Qwen3's q/k norm), then in place
 *                  lo = bf16(bf16(x1 * c_lo) - bf16(x2 * s_lo))
 *                  hi = bf16(bf16(x2 * c_hi) + bf16(x1 * s_hi))
 *
 * All arithmetic is fp32 on the fp32 values of the bf16 inputs; a product of two bf16 is
 * exact in fp32, so rounding it to bf16 once is what torch does too. Rounding is to
 * nearest even by integer arithmetic on the fp32 bits (torch's c10::BFloat16 rule; a
 * NaN stays a NaN, its bits may differ from torch's), not VCVTNEPS2BF16, which flushes denormals. The one place where the
 * result can differ from torch's is the sum of squares of RMSNorm: torch sums in fp32 in
 * blocks, this kernel in double (closest to the exact mean, so what differs is torch's own
 * rounding); the fp32 means may differ in their last bit, and a normalized value lying
 * next to a bf16 rounding boundary then rounds the other way (one bf16 step, two after
 * the multiply by the weight; 11 in 6M elements measured; the tests bound the count). SiLU's exp is a polynomial within ~1 fp32 ulp of torch's (Sleef);
 * the same kind of rare one-ulp bf16 difference follows from it.
 *
 * Built with -ffp-contract=off: an FMA where the source says multiply, then round, then
 * add would skip a rounding that torch does. Explicit FMAs are used only where torch's
 * order is not reproduced anyway (sums of squares, the exp polynomial).
 *
 * With AVX-512 (F, BW, VL) 16 elements go at a time, tails through masked loads and
 * stores; otherwise plain loops. Rows are split among the caller's thread count (torch's)
 * by an OpenMP static schedule, or run on the calling thread when there is too little
 * work to pay for waking the others (MIN_PER_THREAD elements each).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define OPS_AVX512 1
#include <immintrin.h>

#include "avx512_exp.h" /* exp512_reduced */
#else
#define OPS_AVX512 0
#endif

/* Below this many elements per thread a parallel region costs more than it saves
 * (measured here: a 64 x 576 RMSNorm takes ~10 us on one thread). */
#define MIN_PER_THREAD 16384

static inline int threads_for(int64_t rows, int64_t elems_per_row, int num_threads) {
    int64_t by_work = rows * elems_per_row / MIN_PER_THREAD;
    int64_t n = num_threads < by_work ? num_threads : by_work;
    n = n < rows ? n : rows;
    return n < 1 ? 1 : (int)n;
}

/* ---- scalar bf16 <-> fp32 ----------------------------------------------------------- */

/* bf16_to_f32, f32_to_bf16 */
#include "bf16.h"

/* f rounded to bf16, as fp32 */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* ---- AVX-512 ------------------------------------------------------------------------ */
#if OPS_AVX512

static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}

/* up to 16 bf16 (mask m) -> fp32 lanes */
static inline __m512 load_bf16(const uint16_t *p, __mmask16 m) {
    const __m256i v = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* fp32 lanes rounded to nearest even, as 32-bit lanes holding the bf16 in the high half
 * (so also the fp32 value of the rounded bf16). No NaN test: every value rounded here is
 * computed from bf16 values, and a NaN so made (an operand's, quieted, or the default
 * one) has its low 16 bits zero, so the rounding adds no carry and it stays a NaN. */
static inline __m512i round_hi(__m512 f) {
    const __m512i b = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    return _mm512_and_si512(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                            _mm512_set1_epi32((int)0xffff0000u));
}

static inline __m512 round_bf16_v(__m512 f) { return _mm512_castsi512_ps(round_hi(f)); }

static inline void store_bf16(uint16_t *p, __m512 f, __mmask16 m) {
    const __m256i v = _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_hi(f), 16));
    _mm256_mask_storeu_epi16(p, m, v);
}

/* acc += v * v for the 16 lanes of v, in double: each square is exact, and so is the
 * sum but for the last bits, so the mean lies as close to torch's (blocked fp32 sum)
 * as can be; with fp32 lanes here about twice as many rows had a mean off by a bit. */
static inline void add_squares(__m512d acc[2], __m512 v) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    const __m512d hi =
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    acc[0] = _mm512_fmadd_pd(lo, lo, acc[0]);
    acc[1] = _mm512_fmadd_pd(hi, hi, acc[1]);
}

static inline float inv_rms_of(const __m512d acc[2], int64_t n, float eps) {
    const float sum = (float)_mm512_reduce_add_pd(_mm512_add_pd(acc[0], acc[1]));
    return 1.0f / sqrtf(sum / (float)n + eps);
}

static float inv_rms_bf16(const uint16_t *x, int64_t n, float eps) {
    __m512d acc[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()};
    for (int64_t i = 0; i < n; i += 16) add_squares(acc, load_bf16(x + i, tail_mask(n - i)));
    return inv_rms_of(acc, n, eps);
}

static void scale_row_bf16(const uint16_t *x, const uint16_t *w, uint16_t *h, int64_t n, float r) {
    const __m512 vr = _mm512_set1_ps(r);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 y = round_bf16_v(_mm512_mul_ps(load_bf16(x + i, m), vr));
        store_bf16(h + i, _mm512_mul_ps(load_bf16(w + i, m), y), m);
    }
}

/* s = bf16(x + y); returns 1 / rms of s */
static float add_row_bf16(const uint16_t *x, const uint16_t *y, uint16_t *s, int64_t n, float eps) {
    __m512d acc[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()};
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512i hi = round_hi(_mm512_add_ps(load_bf16(x + i, m), load_bf16(y + i, m)));
        _mm256_mask_storeu_epi16(s + i, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(hi, 16)));
        add_squares(acc, _mm512_castsi512_ps(hi));
    }
    return inv_rms_of(acc, n, eps);
}

/* exp(z), z clamped to [-88, 89] (exp(-88) + 1 == 1; exp(89) overflows to inf, as
 * torch's does): Cephes' expf polynomial on z - n ln2, scaled by 2^n with scalef so
 * that results near the overflow threshold are not lost. */
static inline __m512 exp_v(__m512 z) {
    z = _mm512_min_ps(_mm512_max_ps(z, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(89.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(z, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return exp512_reduced(z, n);
}

static void silu_mul_row_bf16(const uint16_t *g, const uint16_t *u, uint16_t *out, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 gf = load_bf16(g + i, m);
        const __m512 e = exp_v(_mm512_sub_ps(_mm512_setzero_ps(), gf));
        /* NaN in g stays NaN through the numerator (the clamp in exp_v maps it to a
         * number); -inf gives inf / inf = NaN and +inf gives inf, as in torch. */
        const __m512 act = _mm512_div_ps(gf, _mm512_add_ps(one, e));
        store_bf16(out + i, _mm512_mul_ps(round_bf16_v(act), load_bf16(u + i, m)), m);
    }
}

static void rope_head_bf16(uint16_t *x, const uint16_t *c, const uint16_t *s, int64_t half) {
    for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = tail_mask(half - i);
        const __m512 x1 = load_bf16(x + i, m), x2 = load_bf16(x + half + i, m);
        const __m512 lo = _mm512_sub_ps(round_bf16_v(_mm512_mul_ps(x1, load_bf16(c + i, m))),
                                        round_bf16_v(_mm512_mul_ps(x2, load_bf16(s + i, m))));
        const __m512 hi =
            _mm512_add_ps(round_bf16_v(_mm512_mul_ps(x2, load_bf16(c + half + i, m))),
                          round_bf16_v(_mm512_mul_ps(x1, load_bf16(s + half + i, m))));
        store_bf16(x + i, lo, m);
        store_bf16(x + half + i, hi, m);
    }
}

/* -- fp32 -- */

/* sum of squares of x[0..n) in double (each square exact), as for bf16 above */
static float inv_rms_f32(const float *x, int64_t n, float eps) {
    __m512d acc[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()};
    for (int64_t i = 0; i < n; i += 16)
        add_squares(acc, _mm512_maskz_loadu_ps(tail_mask(n - i), x + i));
    return inv_rms_of(acc, n, eps);
}

/* h = w * (x * r): torch's order (the normalized value rounded, then the weight) */
static void scale_row_f32(const float *x, const float *w, float *h, int64_t n, float r) {
    const __m512 vr = _mm512_set1_ps(r);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vr);
        _mm512_mask_storeu_ps(h + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + i), y));
    }
}

/* s = x + y; returns 1 / rms of s */
static float add_row_f32(const float *x, const float *y, float *s, int64_t n, float eps) {
    __m512d acc[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()};
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
        _mm512_mask_storeu_ps(s + i, m, v);
        add_squares(acc, v);
    }
    return inv_rms_of(acc, n, eps);
}

static void silu_mul_row_f32(const float *g, const float *u, float *out, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 gf = _mm512_maskz_loadu_ps(m, g + i);
        const __m512 e = exp_v(_mm512_sub_ps(_mm512_setzero_ps(), gf));
        const __m512 act = _mm512_div_ps(gf, _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(act, _mm512_maskz_loadu_ps(m, u + i)));
    }
}

static void rope_head_f32(float *x, const float *c, const float *s, int64_t half) {
    for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = tail_mask(half - i);
        const __m512 x1 = _mm512_maskz_loadu_ps(m, x + i);
        const __m512 x2 = _mm512_maskz_loadu_ps(m, x + half + i);
        const __m512 lo = _mm512_sub_ps(_mm512_mul_ps(x1, _mm512_maskz_loadu_ps(m, c + i)),
                                        _mm512_mul_ps(x2, _mm512_maskz_loadu_ps(m, s + i)));
        const __m512 hi = _mm512_add_ps(_mm512_mul_ps(x2, _mm512_maskz_loadu_ps(m, c + half + i)),
                                        _mm512_mul_ps(x1, _mm512_maskz_loadu_ps(m, s + half + i)));
        _mm512_mask_storeu_ps(x + i, m, lo);
        _mm512_mask_storeu_ps(x + half + i, m, hi);
    }
}

#else /* plain C: the same arithmetic element by element */

/* The squares summed in double, as in the AVX-512 path (a sequential fp32 sum strays
 * further from torch's blocked one: 2.3x as many differing outputs measured). */
static float inv_rms_bf16(const uint16_t *x, int64_t n, float eps) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        const float v = bf16_to_f32(x[i]);
        sum += (double)(v * v);
    }
    return 1.0f / sqrtf((float)sum / (float)n + eps);
}

static void scale_row_bf16(const uint16_t *x, const uint16_t *w, uint16_t *h, int64_t n, float r) {
    for (int64_t i = 0; i < n; ++i)
        h[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(x[i]) * r));
}

/* s = bf16(x + y); returns 1 / rms of s */
static float add_row_bf16(const uint16_t *x, const uint16_t *y, uint16_t *s, int64_t n, float eps) {
    for (int64_t i = 0; i < n; ++i) s[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
    return inv_rms_bf16(s, n, eps);
}

static void silu_mul_row_bf16(const uint16_t *g, const uint16_t *u, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        const float gf = bf16_to_f32(g[i]);
        const float act = round_bf16(gf / (1.0f + expf(-gf)));
        out[i] = f32_to_bf16(act * bf16_to_f32(u[i]));
    }
}

static void rope_head_bf16(uint16_t *x, const uint16_t *c, const uint16_t *s, int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
        const float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + half]);
        const float lo = round_bf16(x1 * bf16_to_f32(c[i])) -
                         round_bf16(x2 * bf16_to_f32(s[i]));
        const float hi = round_bf16(x2 * bf16_to_f32(c[i + half])) +
                         round_bf16(x1 * bf16_to_f32(s[i + half]));
        x[i] = f32_to_bf16(lo);
        x[i + half] = f32_to_bf16(hi);
    }
}

/* -- fp32 -- */

static float inv_rms_f32(const float *x, int64_t n, float eps) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += (double)x[i] * (double)x[i];
    return 1.0f / sqrtf((float)sum / (float)n + eps);
}

static void scale_row_f32(const float *x, const float *w, float *h, int64_t n, float r) {
    for (int64_t i = 0; i < n; ++i) {
        const float y = x[i] * r;
        h[i] = w[i] * y;
    }
}

static float add_row_f32(const float *x, const float *y, float *s, int64_t n, float eps) {
    for (int64_t i = 0; i < n; ++i) s[i] = x[i] + y[i];
    return inv_rms_f32(s, n, eps);
}

static void silu_mul_row_f32(const float *g, const float *u, float *out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        const float act = g[i] / (1.0f + expf(-g[i]));
        out[i] = act * u[i];
    }
}

static void rope_head_f32(float *x, const float *c, const float *s, int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        const float a = x1 * c[i], b = x2 * s[i], p = x2 * c[i + half], q = x1 * s[i + half];
        x[i] = a - b;
        x[i + half] = p + q;
    }
}

#endif

/* ---- entry points (bf16 as uint16_t; strides in elements; rows contiguous) -------- */

/* `for` over the T rows of an entry point, split among threads_for(T, WORK, num_threads)
 * threads by an OpenMP static schedule (DO_PRAGMA: WORK substituted, then stringized). */
#define DO_PRAGMA(x) _Pragma(#x)
#define PARALLEL_ROWS(WORK)                                                                 \
    DO_PRAGMA(omp parallel for num_threads(threads_for(T, WORK, num_threads)) schedule(static))

/* The entry points of one element type E, named pagedserve_<op>_SFX, on that type's row
 * helpers <helper>_SFX above. The bodies are the same for every type; what a type
 * changes (the roundings to bf16 or their absence) lives in the helpers. A macro, as
 * DEFINE_ONE_ROW_GENERIC in attention/cpu_attention.c, rather than one body taking
 * helper pointers: the helpers stay inlined into the loops, and the bodies compile to
 * the code the hand-written per-type copies did (so the results stay bit-identical).
 *
 *   pagedserve_rms_norm_SFX      out[t] = rms_norm(x[t]) * w for T rows of N; out may
 *                                be x (in place).
 *   pagedserve_add_rms_norm_SFX  s = x + y (rounded to E; s may be x or y: in place),
 *                                h = rms_norm(s) * w; all [T, N] contiguous.
 *   pagedserve_silu_and_mul_SFX  out [T, I] contiguous = silu(gate) * up, gate_up rows
 *                                [gate: I | up: I] at gu_stride.
 *   pagedserve_rope_SFX          in place on x [T, heads, D] (row t at x + t * x_stride,
 *                                heads contiguous): each head first rms-normalized with
 *                                norm_w [D] when norm_w is not NULL, then rotated by
 *                                cos/sin [T, D] (row t at + t * cs_stride). D even.
 *
 * (E, not T, names the type: T is the row count.) */
#define DEFINE_ENTRY_POINTS(SFX, E)                                                         \
    void pagedserve_rms_norm_##SFX(const E *x, int64_t x_stride, const E *w, E *out,        \
                                   int64_t out_stride, int64_t T, int64_t N, float eps,     \
                                   int num_threads) {                                       \
        PARALLEL_ROWS(N)                                                                    \
        for (int64_t t = 0; t < T; ++t) {                                                   \
            const E *xt = x + t * x_stride;                                                 \
            scale_row_##SFX(xt, w, out + t * out_stride, N, inv_rms_##SFX(xt, N, eps));     \
        }                                                                                   \
    }                                                                                       \
                                                                                            \
    void pagedserve_add_rms_norm_##SFX(const E *x, const E *y, E *s, const E *w, E *h,      \
                                       int64_t T, int64_t N, float eps, int num_threads) {  \
        PARALLEL_ROWS(2 * N)                                                                \
        for (int64_t t = 0; t < T; ++t) {                                                   \
            const float r = add_row_##SFX(x + t * N, y + t * N, s + t * N, N, eps);         \
            scale_row_##SFX(s + t * N, w, h + t * N, N, r);                                 \
        }                                                                                   \
    }                                                                                       \
                                                                                            \
    void pagedserve_silu_and_mul_##SFX(const E *gate_up, int64_t gu_stride, E *out,         \
                                       int64_t T, int64_t I, int num_threads) {             \
        PARALLEL_ROWS(2 * I)                                                                \
        for (int64_t t = 0; t < T; ++t) {                                                   \
            const E *g = gate_up + t * gu_stride;                                           \
            silu_mul_row_##SFX(g, g + I, out + t * I, I);                                   \
        }                                                                                   \
    }                                                                                       \
                                                                                            \
    void pagedserve_rope_##SFX(E *x, int64_t x_stride, int64_t T, int64_t heads, int64_t D, \
                               const E *cos, const E *sin, int64_t cs_stride,               \
                               const E *norm_w, float eps, int num_threads) {               \
        PARALLEL_ROWS(heads * D)                                                            \
        for (int64_t t = 0; t < T; ++t) {                                                   \
            const E *c = cos + t * cs_stride, *s = sin + t * cs_stride;                     \
            for (int64_t j = 0; j < heads; ++j) {                                           \
                E *xh = x + t * x_stride + j * D;                                           \
                if (norm_w != NULL)                                                         \
                    scale_row_##SFX(xh, norm_w, xh, D, inv_rms_##SFX(xh, D, eps));          \
                rope_head_##SFX(xh, c, s, D / 2);                                           \
            }                                                                               \
        }                                                                                   \
    }

DEFINE_ENTRY_POINTS(bf16, uint16_t)
DEFINE_ENTRY_POINTS(f32, float)
