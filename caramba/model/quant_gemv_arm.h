/* What quant_gemv_arm.c shares with quant_gemv.c's dispatch: AArch64's neon kernels, and the
   names the dispatch tables take for them (NULL where the build lacks them: an x86 build, or
   ARMv8.0-A without the dot product for the x16 kernels). */

#ifndef CARAMBA_QUANT_GEMV_ARM_H
#define CARAMBA_QUANT_GEMV_ARM_H

#include "quant_gemv_ref.h"

#if HAVE_NEON
HIDDEN quantize_row_fn quantize_row_neon;
HIDDEN quant_rows_fn quant_rows_neon;
HIDDEN block_sums_fn block_sums_neon;
#define QUANTIZE_ROW_NEON quantize_row_neon
#define QUANT_ROWS_NEON quant_rows_neon
#define BLOCK_SUMS_NEON block_sums_neon
#else
#define QUANTIZE_ROW_NEON NULL
#define QUANT_ROWS_NEON NULL
#define BLOCK_SUMS_NEON NULL
#endif

#if HAVE_NEON_DOT
HIDDEN x16_group_fn x16_group_neon;   /* the q8-activation X16 formats */
HIDDEN x16_sums_fn x16_sums_neon;
#define X16_GROUP_NEON x16_group_neon
#define X16_SUMS_NEON x16_sums_neon
#else
#define X16_GROUP_NEON NULL
#define X16_SUMS_NEON NULL
#endif

#endif
