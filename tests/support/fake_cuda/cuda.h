/* A stand-in for the CUDA Driver API (tests only): records what a generated launcher does, prints launches. */
#ifndef FAKE_CUDA_H
#define FAKE_CUDA_H
#include <stdint.h>
#include <stdio.h>
#include <stddef.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void* CUmodule;
typedef void* CUfunction;
typedef void* CUstream;
typedef uint64_t cuuint64_t;
typedef uint32_t cuuint32_t;
typedef struct { uint64_t opaque[16]; } CUtensorMap;
typedef int CUfunction_attribute;
typedef int CUtensorMapDataType, CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
    CUtensorMapFloatOOBfill;
#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_FOUND 500
#define CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES 8

static int fake_param_count[8];      /* words per launch, set by the test program */
static int fake_launches = 0;
static CUdeviceptr fake_next = 0xA000; /* allocations are handed out from here, 0x100 apart */

static inline CUresult cuModuleLoad(CUmodule* m, const char* path) { (void)path; *m = (CUmodule)0; return CUDA_SUCCESS; }
static inline CUresult cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
  (void)m; *f = (CUfunction)name; return CUDA_SUCCESS;
}
static inline CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute attribute, int value) {
  printf("attribute %s %d %d\n", (const char*)f, attribute, value); return CUDA_SUCCESS;
}
static inline CUresult cuTensorMapEncodeTiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* base,
    const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box, const cuuint32_t* steps,
    CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill oob) {
  (void)map; (void)steps; (void)interleave; (void)l2; (void)oob;
  printf("tensormap %d %u %p %llu %llu %llu %u %u %d\n", type, rank, base, (unsigned long long)dims[0],
         (unsigned long long)dims[1], (unsigned long long)strides[0], box[0], box[1], swizzle);
  return CUDA_SUCCESS;
}
static inline CUresult cuModuleUnload(CUmodule m) { (void)m; return CUDA_SUCCESS; }
static inline CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream s) {
  (void)s; printf("memset %llu %u %zu\n", p, v, n); return CUDA_SUCCESS;
}
static inline CUresult cuMemAllocAsync(CUdeviceptr* p, size_t n, CUstream s) {
  (void)s; *p = fake_next; fake_next += 0x100; printf("alloc %llu %zu\n", *p, n); return CUDA_SUCCESS;
}
static inline CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { (void)s; printf("free %llu\n", p); return CUDA_SUCCESS; }
static inline CUresult cuMemcpyHtoDAsync(CUdeviceptr p, const void* h, size_t n, CUstream s) {
  (void)s; printf("copy %llu %zu last %lld\n", p, n, (long long)((const int32_t*)h)[n / sizeof(int32_t) - 1]);
  return CUDA_SUCCESS;
}
static inline CUresult cuMemcpyDtoDAsync(CUdeviceptr d, CUdeviceptr from, size_t n, CUstream s) {
  (void)s; printf("device copy %llu %llu %zu\n", d, from, n); return CUDA_SUCCESS;
}
static inline CUresult cuStreamSynchronize(CUstream s) { (void)s; return CUDA_SUCCESS; }
static inline CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                               unsigned bz, unsigned shared, CUstream s, void** params, void** extra) {
  (void)s; (void)extra;
  printf("launch %s %u %u %u %u %u %u %u", (const char*)f, gx, gy, gz, bx, by, bz, shared);
  for (int i = 0; i < fake_param_count[fake_launches]; ++i) printf(" %llu", (unsigned long long)*(uint64_t*)params[i]);
  printf("\n");
  ++fake_launches;
  return CUDA_SUCCESS;
}
#endif
