/* The LLVM OpenMP entry points our kernels call, run on the process's libgomp: torch's thread pool.
 *
 * Why: MLIR lowers parallel loops to calls into LLVM's OpenMP runtime
 * (__kmpc_*), which we ship as Intel's libiomp5.  torch's CPU wheel runs its
 * operators on GCC's libgomp.  Two pools on the same cores fight: libgomp's
 * workers spin for milliseconds after each torch operator, on the cores our
 * kernel's workers then need, and ours must be woken from sleep on every call
 * (MiniLM 90%, 2 threads: 230 ms with two pools, 187 with one).  This
 * library defines the handful of __kmpc_* functions the kernels import,
 * each mapped onto libgomp's GOMP_* interface of the copy already loaded in
 * the process, so a kernel's parallel region is a region of torch's pool.
 * Loaded globally before any kernel (runtime/threads.py), it takes
 * precedence over libiomp5 for the kernels' symbol lookups.
 *
 * Thread counts never touch libgomp's own setting (torch reads it before
 * each operator): omp_set_num_threads here only records the count our next
 * fork on the calling thread asks for.  A region inside a region runs on one
 * thread, as libiomp5 serializes a nested region by default.
 * tests/test_openmp_pool.py checks that every entry point the kernels import
 * is defined here.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kmp_abi.h"

#define LOOP_KINDS 4 /* static, dynamic, guided, runtime: libgomp's loop entry points */

typedef bool (*loop_start_t)(bool, unsigned long long, unsigned long long, unsigned long long, unsigned long long,
                             unsigned long long *, unsigned long long *);
typedef bool (*loop_next_t)(unsigned long long *, unsigned long long *);

static void (*gomp_parallel)(void (*)(void *), void *, unsigned, unsigned);
static loop_start_t gomp_start[LOOP_KINDS];
static loop_next_t gomp_next[LOOP_KINDS];
static void (*gomp_loop_end_nowait)(void);
static void (*gomp_barrier)(void);
static int (*gomp_thread_num)(void);
static int (*gomp_in_parallel)(void);

static __thread int wanted_threads = 1; /* the next fork's team size on this thread */
/* regions run on the calling thread alone: no libgomp bound, or in a child forked from a process whose libgomp
 * pool had threads (they do not exist in the child, and libgomp waits for them for ever) */
static volatile int serial = 1;
/* the calling thread's open worksharing loop (every thread of a team runs its own dispatch calls) */
static __thread int loop_kind;
static __thread unsigned long long loop_first, loop_end, loop_step, loop_chunk;
static __thread bool loop_started;

static int find_libgomp(struct dl_phdr_info *info, size_t size, void *found) {
    (void)size;
    if (info->dlpi_name != NULL && strstr(info->dlpi_name, "libgomp") != NULL) {
        *(const char **)found = info->dlpi_name;
        return 1;
    }
    return 0;
}

/* Bind to the libgomp already loaded in this process: 1 when every entry point was found, else 0 (then the
 * caller must not use this library). */
EXPORT int sparse_mlir_bind_libgomp(void) {
    static const char *const kinds[LOOP_KINDS] = {"static", "dynamic", "guided", "runtime"};
    const char *path = NULL;
    dl_iterate_phdr(find_libgomp, &path);
    if (path == NULL) return 0;
    void *gomp = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (gomp == NULL) return 0;
    *(void **)&gomp_parallel = dlsym(gomp, "GOMP_parallel");
    *(void **)&gomp_loop_end_nowait = dlsym(gomp, "GOMP_loop_end_nowait");
    *(void **)&gomp_barrier = dlsym(gomp, "GOMP_barrier");
    *(void **)&gomp_thread_num = dlsym(gomp, "omp_get_thread_num");
    *(void **)&gomp_in_parallel = dlsym(gomp, "omp_in_parallel");
    bool found = gomp_parallel && gomp_loop_end_nowait && gomp_barrier && gomp_thread_num && gomp_in_parallel;
    for (int k = 0; k < LOOP_KINDS; k++) {
        char name[64];
        snprintf(name, sizeof name, "GOMP_loop_ull_%s_start", kinds[k]);
        *(void **)&gomp_start[k] = dlsym(gomp, name);
        snprintf(name, sizeof name, "GOMP_loop_ull_%s_next", kinds[k]);
        *(void **)&gomp_next[k] = dlsym(gomp, name);
        found = found && gomp_start[k] && gomp_next[k];
    }
    if (found) serial = 0;
    return found ? 1 : 0;
}

