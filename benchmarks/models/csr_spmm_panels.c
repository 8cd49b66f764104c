/* A C model of the CSR SpMM's inner loops (N = 128 float32, AVX-512), for deciding what the emitter should
 * try next; not a kernel of the package.
 *
 * It times two loop orders on a CSR matrix written by ``csr_spmm_panels.py`` (a DLMC pattern or a random one):
 *   rows:  each row of A whole, C's row in 8 zmm accumulators (what ``dialects/native/spmm.py`` emits);
 *   walk:  blocks of R rows walk B panel by panel (KP rows of B), each row resuming where its last panel
 *          stopped (a cursor) and stopping at the panel's end inside the loop condition.
 * B is copied to a fresh 64-byte-aligned buffer each call, as the emitted kernel does.
 *
 * Session 24 (Zen 5, 1 thread, DLMC 512^2 at 90%): rows 63.5-65.2 us, walk 52.3-56.1 us (KP=128, R=64).
 * The same walk emitted through MLIR (scf.while, cursor in an alloca, C reloaded per panel) measured no gain
 * over whole rows in alternating processes (66-70 us against 64-70 us), so it was not landed: the
 * difference between this loop and the emitted one is the open question.
 *
 *   python benchmarks/models/csr_spmm_panels.py DLMC_NAME_PART     # writes /tmp/csr_spmm_model.bin
 *   cc -O3 -march=native -o /tmp/model benchmarks/models/csr_spmm_panels.c && /tmp/model [KP] [R]
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <math.h>

enum { N = 128, MAX_BLOCK = 1024 };
static int M, K, NNZ, KP = 128, R = 64;
static int *pos, *crd;
static float *val;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

static void tile_row(const float *B, float *c, int lo, int hi) {
    __m512 a[8];
    for (int u = 0; u < 8; u++) a[u] = _mm512_setzero_ps();
    for (int p = lo; p < hi; p++) {
        const float *b = B + (size_t)crd[p] * N;
        __m512 v = _mm512_set1_ps(val[p]);
        for (int u = 0; u < 8; u++) a[u] = _mm512_fmadd_ps(v, _mm512_loadu_ps(b + 16 * u), a[u]);
    }
    for (int u = 0; u < 8; u++) _mm512_storeu_ps(c + 16 * u, a[u]);
}

static void rows(const float *B, float *C) {
    for (int i = 0; i < M; i++) tile_row(B, C + (size_t)i * N, pos[i], pos[i + 1]);
}

static void walk(const float *B, float *C) {
    int cursor[MAX_BLOCK];
    for (int ib = 0; ib < M; ib += R) {
        int ie = ib + R < M ? ib + R : M;
        for (int i = ib; i < ie; i++) cursor[i - ib] = pos[i];
        for (int klo = 0; klo < (K > 0 ? K : 1); klo += KP) {
            int khi = klo + KP;
            for (int i = ib; i < ie; i++) {
                float *c = C + (size_t)i * N;
                __m512 a[8];
                for (int u = 0; u < 8; u++) a[u] = klo == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(c + 16 * u);
                int p = cursor[i - ib];
                for (; p < pos[i + 1] && crd[p] < khi; p++) {
                    const float *b = B + (size_t)crd[p] * N;
                    __m512 v = _mm512_set1_ps(val[p]);
                    for (int u = 0; u < 8; u++) a[u] = _mm512_fmadd_ps(v, _mm512_loadu_ps(b + 16 * u), a[u]);
                }
                cursor[i - ib] = p;
                for (int u = 0; u < 8; u++) _mm512_storeu_ps(c + 16 * u, a[u]);
            }
        }
    }
}

int main(int argc, char **argv) {
    if (argc > 1) KP = atoi(argv[1]);
    if (argc > 2) R = atoi(argv[2]);
    if (KP < 1 || R < 1 || R > MAX_BLOCK) { fprintf(stderr, "KP >= 1, 1 <= R <= %d\n", MAX_BLOCK); return 2; }
    FILE *f = fopen("/tmp/csr_spmm_model.bin", "rb");
    long h[3];
    if (!f || fread(h, 8, 3, f) != 3) { fprintf(stderr, "run csr_spmm_panels.py first\n"); return 2; }
    M = (int)h[0], K = (int)h[1], NNZ = (int)h[2];
    pos = malloc(4 * ((size_t)M + 1)), crd = malloc(4 * (size_t)NNZ), val = malloc(4 * (size_t)NNZ);
    if (fread(pos, 4, M + 1, f) != (size_t)M + 1 || fread(crd, 4, NNZ, f) != (size_t)NNZ ||
        fread(val, 4, NNZ, f) != (size_t)NNZ) { fprintf(stderr, "short file\n"); return 2; }
    float *B = malloc(4 * (size_t)K * N), *C = aligned_alloc(64, 4 * (size_t)M * N), *ref = malloc(4 * (size_t)M * N);
    for (size_t t = 0; t < (size_t)K * N; t++) B[t] = (float)((t * 2654435761u) % 1000) / 1000.f;
    rows(B, ref);
    const char *names[2] = {"rows", "walk"};
    for (int w = 0; w < 2; w++) {
        double best = 1e9;
        for (int r = 0; r < 300; r++) {
            double t = now();
            float *copy = aligned_alloc(64, 4 * (size_t)K * N);
            memcpy(copy, B, 4 * (size_t)K * N);
            (w ? walk : rows)(copy, C);
            free(copy);
            t = now() - t;
            if (t < best) best = t;
        }
        double err = 0;
        for (size_t t = 0; t < (size_t)M * N; t++) err = fmax(err, fabs(C[t] - ref[t]));
        printf("%s KP=%d R=%d: best %.1f us (%.2f ns a nonzero), max difference from rows %.1e\n", names[w], KP, R,
               best * 1e6, best * 1e9 / NNZ, err);
    }
    return 0;
}
