/* What quant_gemv_x86_x16.c shares with quant_gemv.c's dispatch: the x86-64 levels' kernels for
   the row-interleaved (X16) formats, and the names the dispatch tables take for them (NULL where
   the build lacks them). The 256-bit ones serve avx2, avxvnni (reading g_isa for its vpdpbusd)
   and avx512; the 512-bit ones avx512vnni. */

#ifndef CARAMBA_QUANT_GEMV_X86_X16_H
#define CARAMBA_QUANT_GEMV_X86_X16_H

#include "quant_gemv_ref.h"

#if HAVE_AVX2 && defined(__F16C__)
HIDDEN x16_group_fn x16_group256, x16w_group256;   /* q8 activations; q4_1's int16 ones */
HIDDEN x16_sums_fn x16_sums_x86;
#define X16_GROUP256 x16_group256
#define X16W_GROUP256 x16w_group256
#define X16_SUMS_X86 x16_sums_x86
#else
#define X16_GROUP256 NULL
#define X16W_GROUP256 NULL
#define X16_SUMS_X86 NULL
#endif

#if HAVE_AVX512VNNI
HIDDEN x16_group_fn x16_group512, x16w_group512;   /* q8 activations; int16 ones */
#define X16_GROUP512 x16_group512
#define X16W_GROUP512 x16w_group512
#else
#define X16_GROUP512 NULL
#define X16W_GROUP512 NULL
#endif

#endif
