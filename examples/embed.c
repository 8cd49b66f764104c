/* Embeds three sparse_mlir kernels (CSR SpMV, CSR SpMM, 2:4 SpMM) in a plain C program
 * and checks each against a reference computed here. No Python at run time. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "example_spmm.h"
#include "example_spmm_24.h"
#include "example_spmv.h"

static unsigned long long state = 12345;
static double next_random(void) { /* deterministic LCG in [0, 1) */
  state = state * 6364136223846793005ULL + 1442695040888963407ULL;
  return (double)(state >> 11) / 9007199254740992.0;
}

typedef struct { int rows, cols; int32_t *pos, *crd; double *val; } csr;

static csr random_csr(int rows, int cols, double density) {
  csr m = {rows, cols, calloc(rows + 1, sizeof(int32_t)), malloc(sizeof(int32_t) * rows * cols),
           malloc(sizeof(double) * rows * cols)};
  int nnz = 0;
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < cols; ++j)
      if (next_random() < density) { m.crd[nnz] = j; m.val[nnz++] = next_random() - 0.5; }
    m.pos[i + 1] = nnz;
  }
  return m;
}

static int check(const char* what, int32_t status, double err, double tol) {
  int ok = status == SPARSE_MLIR_OK && err <= tol;
  printf("%-28s status=%d max_err=%.3g %s\n", what, status, err, ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}

static int spmv(void) {
  csr a = random_csr(300, 200, 0.05);
  double x[200], y[300], ref[300] = {0};
  for (int j = 0; j < 200; ++j) x[j] = next_random();
  for (int i = 0; i < 300; ++i)
    for (int p = a.pos[i]; p < a.pos[i + 1]; ++p) ref[i] += a.val[p] * x[a.crd[p]];
  int nnz = a.pos[300];
  int32_t status = example_spmv(a.pos, 301, a.crd, nnz, a.val, nnz, x, 200, y, 300);
  double err = 0;
  for (int i = 0; i < 300; ++i) err = fmax(err, fabs(y[i] - ref[i]));
  int failed = check("CSR SpMV (float64)", status, err, 1e-12);
  /* a wrong dense size is refused with a status, not a wild access */
  int32_t refused = example_spmv(a.pos, 301, a.crd, nnz, a.val, nnz, x, 199, y, 300);
  printf("%-28s status=%d %s\n", "SpMV wrong size refused", refused,
         refused == SPARSE_MLIR_SIZE_MISMATCH ? "ok" : "FAILED");
  failed |= refused != SPARSE_MLIR_SIZE_MISMATCH;
  free(a.pos); free(a.crd); free(a.val);
  return failed;
}

static int spmm(void) {
  enum { M = 300, K = 200, N = 24 };
  csr a = random_csr(M, K, 0.1);
  int nnz = a.pos[M];
  float* val = malloc(sizeof(float) * (nnz ? nnz : 1));
  for (int p = 0; p < nnz; ++p) val[p] = (float)a.val[p];
  float *b = malloc(sizeof(float) * K * N), *c = malloc(sizeof(float) * M * N);
  double* ref = calloc(M * N, sizeof(double));
  for (int i = 0; i < K * N; ++i) b[i] = (float)next_random();
  for (int i = 0; i < M; ++i)
    for (int p = a.pos[i]; p < a.pos[i + 1]; ++p)
      for (int j = 0; j < N; ++j) ref[i * N + j] += (double)val[p] * b[a.crd[p] * N + j];
  int32_t status = example_spmm(a.pos, M + 1, a.crd, nnz, val, nnz, b, K, N, c, M, N);
  double err = 0;
  for (int i = 0; i < M * N; ++i) err = fmax(err, fabs(c[i] - ref[i]));
  int failed = check("CSR SpMM (float32)", status, err, 1e-4);
  free(a.pos); free(a.crd); free(a.val); free(val); free(b); free(c); free(ref);
  return failed;
}

static int spmm_24(void) {
  enum { M = 64, K = 128, N = 16, KEPT = M * K / 2 };
  int8_t* offsets = malloc(KEPT);
  float* val = malloc(sizeof(float) * KEPT);
  float *b = malloc(sizeof(float) * K * N), *c = malloc(sizeof(float) * M * N);
  double* ref = calloc(M * N, sizeof(double));
  for (int g = 0; g < M * K / 4; ++g) { /* two of every four columns, in increasing order */
    int first = (int)(next_random() * 3), second = first + 1 + (int)(next_random() * (3 - first));
    offsets[2 * g] = (int8_t)first; offsets[2 * g + 1] = (int8_t)second;
    val[2 * g] = (float)next_random(); val[2 * g + 1] = (float)next_random();
  }
  for (int i = 0; i < K * N; ++i) b[i] = (float)next_random();
  for (int g = 0; g < M * K / 4; ++g) {
    int row = g / (K / 4), base = (g % (K / 4)) * 4;
    for (int e = 0; e < 2; ++e)
      for (int j = 0; j < N; ++j) ref[row * N + j] += (double)val[2 * g + e] * b[(base + offsets[2 * g + e]) * N + j];
  }
  int32_t status = example_spmm_24(offsets, KEPT, val, KEPT, b, K, N, c, M, N);
  double err = 0;
  for (int i = 0; i < M * N; ++i) err = fmax(err, fabs(c[i] - ref[i]));
  int failed = check("2:4 SpMM (float32)", status, err, 1e-4);
  free(offsets); free(val); free(b); free(c); free(ref);
  return failed;
}

int main(void) {
  int failed = spmv() | spmm() | spmm_24();
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
