/* What every CPU kernel file of the model's libraries shares (cpu_isa.c; the quant_gemv*.c files,
   step_linear.c, kv_stream.c, decode_ops.c, decode_step.c; caramba/cache's quant_attend*.c): the
   instruction sets the build's target has (HAVE_*), the level chosen at run time (g_isa,
   cpu_isa.c), and the small inline helpers the loops take from one another (fp16 conversion, a
   horizontal sum).

   Functions one file shares with another are HIDDEN: not exported from the library, and called
   directly rather than through the PLT. */

#ifndef CARAMBA_CPU_ISA_H
#define CARAMBA_CPU_ISA_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif
/* 512-bit products (the avx512 and avx512vnni levels), where the build's target has them */
#if HAVE_AVX2 && defined(__F16C__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif
#if HAVE_AVX512 && defined(__AVX512VNNI__)
#define HAVE_AVX512VNNI 1
#else
#define HAVE_AVX512VNNI 0
#endif
/* 128-bit ARM products (the neon level): AArch64's Advanced SIMD, with the int8 dot product (sdot,
   vdotq_s32) where the build's target has it (ARMv8.2-A+dotprod and later: Neoverse N1, Graviton2,
   Apple M1), else the same int32 lanes from widening multiplies and pairwise adds. */
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define HAVE_NEON 1
#else
#define HAVE_NEON 0
#endif
#if HAVE_NEON && defined(__ARM_FEATURE_DOTPROD)
#define HAVE_NEON_DOT 1
#else
#define HAVE_NEON_DOT 0
#endif

#define INLINE static inline __attribute__((always_inline))
#define HIDDEN __attribute__((visibility("hidden")))

/* Two families above the shared scalar level: x86-64's (avx2 .. avx512vnni, each including the
   ones below it) and ARM's (neon). A level of one family is never chosen on the other's machines
   (cpu_isa.c), so a check like g_isa >= ISA_AVX2 sits inside #if HAVE_AVX2. */
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVXVNNI = 2, ISA_AVX512 = 3, ISA_AVX512VNNI = 4, ISA_NEON = 5,
       ISA_LEVELS = 6 };

/* The library's level: set when it loads (CARAMBA_ISA, or the best usable) and by isa_set, never
   while a product runs. ISA_SCALAR runs every loop's portable reference (*_ref). */
extern HIDDEN int g_isa;

/* Exported (caramba.model.isa): the level's name; whether a level is usable here; set one;
   whether CARAMBA_ISA named no level; AMX usable. */
const char *isa_name(void);
int isa_available(const char *name);
int isa_set(const char *name);
int isa_env_error(void);
int isa_amx(void);

static inline float fp16_to_fp32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else {                                   /* subnormal: renormalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

#if HAVE_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#endif
