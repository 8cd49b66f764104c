/* Embeds three sparse_mlir kernels (CSR SpMV, CSR SpMM, 2:4 SpMM) in a plain C program
 * and checks each against a reference computed here. No Python at run time. The SpMV is
 * shape-generic (exported without SHAPES): one function for every size. */
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

/* example_spmv is shape-generic (no SHAPES in CMakeLists.txt): A's sizes are arguments */
static int spmv_at(int rows, int cols) {
  csr a = random_csr(rows, cols, 0.05);
  double *x = malloc(sizeof(double) * cols), *y = malloc(sizeof(double) * rows), *ref = calloc(rows, sizeof(double));
  for (int j = 0; j < cols; ++j) x[j] = next_random();
  for (int i = 0; i < rows; ++i)
    for (int p = a.pos[i]; p < a.pos[i + 1]; ++p) ref[i] += a.val[p] * x[a.crd[p]];
  int nnz = a.pos[rows];
  int32_t status = example_spmv(a.pos, rows + 1, a.crd, nnz, a.val, nnz, rows, cols, x, cols, y, rows);
  double err = 0;
  for (int i = 0; i < rows; ++i) err = fmax(err, fabs(y[i] - ref[i]));
  char what[64];
  snprintf(what, sizeof what, "CSR SpMV %dx%d (float64)", rows, cols);
  int failed = check(what, status, err, 1e-12);
  /* sizes that disagree are refused with a status, not a wild access: a dense size, then A's rows against
   * its positions (rows + 1 of them) */
  int32_t wrong_x = example_spmv(a.pos, rows + 1, a.crd, nnz, a.val, nnz, rows, cols, x, cols - 1, y, rows);
  int32_t wrong_rows = example_spmv(a.pos, rows + 1, a.crd, nnz, a.val, nnz, rows + 1, cols, x, cols, y, rows + 1);
  int refused = wrong_x == SPARSE_MLIR_SIZE_MISMATCH && wrong_rows == SPARSE_MLIR_BAD_LEVELS;
  printf("%-28s status=%d,%d %s\n", "SpMV wrong sizes refused", wrong_x, wrong_rows, refused ? "ok" : "FAILED");
  free(a.pos); free(a.crd); free(a.val); free(x); free(y); free(ref);
  return failed | !refused;
}

static int spmv(void) { return spmv_at(300, 200) | spmv_at(57, 1000); }

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