/* -- parallel regions --------------------------------------------------------------------------------- */
struct region {
    microtask_t task;
    int count;
    void *shared[MAX_SHARED];
};

static void run_region(void *data) {
    struct region *r = data;
    call_microtask(r->task, r->count, r->shared, serial ? 0 : gomp_thread_num());
}

static int serial_thread_num(void) { return 0; }

static void after_fork_in_child(void) { serial = 1; }

/* Without a libgomp to bind to (a kernel loaded where none is), every region runs on the calling thread. */
__attribute__((constructor)) static void bind_at_load(void) {
    pthread_atfork(NULL, NULL, after_fork_in_child);
    if (!sparse_mlir_bind_libgomp()) gomp_thread_num = serial_thread_num;
}

EXPORT void __kmpc_fork_call(void *loc, int32_t count, microtask_t task, ...) {
    (void)loc;
    struct region r = {task, count, {0}};
    va_list shared;
    va_start(shared, task);
    for (int i = 0; i < count && i < MAX_SHARED; i++) r.shared[i] = va_arg(shared, void *);
    va_end(shared);
    if (serial) {
        run_region(&r);
        return;
    }
    unsigned team = gomp_in_parallel() ? 1u : (unsigned)(wanted_threads > 0 ? wanted_threads : 1);
    gomp_parallel(run_region, &r, team, 0);
}

EXPORT int32_t __kmpc_global_thread_num(void *loc) {
    (void)loc;
    return serial ? 0 : gomp_thread_num();
}

EXPORT void __kmpc_barrier(void *loc, int32_t gtid) {
    (void)loc;
    (void)gtid;
    if (!serial) gomp_barrier();
}

EXPORT int32_t __kmpc_masked(void *loc, int32_t gtid, int32_t filter) {
    (void)loc;
    (void)gtid;
    return (serial ? 0 : gomp_thread_num()) == filter;
}

/* -- worksharing loops: LLVM's dispatch protocol on libgomp's ----------------------------------------- */
EXPORT void __kmpc_dispatch_init_8u(void *loc, int32_t gtid, int32_t schedule, uint64_t lower, uint64_t upper,
                                    int64_t step, int64_t chunk) {
    (void)loc;
    (void)gtid;
    int kind = (int)((uint32_t)schedule & ~KMP_MODIFIERS);
    loop_kind = kind == KMP_STATIC || kind == KMP_STATIC_CHUNKED ? 0 : kind == KMP_GUIDED ? 2
              : kind == KMP_RUNTIME ? 3 : 1;
    loop_first = lower;
    loop_end = upper + 1; /* LLVM's bounds are inclusive, libgomp's end is not (an empty loop wraps to equal) */
    loop_step = (unsigned long long)step;
    loop_chunk = chunk > 0 ? (unsigned long long)chunk : loop_kind == 0 ? 0 : 1;
    loop_started = false;
}

EXPORT int32_t __kmpc_dispatch_next_8u(void *loc, int32_t gtid, int32_t *last, uint64_t *lower, uint64_t *upper,
                                       int64_t *step) {
    (void)loc;
    (void)gtid;
    unsigned long long begin = loop_first, end = loop_end;
    bool more;
    if (serial) { /* the whole range at once */
        more = !loop_started && begin < end;
    } else {
        more = loop_started ? gomp_next[loop_kind](&begin, &end)
                            : gomp_start[loop_kind](true, loop_first, loop_end, loop_step, loop_chunk, &begin, &end);
        if (!more) gomp_loop_end_nowait(); /* the lowering puts its own barrier after the loop when it needs one */
    }
    loop_started = true;
    if (!more) return 0;
    *lower = begin;
    *upper = end - 1;
    *step = (int64_t)loop_step;
    if (last != NULL) *last = end >= loop_end;
    return 1;
}

/* -- thread counts: ours, per calling thread, never libgomp's ------------------------------------------ */
EXPORT int omp_get_max_threads(void) { return wanted_threads; }

EXPORT void omp_set_num_threads(int count) { wanted_threads = count > 0 ? count : 1; }
