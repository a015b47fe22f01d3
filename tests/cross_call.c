/* Calls the functions of a kernel library built for another architecture, run under an emulator
   (qemu-aarch64): tests/cross_arch.py sends each call down a pipe, this program makes it and sends
   the results back. The kernels' exports take only integers and pointers (no float arguments), so
   one call shape serves them all: up to 16 64-bit integer-class arguments (AAPCS64 passes the
   first 8 in x0-x7 and the rest in 8-byte stack slots, an int or a pointer alike).

   Request (native little endian): u32 name length, name, u32 argument count, then per argument a
   tag: 'i' and an i64 value, or 'b', a u64 length and that many bytes (a buffer: the function gets
   a pointer to a copy); then the result's tag: 'i' (an integer), 's' (a C string) or 'v' (void).
   Reply: the result (an i64, or a u32 length and the string's bytes), then every buffer's bytes
   as the call left them. argv[1]: the library. Exits at end of input. */

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define MAX_ARGS 16

typedef int64_t fn16(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                     int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);

static int read_all(void *p, size_t n) { return fread(p, 1, n, stdin) == n; }

static void fail(const char *what, const char *detail) {
    fprintf(stderr, "cross_call: %s %s\n", what, detail ? detail : "");
    exit(2);
}

int main(int argc, char **argv) {
    if (argc != 2) fail("usage: cross_call LIBRARY", NULL);
    void *lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) fail("dlopen failed:", dlerror());
    uint32_t name_len;
    while (read_all(&name_len, 4)) {
        char name[256];
        if (name_len >= sizeof name || !read_all(name, name_len)) fail("bad name", NULL);
        name[name_len] = 0;
        fn16 *fn = (fn16 *)dlsym(lib, name);
        if (!fn) fail("no such function:", name);
        uint32_t nargs;
        if (!read_all(&nargs, 4) || nargs > MAX_ARGS) fail("bad argument count for", name);
        int64_t args[MAX_ARGS] = {0};
        void *buffers[MAX_ARGS] = {0};
        uint64_t lengths[MAX_ARGS] = {0};
        for (uint32_t i = 0; i < nargs; i++) {
            char tag;
            if (!read_all(&tag, 1)) fail("truncated call to", name);
            if (tag == 'i') {
                if (!read_all(&args[i], 8)) fail("truncated call to", name);
            } else if (tag == 'b') {
                if (!read_all(&lengths[i], 8)) fail("truncated call to", name);
                buffers[i] = malloc(lengths[i] ? lengths[i] : 1);
                if (!buffers[i] || !read_all(buffers[i], lengths[i])) fail("truncated buffer for", name);
                args[i] = (int64_t)(intptr_t)buffers[i];
            } else {
                fail("bad argument tag for", name);
            }
        }
        char ret;
        if (!read_all(&ret, 1)) fail("truncated call to", name);
        int64_t r = fn(args[0], args[1], args[2], args[3], args[4], args[5], args[6], args[7], args[8], args[9],
                       args[10], args[11], args[12], args[13], args[14], args[15]);
        if (ret == 's') {
            const char *s = (const char *)(intptr_t)r;
            uint32_t n = 0;
            while (s && s[n]) n++;
            fwrite(&n, 4, 1, stdout);
            fwrite(s, 1, n, stdout);
        } else {
            if (ret == 'v') r = 0;
            fwrite(&r, 8, 1, stdout);
        }
        for (uint32_t i = 0; i < nargs; i++)
            if (buffers[i]) {
                fwrite(buffers[i], 1, lengths[i], stdout);
                free(buffers[i]);
            }
        fflush(stdout);
    }
    return 0;
}
