/* A quantized cache's codes as floats, 8 or 16 at a time: what the attention's loops over codes
   (kv_stream.c's key scores and values) widen each code with. Code field f of byte c is
   (c >> bits f) & mask: element i + f D/k of a head vector packed k = 8 / bits to a byte
   (kv_stream.c says the layouts). */
#ifndef CARAMBA_KV_CODES_H
#define CARAMBA_KV_CODES_H

#include <stdint.h>

#include "../cache/kinds.h"
#include "cpu_isa.h"

#if HAVE_AVX2
/* Code field f of 8 consecutive bytes, as floats. */
INLINE __m256 code_fields8(const int bits, const int f, const uint8_t *c) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)c);
    if (bits == 8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    const __m256i u = _mm256_srli_epi32(_mm256_cvtepu8_epi32(b), bits * f);
    return _mm256_cvtepi32_ps(_mm256_and_si256(u, _mm256_set1_epi32((1 << bits) - 1)));
}

/* code_value of 8 consecutive bytes: the codes (nf == 0) or nf4 levels. A 16-entry lookup is two
   8-lane permutes (which read an index's low 3 bits) and a blend on its bit 3, moved to the sign
   bit; field 0's higher bits fall out of both, so it needs no mask. */
INLINE __m256 code_values8(const int bits, const int f, const int nf, const uint8_t *c) {
    if (!nf) return code_fields8(bits, f, c);
    __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
    if (f) u = _mm256_srli_epi32(u, 4);
    const __m256 lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(NF4_LEVELS), u);
    const __m256 hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(NF4_LEVELS + 8), u);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(u, 28)));
}
#endif

#if HAVE_AVX512
/* code_values8 (+ off) for 16 bytes of 2- or 4-bit codes at once: field f through one 16-entry
   permute, which reads an index's low 4 bits, so no field needs a mask: table[i] = code i & mask
   + off, or nf4's level i (code_table16). The same floats as code_values8 + off (exact), so the sums
   over them are the same bits; 3 instructions for 16 codes where code_values8 takes 4 (nf4: 6) for 8. */
INLINE __m512 code_values16(const int bits, const int f, const uint8_t *c, __m512 table) {
    __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
    if (f) u = _mm512_srli_epi32(u, bits * f);
    return _mm512_permutexvar_ps(u, table);
}

static inline __m512 code_table16(int bits, int nf, float off) {
    float t[16];
    for (int i = 0; i < 16; i++) t[i] = nf ? NF4_LEVELS[i] : (float)(i & ((1 << bits) - 1)) + off;
    return _mm512_loadu_ps(t);
}
#endif

#endif
