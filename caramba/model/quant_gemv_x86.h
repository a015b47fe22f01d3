/* What quant_gemv_x86.c shares with quant_gemv.c's dispatch: the x86-64 levels' kernels for
   row-major blocks, each under the build's target for its level, and the names the dispatch
   tables take for them (NULL where the build lacks the level: isa_pick never chooses it there). */

#ifndef CARAMBA_QUANT_GEMV_X86_H
#define CARAMBA_QUANT_GEMV_X86_H

#include "quant_gemv_ref.h"

#if HAVE_AVX2
HIDDEN quantize_row_fn quantize_row_avx2;
HIDDEN quant_rows_fn quant_rows_avx2;
HIDDEN block_sums_fn block_sums_x86;
HIDDEN best_block_fn best_block_avx2;
#define QUANTIZE_ROW_X86 quantize_row_avx2
#define QUANT_ROWS_AVX2 quant_rows_avx2
#define BLOCK_SUMS_X86 block_sums_x86
#else
#define QUANTIZE_ROW_X86 NULL
#define QUANT_ROWS_AVX2 NULL
#define BLOCK_SUMS_X86 NULL
#endif

#if HAVE_AVX2 && defined(__AVXVNNI__)
HIDDEN quant_rows_fn quant_rows_avxvnni;
#define QUANT_ROWS_AVXVNNI quant_rows_avxvnni
#else
#define QUANT_ROWS_AVXVNNI NULL
#endif

#if HAVE_AVX512
HIDDEN quant_rows_fn quant_rows_avx512;
#define QUANT_ROWS_AVX512 quant_rows_avx512
#else
#define QUANT_ROWS_AVX512 NULL
#endif

#if HAVE_AVX512VNNI
HIDDEN quant_rows_fn quant_rows_avx512vnni;
#define QUANT_ROWS_AVX512VNNI quant_rows_avx512vnni
#else
#define QUANT_ROWS_AVX512VNNI NULL
#endif

#if HAVE_AVX2 && defined(__F16C__)
HIDDEN dequantize_row_fn dequantize_row_avx2;
#define DEQUANTIZE_ROW_X86 dequantize_row_avx2
#else
#define DEQUANTIZE_ROW_X86 NULL
#endif

#endif
