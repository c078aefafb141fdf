/* bf16 <-> fp32 for the package's C sources (cpu_ops.c, attention/cpu_attention.c).
 * A bf16 is the high half of an fp32. Rounding to nearest even; a NaN stays a NaN
 * (its quiet bit is in the kept half). cbuild.py hashes this file into the build key
 * of every source that includes it. */
#ifndef PAGEDSERVE_BF16_H
#define PAGEDSERVE_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#endif
