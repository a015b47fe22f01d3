/* A software model of the AMX instructions quant_gemm.c issues, for a test build of it
   (-DCARAMBA_AMX_EMULATE, tests/model/test_quant_prefill.py) that runs the amx level's packing, strides,
   tile configurations and epilogues on an AVX-512 VNNI CPU without AMX. It is not a kernel (a
   tile product takes microseconds) and never part of a normal build.

   After the pseudocode of Intel's SDM, vol. 2 (LDTILECFG, TILELOADD, TILESTORED, TILEZERO,
   TDPBSSD, TDPBF16PS, TILERELEASE), palette 1: 8 tiles of up to 16 rows of 64 bytes, per thread.
   Where the hardware faults (#UD or #GP: no configuration on this thread, shapes that do not
   chain, a tile past the palette, reserved bytes set) the model aborts, so a test sees the crash
   the CPU would give.
     TILELOADD   rows x colsb bytes, row r from base + r * stride; the rest of the tile zeroed
     TDPBSSD     C[m][n] += sum over k, i < 4 of int8 A[m][4k+i] * int8 B[k][4n+i] (int32, wrapping)
     TDPBF16PS   C[m][n] += A[m][2k] B[k][2n], then += A[m][2k+1] B[k][2n+1] (fp32, each product
                 exact; bf16 inputs below the normal range read as zero, results below it flushed) */

#ifndef CARAMBA_AMX_EMULATE_H
#define CARAMBA_AMX_EMULATE_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct amx_emu_state {
    int configured;
    uint8_t rows[8];
    uint16_t colsb[8];
    uint8_t data[8][16][64];
};
static __thread struct amx_emu_state amx_emu;

static void amx_emu_fault(const char *what, int t) {
    fprintf(stderr, "amx_emulate: %s (tile %d): the hardware would fault\n", what, t);
    abort();
}

static void amx_emu_check(int t) {
    if (!amx_emu.configured) amx_emu_fault("no tile configuration on this thread", t);
    if (t < 0 || t > 7 || !amx_emu.rows[t] || !amx_emu.colsb[t]) amx_emu_fault("an unconfigured tile", t);
}

/* The palette-1 layout of LDTILECFG's 64 bytes: palette, start_row, 14 reserved, 16 colsb
   (uint16), 16 rows (uint8). */
static void amx_emu_loadconfig(const void *config) {
    const uint8_t *c = config;
    memset(&amx_emu, 0, sizeof amx_emu);
    if (c[0] == 0) return;   /* palette 0: the tiles released */
    if (c[0] != 1) amx_emu_fault("a palette other than 1", -1);
    for (int i = 1; i < 16; i++)
        if (c[i]) amx_emu_fault("a nonzero start_row or reserved byte", -1);
    for (int t = 0; t < 16; t++) {
        uint16_t colsb;
        memcpy(&colsb, c + 16 + 2 * t, 2);
        const uint8_t rows = c[48 + t];
        if (t >= 8 ? rows || colsb : rows > 16 || colsb > 64 || (colsb & 3) || !rows != !colsb)
            amx_emu_fault("a tile shape outside palette 1", t);
        if (t < 8) amx_emu.rows[t] = rows, amx_emu.colsb[t] = colsb;
    }
    amx_emu.configured = 1;
}

static void amx_emu_loadd(int t, const void *base, long stride) {
    amx_emu_check(t);
    memset(amx_emu.data[t], 0, sizeof amx_emu.data[t]);
    for (int r = 0; r < amx_emu.rows[t]; r++)
        memcpy(amx_emu.data[t][r], (const uint8_t *)base + r * stride, amx_emu.colsb[t]);
}

static void amx_emu_stored(int t, void *base, long stride) {
    amx_emu_check(t);
    for (int r = 0; r < amx_emu.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, amx_emu.data[t][r], amx_emu.colsb[t]);
}

static void amx_emu_zero(int t) {
    amx_emu_check(t);
    memset(amx_emu.data[t], 0, sizeof amx_emu.data[t]);
}

/* The shapes a tile product needs: C is rows(A) x colsb(B), and A's 4-byte columns are B's rows. */
static void amx_emu_chain(int c, int a, int b) {
    amx_emu_check(c), amx_emu_check(a), amx_emu_check(b);
    if (c == a || c == b || a == b) amx_emu_fault("a tile used twice in one product", c);
    if (amx_emu.rows[c] != amx_emu.rows[a] || amx_emu.colsb[c] != amx_emu.colsb[b]
        || amx_emu.colsb[a] / 4 != amx_emu.rows[b])
        amx_emu_fault("tile shapes that do not chain", c);
}

static void amx_emu_dpbssd(int c, int a, int b) {
    amx_emu_chain(c, a, b);
    for (int m = 0; m < amx_emu.rows[c]; m++)
        for (int n = 0; n < amx_emu.colsb[c] / 4; n++) {
            int32_t acc;
            memcpy(&acc, amx_emu.data[c][m] + 4 * n, 4);
            uint32_t sum = (uint32_t)acc;   /* wraps as the hardware's int32 does */
            for (int k = 0; k < amx_emu.colsb[a] / 4; k++)
                for (int i = 0; i < 4; i++)
                    sum += (uint32_t)((int32_t)(int8_t)amx_emu.data[a][m][4 * k + i]
                                      * (int32_t)(int8_t)amx_emu.data[b][k][4 * n + i]);
            acc = (int32_t)sum;
            memcpy(amx_emu.data[c][m] + 4 * n, &acc, 4);
        }
}

static float amx_emu_bf16(const uint8_t *p) {   /* denormals read as zero */
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t bits = (h & 0x7f80u) ? (uint32_t)h << 16 : (uint32_t)(h & 0x8000u) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float amx_emu_ftz(float x) { return fabsf(x) < 0x1p-126f ? copysignf(0.0f, x) : x; }

static void amx_emu_dpbf16ps(int c, int a, int b) {
    amx_emu_chain(c, a, b);
    for (int m = 0; m < amx_emu.rows[c]; m++)
        for (int n = 0; n < amx_emu.colsb[c] / 4; n++) {
            float acc;
            memcpy(&acc, amx_emu.data[c][m] + 4 * n, 4);
            for (int k = 0; k < amx_emu.colsb[a] / 4; k++)
                for (int i = 0; i < 2; i++) {
                    const float p = amx_emu_bf16(amx_emu.data[a][m] + 4 * k + 2 * i)
                                    * amx_emu_bf16(amx_emu.data[b][k] + 4 * n + 2 * i);   /* exact */
                    acc = amx_emu_ftz(acc + p);
                }
            memcpy(amx_emu.data[c][m] + 4 * n, &acc, 4);
        }
}

/* The intrinsics' names, over whatever immintrin.h defined (it does where the build has AMX). */
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbssd
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) amx_emu_loadconfig(config)
#define _tile_release() memset(&amx_emu, 0, sizeof amx_emu)
#define _tile_loadd(t, base, stride) amx_emu_loadd(t, base, stride)
#define _tile_stored(t, base, stride) amx_emu_stored(t, base, stride)
#define _tile_zero(t) amx_emu_zero(t)
#define _tile_dpbssd(c, a, b) amx_emu_dpbssd(c, a, b)
#define _tile_dpbf16ps(c, a, b) amx_emu_dpbf16ps(c, a, b)

#endif
