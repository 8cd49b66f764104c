/* What our two implementations of LLVM's OpenMP entry points share: ``kmp_pool.c`` (our own pool) and
 * ``kmp_on_gomp.c`` (on torch's libgomp).  The kernels MLIR lowers call ``__kmpc_fork_call`` with a microtask
 * that takes ``(int32 *gtid, int32 *btid, shared...)``, the shared variables as separate variadic arguments
 * (the lowering passes one: a struct pointer), and ask for worksharing loops by LLVM's schedule numbers. */
#ifndef SPARSE_MLIR_KMP_ABI_H
#define SPARSE_MLIR_KMP_ABI_H

#include <stdint.h>

#define EXPORT __attribute__((visibility("default")))
#define MAX_SHARED 16 /* shared-variable arguments of a region kept: the lowering passes one */

typedef void (*microtask_t)(int32_t *, int32_t *, ...);

enum { KMP_STATIC_CHUNKED = 33, KMP_STATIC = 34, KMP_DYNAMIC = 35, KMP_GUIDED = 36, KMP_RUNTIME = 37 };
#define KMP_MODIFIERS ((1u << 29) | (1u << 30) | (1u << 31)) /* monotonic, nonmonotonic, ordered-ness bits */

/* Run ``task`` as thread ``gtid`` of its region with its ``count`` shared variables ``a``. */
static inline void call_microtask(microtask_t task, int count, void *const *a, int32_t gtid) {
    int32_t btid = gtid;
    switch (count) {
    case 0: task(&gtid, &btid); break;
    case 1: task(&gtid, &btid, a[0]); break;
    case 2: task(&gtid, &btid, a[0], a[1]); break;
    case 3: task(&gtid, &btid, a[0], a[1], a[2]); break;
    case 4: task(&gtid, &btid, a[0], a[1], a[2], a[3]); break;
    default: /* extra arguments past the callee's count are ignored by the calling convention */
        task(&gtid, &btid, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13],
             a[14], a[15]);
        break;
    }
}

/* The end of a masked block: nothing to do in either runtime (``__kmpc_masked`` has no barrier to pair). */
EXPORT void __kmpc_end_masked(void *loc, int32_t gtid) {
    (void)loc;
    (void)gtid;
}

#endif
