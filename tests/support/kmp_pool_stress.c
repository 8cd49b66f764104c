/* Drives the pool's OpenMP entry points (``sparse_mlir/runtime/kmp_pool.c``) as the lowered kernels do, from
 * several calling threads at once, for ThreadSanitizer (``tests/test_kmp_pool.py``): random thread counts
 * (oversubscribing), blocktimes 0 and 1 ms, dynamic and guided loops with and without barriers, masked blocks
 * and regions forked inside regions.  Exits 1 when an iteration runs other than once or a masked block other
 * than once; prints "ok" otherwise.  Usage: kmp_pool_stress [regions per calling thread] */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef void (*microtask_t)(int32_t *, int32_t *, ...);
void __kmpc_fork_call(void *loc, int32_t count, microtask_t task, ...);
void __kmpc_dispatch_init_8u(void *, int32_t, int32_t, uint64_t, uint64_t, int64_t, int64_t);
int32_t __kmpc_dispatch_next_8u(void *, int32_t, int32_t *, uint64_t *, uint64_t *, int64_t *);
void __kmpc_barrier(void *, int32_t);
int32_t __kmpc_masked(void *, int32_t, int32_t);
void omp_set_num_threads(int);
void kmp_set_blocktime(int);

enum { DYNAMIC = 35, GUIDED = 36, CALLERS = 3 };

struct job {
    int n, loops, barriers, nest;
    int *hits; /* loops x n: how often each iteration ran (each is claimed by one thread: no race) */
    long masked;
};

static int regions = 3000;

static void task(int32_t *gtid, int32_t *btid, struct job *j);

static int check(const struct job *j) {
    for (int i = 0; i < j->n * j->loops; i++)
        if (j->hits[i] != 1) return fprintf(stderr, "iteration %d ran %d times\n", i, j->hits[i]), 0;
    if (j->masked != 1) return fprintf(stderr, "the masked block ran %ld times\n", j->masked), 0;
    return 1;
}

static void run(struct job *j) {
    j->hits = calloc((size_t)j->n * j->loops, sizeof(int));
    j->masked = 0;
    __kmpc_fork_call(NULL, 1, (microtask_t)task, j);
    int good = check(j);
    free(j->hits);
    if (!good) exit(1);
}

static void task(int32_t *gtid, int32_t *btid, struct job *j) {
    (void)btid;
    for (int l = 0; l < j->loops; l++) {
        __kmpc_dispatch_init_8u(NULL, *gtid, l % 2 ? DYNAMIC : GUIDED, 0, (uint64_t)j->n - 1, 1, 3);
        uint64_t lo, hi;
        int64_t step;
        int32_t last;
        while (__kmpc_dispatch_next_8u(NULL, *gtid, &last, &lo, &hi, &step))
            for (uint64_t i = lo; i <= hi; i++) j->hits[l * j->n + i] += 1;
        if (j->barriers) __kmpc_barrier(NULL, *gtid);
    }
    if (__kmpc_masked(NULL, *gtid, 0)) {
        j->masked += 1;
        if (j->nest) { /* a region inside the region: it runs on this thread alone */
            struct job inner = *j;
            inner.nest = 0;
            run(&inner);
        }
    }
}

static void *caller(void *arg) {
    unsigned seed = (unsigned)(uintptr_t)arg;
    for (int r = 0; r < regions; r++) {
        struct job j = {1 + (int)(rand_r(&seed) % 200), 1 + (int)(rand_r(&seed) % 3), (int)(rand_r(&seed) % 2),
                        rand_r(&seed) % 5 == 0, NULL, 0};
        omp_set_num_threads(1 + (int)(rand_r(&seed) % 8));
        kmp_set_blocktime(rand_r(&seed) % 3 == 0 ? 0 : 1);
        run(&j);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc > 1) regions = atoi(argv[1]);
    pthread_t callers[CALLERS];
    for (int i = 0; i < CALLERS; i++) pthread_create(&callers[i], NULL, caller, (void *)(uintptr_t)(i + 1));
    for (int i = 0; i < CALLERS; i++) pthread_join(callers[i], NULL);
    puts("ok");
    return 0;
}
