/* What the prefill GEMMs' files share (quant_gemm.c: the int8 and fp32-activation GEMMs and the
   level; quant_gemm_i16.c: the int16-activation GEMM): the run-time level, chosen once in
   quant_gemm.c (CARAMBA_ISA caps it) and set by gemm_isa_set. */

#ifndef CARAMBA_QUANT_GEMM_H
#define CARAMBA_QUANT_GEMM_H

#include "cpu_isa.h"

enum { LVL_SCALAR = 0, LVL_AVX2 = 1, LVL_AVXVNNI = 2, LVL_VNNI = 3, LVL_AMX = 4, LVL_COUNT = 5 };

/* the level in force (quant_gemm.c's g_level) */
HIDDEN int gemm_level(void);

#endif
