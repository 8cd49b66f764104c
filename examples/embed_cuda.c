/* Runs a CSR SpMV generated at build time (TARGET cuda, no SHAPES: shape-generic) through its CUDA Driver API
 * launcher at two sizes, checks both against references computed here, and checks that sizes which disagree are
 * refused (CUDA_ERROR_INVALID_VALUE). Exit status 77 (CTest: skipped) when there is no CUDA device. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "example_cuda_spmv.h"

#define ROWS 300
#define COLS 200
#define CHECK(call)                                                          \
  do {                                                                       \
    CUresult r_ = (call);                                                    \
    if (r_ != CUDA_SUCCESS) {                                                \
      fprintf(stderr, "%s failed: %d\n", #call, (int)r_);                    \
      return 1;                                                              \
    }                                                                        \
  } while (0)

int main(void) {
  int devices = 0;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGetCount(&devices) != CUDA_SUCCESS || devices == 0) {
    printf("no CUDA device: skipped\n");
    return 77;
  }
  CUdevice device;
  CUcontext context;
  int major = 0, minor = 0;
  CHECK(cuDeviceGet(&device, 0));
  CHECK(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device));
  CHECK(cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device));
  CHECK(cuDevicePrimaryCtxRetain(&context, device));
  CHECK(cuCtxSetCurrent(context));

  /* a banded CSR matrix: row i has columns i % COLS and (3 i) % COLS when different */
  int32_t pos[ROWS + 1], crd[2 * ROWS];
  float val[2 * ROWS], x[COLS], y[ROWS], expect[ROWS];
  int32_t nnz = 0;
  for (int i = 0; i < ROWS; ++i) {
    int a = i % COLS, b = (3 * i) % COLS;
    pos[i] = nnz;
    expect[i] = 0;
    int lo = a < b ? a : b, hi = a < b ? b : a;
    crd[nnz] = lo; val[nnz] = 1.0f + i % 5; nnz++;
    if (hi != lo) { crd[nnz] = hi; val[nnz] = 0.5f; nnz++; }
  }
  pos[ROWS] = nnz;
  for (int j = 0; j < COLS; ++j) x[j] = (float)(j % 7) - 3.0f;
  for (int i = 0; i < ROWS; ++i)
    for (int k = pos[i]; k < pos[i + 1]; ++k) expect[i] += val[k] * x[crd[k]];

  CUdeviceptr d_pos, d_crd, d_val, d_x, d_y;
  CHECK(cuMemAlloc(&d_pos, sizeof pos));
  CHECK(cuMemAlloc(&d_crd, nnz * sizeof(int32_t)));
  CHECK(cuMemAlloc(&d_val, nnz * sizeof(float)));
  CHECK(cuMemAlloc(&d_x, sizeof x));
  CHECK(cuMemAlloc(&d_y, sizeof y));
  CHECK(cuMemcpyHtoD(d_pos, pos, sizeof pos));
  CHECK(cuMemcpyHtoD(d_crd, crd, nnz * sizeof(int32_t)));
  CHECK(cuMemcpyHtoD(d_val, val, nnz * sizeof(float)));
  CHECK(cuMemcpyHtoD(d_x, x, sizeof x));

  char path[1024];
  snprintf(path, sizeof path, "%s/example_cuda_spmv.sm_%d0.cubin", EXAMPLE_CUDA_SPMV_CODE_DIR, major >= 9 ? 9 : 8);
  if (major * 10 + minor != (major >= 9 ? 90 : 80))  /* cubins run on their exact chip; PTX elsewhere */
    snprintf(path, sizeof path, "%s/example_cuda_spmv.sm_%d0.ptx", EXAMPLE_CUDA_SPMV_CODE_DIR, major >= 9 ? 9 : 8);
  example_cuda_spmv_module module;
  CHECK(example_cuda_spmv_load(&module, path));
  /* the whole matrix, then its first half of rows (the same buffers: positions ROWS / 2 + 1 long): one kernel */
  for (int rows = ROWS; rows >= ROWS / 2; rows -= ROWS / 2) {
    int64_t stored = pos[rows];
    CHECK(example_cuda_spmv(&module, 0, d_pos, rows + 1, d_crd, stored, d_val, stored, rows, COLS, d_x, COLS, d_y,
                            rows, 0));
    CHECK(cuStreamSynchronize(0));
    CHECK(cuMemcpyDtoH(y, d_y, rows * sizeof(float)));
    for (int i = 0; i < rows; ++i) {
      if (fabsf(y[i] - expect[i]) > 1e-5f) {
        fprintf(stderr, "%d rows, row %d: %g, expected %g\n", rows, i, y[i], expect[i]);
        return 1;
      }
    }
  }
  if (example_cuda_spmv(&module, 0, d_pos, ROWS + 1, d_crd, nnz, d_val, nnz, ROWS, COLS, d_x, COLS - 1, d_y, ROWS,
                        0) != CUDA_ERROR_INVALID_VALUE) {
    fprintf(stderr, "x of the wrong size was not refused\n");
    return 1;
  }
  CHECK(example_cuda_spmv_unload(&module));
  printf("GPU SpMV through the generated launcher at two sizes: ok\n");
  return 0;
}
