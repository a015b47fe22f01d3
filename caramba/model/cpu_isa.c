/* Which instruction set the quantized products run with, chosen once per library at run time.

   The library is built for the machine it runs on (-march=native, caramba.kernels), so a kernel
   family is compiled only where the compiler was told the CPU has it (the __AVX512VNNI__-style
   macros). That alone would trust the build; the choice also asks the CPU and the OS now
   (__builtin_cpu_supports reads cpuid and XGETBV: AVX-512 counts only where the OS saves its
   registers), so a library copied to, or a VM migrated onto, a smaller CPU never runs an
   instruction that would SIGILL. Levels, each a family of kernels (quant_gemv.c dispatches):

     scalar      the portable reference products (*_ref), one element at a time
     avx2        256-bit integer multiply-adds (maddubs/madd), the kernels tuned on an AMD EPYC
     avxvnni     the same with AVX-VNNI's vpdpbusd/vpdpwssd (256-bit, VEX: Alder Lake and later)
     avx512      512-bit: two 32-blocks of q8 per instruction (AVX-512 F/BW/VL)
     avx512vnni  512-bit vpdpbusd for the int8 products, 256-bit vpdpwssd for the int16 ones
     neon        AArch64 only: 128-bit sdot (vdotq_s32) for the int8 products where the build has
                 the dot-product extension (else widening multiplies), vmull_s16 for the int16 ones;
                 on Linux it needs the CPU's ASIMD (and, in a +dotprod build, ASIMDDP) hwcaps

   Every level's int32 block sums are exact, and every vector level sums them into the same lanes
   in the same order as avx2 (neon: its two 128-bit halves as avx2's one 256-bit vector), so their
   outputs are bit-identical to avx2's (tests/model/test_isa.py, tests/model/test_cross_arm.py); the scalar
   reference sums in another order (within fp32 rounding of them).

   CARAMBA_ISA=<level> asks for a level (tests, A/B timings); a level the CPU or the build lacks
   falls back to the best one below it in its family, never above (isa_name() says what was
   chosen): on ARM an x86 level gives scalar, on x86 neon does.
   AMX (tile int8/bf16 matmul, prefill-sized) needs the OS's leave to use its 8 KiB tile state:
   isa_amx() asks for it with arch_prctl(ARCH_REQ_XCOMP_PERM) and reports a refusal as absent. */

#include "cpu_isa.h"

#include <stdlib.h>
#include <string.h>
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
long syscall(long number, ...);   /* unistd.h declares it only outside strict -std=c11 */
#endif
#if defined(__linux__) && defined(__aarch64__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1UL << 1)
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1UL << 20)
#endif
#endif

static const char *const ISA_NAMES[ISA_LEVELS] = {"scalar", "avx2", "avxvnni", "avx512", "avx512vnni", "neon"};

/* Compiled in (the build's target has the instructions the level's kernels use). */
static int isa_built(int level) {
    switch (level) {
    case ISA_SCALAR: return 1;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    case ISA_AVX2: return 1;
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVXVNNI__)
    case ISA_AVXVNNI: return 1;
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVX512F__) && defined(__AVX512BW__) \
    && defined(__AVX512VL__)
    case ISA_AVX512: return 1;
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVX512F__) && defined(__AVX512BW__) \
    && defined(__AVX512VL__) && defined(__AVX512VNNI__)
    case ISA_AVX512VNNI: return 1;
#endif
#if HAVE_NEON
    case ISA_NEON: return 1;
#endif
    default: return 0;
    }
}

/* The CPU (and the OS, for the register state) has it now. */
static int isa_cpu_has(int level) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                       && __builtin_cpu_supports("avx512vl");
    switch (level) {
    case ISA_SCALAR: return 1;
    case ISA_AVX2: return avx2;
    case ISA_AVXVNNI: return avx2 && __builtin_cpu_supports("avxvnni");
    case ISA_AVX512: return avx512;
    case ISA_AVX512VNNI: return avx512 && __builtin_cpu_supports("avx512vnni");
    default: return 0;
    }
#elif defined(__linux__) && defined(__aarch64__)
    /* the kernel's hwcaps (a VM or a container may show fewer than the silicon has) */
    const unsigned long hw = getauxval(AT_HWCAP);
    if (level == ISA_NEON) return (hw & HWCAP_ASIMD) && (!HAVE_NEON_DOT || (hw & HWCAP_ASIMDDP));
    return level == ISA_SCALAR;
#elif defined(__aarch64__)
    return level == ISA_SCALAR || level == ISA_NEON;   /* no hwcaps to ask: the build's target is trusted */
#else
    return level == ISA_SCALAR;
#endif
}

static int isa_usable(int level) { return level >= 0 && level < ISA_LEVELS && isa_built(level) && isa_cpu_has(level); }

/* ARM's family (else x86-64's; scalar is both's). */
static int isa_arm(int level) { return level == ISA_NEON; }

/* The level to run for a wish (a name, or NULL/"" for the best): the wished one where usable,
   else the best usable below it in its family (scalar at the bottom of both). -1 for a name that
   is no level. */
static int isa_pick(const char *wish) {
    int top = ISA_LEVELS - 1, any = 1;
    if (wish && *wish) {
        for (top = 0; top < ISA_LEVELS && strcmp(wish, ISA_NAMES[top]); top++) {}
        if (top == ISA_LEVELS) return -1;
        any = 0;
    }
    for (int level = top; level > 0; level--)
        if ((any || isa_arm(level) == isa_arm(top)) && isa_usable(level)) return level;
    return ISA_SCALAR;
}

/* The library's level: set once when it is loaded, from CARAMBA_ISA (an unknown name: the best,
   and isa_env_error() says so), and by isa_set (tests, benchmarks). */
HIDDEN int g_isa = ISA_SCALAR;
static int g_isa_env_error = 0;

__attribute__((constructor)) static void isa_init(void) {
    const char *wish = getenv("CARAMBA_ISA");
    const int level = isa_pick(wish);
    g_isa_env_error = level < 0;
    g_isa = level < 0 ? isa_pick(NULL) : level;
}

/* Exported: the chosen level's name; whether the CPU and the build have a level; set a level
   (returns the level now in force, which is the asked one's fallback where it is not usable, or
   -1 leaving the level as it was for a name that is no level); CARAMBA_ISA was not a level. */
const char *isa_name(void) { return ISA_NAMES[g_isa]; }

int isa_available(const char *name) {
    for (int level = 0; level < ISA_LEVELS; level++)
        if (!strcmp(name, ISA_NAMES[level])) return isa_usable(level);
    return 0;
}

int isa_set(const char *name) {
    const int level = isa_pick(name);
    if (level >= 0) g_isa = level;
    return level;
}

int isa_env_error(void) { return g_isa_env_error; }

/* AMX: 1 where the CPU has AMX-TILE and AMX-INT8 and the OS lets this process use the tile data
   (asked once; Linux >= 5.16), 0 otherwise: refused, an older kernel, another OS or CPU. */
int isa_amx(void) {
#if defined(__linux__) && defined(__x86_64__)
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(0), "c"(0));
    if (a < 7) return 0;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return 0;   /* AMX-TILE, AMX-INT8 */
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}
