/* The vectorised exp shared by the package's C sources (cpu_ops.c, attention/
 * cpu_attention.c): Cephes' expf polynomial on 16 lanes. Each caller clamps x and
 * picks n, the integer nearest x / ln2 by its own rounding rule (they differ on
 * purpose, see the callers), then calls exp512_reduced. Include after <immintrin.h>,
 * under __AVX512F__. cbuild.py hashes this file into the build key of its includers. */
#ifndef PAGEDSERVE_AVX512_EXP_H
#define PAGEDSERVE_AVX512_EXP_H

/* exp(x) = 2^n exp(x - n ln2): ln2 in two parts so that r = x - n ln2 is exact to
 * fp32, the polynomial on r, then scaled by 2^n with scalef (no overflow of an
 * intermediate 2^n near the ends of the range). */
static inline __m512 exp512_reduced(__m512 x, __m512 n) {
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    const __m512 r2 = _mm512_mul_ps(r, r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

#endif
