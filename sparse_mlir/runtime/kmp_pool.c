/* The LLVM OpenMP entry points our kernels call, on a thread pool of our own whose regions do not wait for
 * workers that have not started.
 *
 * Why: a kernel call's parallel region pays for waking the pool's sleeping
 * workers, and on the 2-core VMs measured here (session 20) a futex wake
 * takes 20-40 us to run the woken thread when the waker is busy.  libiomp5
 * pays that twice at each fork (it signals a condition variable while
 * holding the mutex the woken worker must take next) and again at the join
 * when the master went to sleep first; libgomp once at the fork and once at
 * the join.  A DLMC 512 x 512 SpMM at N=128 took 100 us on one thread and
 * 187 us (libiomp5) or 144 us (libgomp) on two.
 *
 * Here a fork is one futex wake, the master starts on the region at once,
 * and a worker joins the region only if it arrives before the master has
 * finished its own part (the team closes then): our kernels claim their
 * work from shared counters (dynamic and guided loops, work queues), so
 * whoever is there does all of it, and a worker that wakes after the work
 * is done skips the region instead of holding up the join.  The master
 * waits for the workers that joined by spinning (they are running), not by
 * sleeping, yielding its CPU now and then in case one of them waits for it
 * (``spin_step``).  Idle workers spin for the forking thread's blocktime
 * (KMP_BLOCKTIME, or kmp_set_blocktime) and then sleep.
 *
 * What this supports is exactly what the kernels import (tests/test_kmp_pool.py
 * checks it): regions, worksharing loops through the dispatch interface (any
 * schedule: iterations are claimed at run time, never assigned in advance),
 * barriers among the threads that joined (the team closes at the first
 * one), masked blocks, and the thread count.  A region forked inside a
 * region, or while another Python thread's region runs, runs on the calling
 * thread alone.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "kmp_abi.h"

#define MAX_WORKERS 255     /* threads besides the forking one */
#define LOOP_SLOTS 8        /* worksharing loops of one region with shared state; later ones run on the master */
#define JOIN_SPIN_NS 2000000 /* how long a thread waiting on running team mates spins before it sleeps */
#define CLOSED (1ull << 31) /* in team_state: no more workers join this region */
#define MEMBERS 0xffffull   /* in team_state: threads in the region, the master included */

/* -- waiting: spin, then sleep on a futex ------------------------------------------------------------ */
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* One step of a spin-wait (``i`` counts them from 1): a pause, and every 256th step a ``sched_yield``.  The
 * guest's scheduler sometimes wakes a worker onto the CPU of the thread that woke it, and a pure spin then
 * keeps the CPU the awaited thread needs: 11-12 of 300 2-thread SpMV calls in a process on one CPU took
 * 4.4 ms (the master spinning at the join for its whole JOIN_SPIN_NS, then sleeping), and a 2-thread SDDMM
 * called every 10 ms took 4.5 ms in one call of ten on the 2-vCPU VM (a 0.5 ms call; libiomp5 had no such
 * tail).  With the yield, none (session 27).  A yield with nothing else to run returns at once. */
static inline void spin_step(unsigned i) {
    cpu_relax();
    if ((i & 255) == 0) sched_yield();
}

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void futex_wait(_Atomic uint32_t *word, uint32_t seen) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *word, int count) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, count, NULL, NULL, 0);
}

/* A word threads wait on to change, and how many of them sleep on it (the waker's syscall is skipped when
 * none does: both sides use sequentially consistent operations, so a sleeper is either counted or sees the
 * change before it sleeps). */
struct signal {
    _Atomic uint32_t word;
    _Atomic uint32_t sleepers;
};

static void signal_wake(struct signal *s) {
    if (atomic_load(&s->sleepers) > 0) futex_wake(&s->word, INT_MAX);
}

/* Wait until ``done(arg)``, spinning up to ``spin_ns`` (0: not at all, negative: for ever) and then sleeping on
 * ``s``, whose word changes whenever ``done`` may have become true. */
static void wait_until(struct signal *s, int (*done)(const void *), const void *arg, int64_t spin_ns) {
    if (done(arg)) return;
    int64_t deadline = spin_ns < 0 ? INT64_MAX : now_ns() + spin_ns;
    for (unsigned i = 1; spin_ns != 0; i++) {
        spin_step(i);
        if (done(arg)) return;
        if ((i & 255) == 0 && now_ns() > deadline) break;
    }
    for (;;) {
        uint32_t seen = atomic_load(&s->word);
        if (done(arg)) return;
        atomic_fetch_add(&s->sleepers, 1);
        if (!done(arg)) futex_wait(&s->word, seen);
        atomic_fetch_sub(&s->sleepers, 1);
        if (done(arg)) return;
    }
}

/* -- the pool's state ---------------------------------------------------------------------------------- */
struct loop_slot {
    _Atomic uint64_t ready; /* 2 * region + 1 once set up for that region, 2 * region while being set up */
    _Atomic uint64_t next;  /* the first unclaimed iteration, counted from 0 */
    uint64_t count, chunk, first, step;
    int guided;
};

static struct {
    microtask_t task;
    int count;
    void *shared[MAX_SHARED];
    uint64_t id;      /* regions forked before this one: tells the loop slots' regions apart */
    /* these two are read by workers that have not joined (yet), while the master may already be writing the
     * next region's: atomics (relaxed: the region is published by the stores to team_state and generation) */
    _Atomic int wanted;       /* threads the forking thread asked for, itself included */
    _Atomic int64_t spin_ns;  /* how long idle workers spin after this region */
} region;

static struct signal generation;          /* bumped by each fork: the workers wait on it */
static _Atomic uint64_t team_state;       /* region number << 32 | CLOSED | members */
static struct signal finished;            /* workers that joined and are done with the region */
static struct signal barrier_release;     /* bumped when the last member reaches a barrier */
static _Atomic uint32_t barrier_arrived;
static struct loop_slot slots[LOOP_SLOTS];
static _Atomic int busy;                  /* a region is running: forks from other threads run alone */
static int workers;                       /* worker threads started */
static uint64_t regions;                  /* regions forked so far (only the thread holding ``busy`` writes) */

static int default_threads = 1;
static int64_t default_blocktime_ns = 200000000; /* libiomp5's default, when KMP_BLOCKTIME is not set */

/* per thread: its wanted thread count and blocktime (set by the calling thread, as libiomp5's are), and its
 * place in the region it runs */
static __thread int wanted_threads = -1;
static __thread int64_t blocktime_ns = -2;   /* -2: not set on this thread */
/* where this thread stands in the region it runs: one struct, so a region run alone inside another saves and
 * restores it in one copy */
struct place {
    int thread_num;
    int in_team;                /* a member of the pool's running region */
    uint64_t team_region;       /* that region's ``region.id`` */
    int alone;                  /* running a region by itself (nested, or the pool busy) */
    unsigned loop_seq;          /* worksharing loops this thread has started in its region */
    struct loop_slot *loop;     /* its current loop's shared state; NULL: the loop runs here alone */
    uint64_t alone_first, alone_count, alone_step; /* a loop run alone: its whole range, once */
    int alone_started;
};
static __thread struct place here;

static uint64_t region_of(uint64_t state) { return state >> 32; }

/* -- workers ------------------------------------------------------------------------------------------- */
struct changed_arg {
    _Atomic uint32_t *word;
    uint32_t seen;
};

static int word_changed(const void *p) {
    const struct changed_arg *c = p;
    return atomic_load(c->word) != c->seen;
}

static void *worker_main(void *arg) {
    int index = (int)(intptr_t)arg; /* 0 for the first worker */
    uint32_t seen = atomic_load(&generation.word);
    int64_t spin_ns = 0;
    for (;;) {
        struct changed_arg next = {&generation.word, seen};
        wait_until(&generation, word_changed, &next, spin_ns);
        seen = atomic_load(&generation.word);
        uint64_t state = atomic_load(&team_state);
        /* join the region whose fork woke us, if it is still open and wants us */
        int joined = 0;
        while ((uint32_t)region_of(state) == seen && !(state & CLOSED) &&
               index + 1 < atomic_load_explicit(&region.wanted, memory_order_relaxed)) {
            if (atomic_compare_exchange_weak(&team_state, &state, state + 1)) {
                joined = 1;
                break;
            }
        }
        /* read before finishing: the master may start the next region after */
        spin_ns = atomic_load_explicit(&region.spin_ns, memory_order_relaxed);
        if (!joined) continue;
        here.thread_num = (int)(state & MEMBERS);
        here.team_region = region.id;
        here.in_team = 1;
        here.loop_seq = 0;
        call_microtask(region.task, region.count, region.shared, here.thread_num);
        here.in_team = 0;
        atomic_fetch_add(&finished.word, 1);
        signal_wake(&finished);
    }
    return NULL;
}

/* Start workers until there are ``count``; fewer if the system refuses threads (regions then run on fewer). */
static void grow(int count) {
    if (count > MAX_WORKERS) count = MAX_WORKERS;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* workers inherit a mask blocking every signal: they go to the
                                                 threads that handle them (Python's main thread) */
    while (workers < count) {
        pthread_t id;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&id, &attr, worker_main, (void *)(intptr_t)workers);
        pthread_attr_destroy(&attr);
        if (failed) break;
        workers++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

static void after_fork_in_child(void) {
    /* the workers do not exist in the child: start new ones on its first region */
    workers = 0;
    atomic_store(&busy, 0);
    atomic_store(&generation.sleepers, 0);
    atomic_store(&finished.sleepers, 0);
    atomic_store(&barrier_release.sleepers, 0);
}

static int64_t parse_blocktime(const char *text) {
    if (text == NULL || *text == '\0') return -2;
    if (strcmp(text, "infinite") == 0) return -1;
    char *end;
    long long value = strtoll(text, &end, 10);
    if (end == text || value < 0) return -2;
    if (*end == '\0' || strcmp(end, "ms") == 0) return value * 1000000;
    if (strcmp(end, "us") == 0) return value * 1000;
    if (strcmp(end, "s") == 0) return value * 1000000000;
    return -2;
}

__attribute__((constructor)) static void pool_init(void) {
    pthread_atfork(NULL, NULL, after_fork_in_child);
    cpu_set_t cpus;
    if (sched_getaffinity(0, sizeof cpus, &cpus) == 0) default_threads = CPU_COUNT(&cpus);
    const char *count = getenv("OMP_NUM_THREADS");
    if (count != NULL && atoi(count) > 0) default_threads = atoi(count);
    if (default_threads < 1) default_threads = 1;
    int64_t env_blocktime = parse_blocktime(getenv("KMP_BLOCKTIME"));
    if (env_blocktime != -2) default_blocktime_ns = env_blocktime;
}

/* -- regions ------------------------------------------------------------------------------------------- */
static void run_alone(microtask_t task, int count, void **shared) {
    /* a region on this thread alone, inside another one or beside another thread's: its loops take their
     * whole range at once and its barriers return at once */
    struct place saved = here;
    here.alone = 1;
    here.in_team = 0;
    here.thread_num = 0;
    call_microtask(task, count, shared, 0);
    here = saved;
}

struct finished_arg {
    uint32_t members;
};

static int all_finished(const void *p) {
    return atomic_load(&finished.word) >= ((const struct finished_arg *)p)->members;
}

EXPORT void __kmpc_fork_call(void *loc, int32_t count, microtask_t task, ...) {
    (void)loc;
    void *shared[MAX_SHARED] = {0};
    va_list args;
    va_start(args, task);
    for (int i = 0; i < count && i < MAX_SHARED; i++) shared[i] = va_arg(args, void *);
    va_end(args);
    int wanted = wanted_threads > 0 ? wanted_threads : default_threads;
    if (wanted <= 1 || here.in_team || here.alone || atomic_exchange(&busy, 1)) {
        run_alone(task, count, shared);
        return;
    }
    if (workers < wanted - 1) grow(wanted - 1);
    region.task = task;
    region.count = count;
    memcpy(region.shared, shared, sizeof shared);
    atomic_store_explicit(&region.wanted, wanted, memory_order_relaxed);
    atomic_store_explicit(&region.spin_ns, blocktime_ns != -2 ? blocktime_ns : default_blocktime_ns,
                          memory_order_relaxed);
    region.id = ++regions; /* from 1: a slot never set up reads as region 0 */
    uint32_t number = (uint32_t)(atomic_load(&generation.word) + 1);
    atomic_store(&finished.word, 0);
    atomic_store(&barrier_arrived, 0);
    atomic_store(&team_state, (uint64_t)number << 32 | 1); /* the master is member 0 */
    atomic_store(&generation.word, number);                  /* publishes the region to the workers */
    signal_wake(&generation);
    here.thread_num = 0;
    here.team_region = region.id;
    here.in_team = 1;
    here.loop_seq = 0;
    call_microtask(task, count, shared, 0);
    here.in_team = 0;
    uint64_t state = atomic_fetch_or(&team_state, CLOSED);
    struct finished_arg members = {(uint32_t)(state & MEMBERS) - 1};
    wait_until(&finished, all_finished, &members, JOIN_SPIN_NS);
    atomic_store(&busy, 0);
}

EXPORT int32_t __kmpc_global_thread_num(void *loc) {
    (void)loc;
    return here.in_team ? here.thread_num : 0;
}

/* -- barriers among the region's members ---------------------------------------------------------------- */
EXPORT void __kmpc_barrier(void *loc, int32_t gtid) {
    (void)loc;
    (void)gtid;
    if (!here.in_team) return; /* alone, or outside a region */
    uint64_t state = atomic_fetch_or(&team_state, CLOSED);
    uint32_t members = (uint32_t)(state & MEMBERS);
    if (members <= 1) return;
    uint32_t seen = atomic_load(&barrier_release.word);
    if (atomic_fetch_add(&barrier_arrived, 1) + 1 == members) {
        atomic_store(&barrier_arrived, 0);
        atomic_fetch_add(&barrier_release.word, 1);
        signal_wake(&barrier_release);
        return;
    }
    struct changed_arg arg = {&barrier_release.word, seen};
    wait_until(&barrier_release, word_changed, &arg, JOIN_SPIN_NS);
}

EXPORT int32_t __kmpc_masked(void *loc, int32_t gtid, int32_t filter) {
    (void)loc;
    (void)gtid;
    return (here.in_team ? here.thread_num : 0) == filter;
}

/* -- worksharing loops: iterations claimed from a counter the region's members share -------------------- */
EXPORT void __kmpc_dispatch_init_8u(void *loc, int32_t gtid, int32_t schedule, uint64_t lower, uint64_t upper,
                                    int64_t step, int64_t chunk) {
    (void)loc;
    (void)gtid;
    /* LLVM's bounds are inclusive; an empty loop has upper = lower - 1 */
    uint64_t stride = step > 0 ? (uint64_t)step : 1;
    uint64_t end = upper + 1; /* wraps to ``lower`` for an empty loop that starts at 1, as LLVM's do */
    uint64_t count = end > lower ? (end - lower - 1) / stride + 1 : 0;
    unsigned seq = here.loop_seq++;
    if (!here.in_team || seq >= LOOP_SLOTS) {
        /* alone, or past the loops with shared state: this thread takes the whole loop when it is the
         * master, none of it otherwise (the iterations of a dynamic loop go to whoever claims them) */
        here.loop = NULL;
        here.alone_first = lower;
        here.alone_step = stride;
        here.alone_count = !here.in_team || here.thread_num == 0 ? count : 0;
        here.alone_started = 0;
        return;
    }
    struct loop_slot *s = &slots[seq];
    uint64_t mine = here.team_region;
    here.loop = s;
    uint64_t ready = atomic_load(&s->ready);
    while (ready / 2 != mine) {
        if (atomic_compare_exchange_weak(&s->ready, &ready, 2 * mine)) { /* this thread sets it up */
            int kind = (int)((uint32_t)schedule & ~KMP_MODIFIERS);
            s->first = lower;
            s->step = stride;
            s->count = count;
            s->chunk = chunk > 0 ? (uint64_t)chunk : 1;
            s->guided = kind == KMP_GUIDED || kind == KMP_RUNTIME;
            atomic_store(&s->next, 0);
            atomic_store(&s->ready, 2 * mine + 1);
            return;
        }
    }
    for (unsigned i = 1; atomic_load(&s->ready) != 2 * mine + 1; i++) spin_step(i); /* another member sets it up */
}


EXPORT int32_t __kmpc_dispatch_next_8u(void *loc, int32_t gtid, int32_t *last, uint64_t *lower, uint64_t *upper,
                                       int64_t *step) {
    (void)loc;
    (void)gtid;
    uint64_t first, taken, count, stride, base;
    if (here.loop == NULL) { /* the whole range at once, to the thread that runs it */
        if (here.alone_started || here.alone_count == 0) return 0;
        here.alone_started = 1;
        first = 0;
        taken = here.alone_count;
        count = here.alone_count;
        stride = here.alone_step;
        base = here.alone_first;
    } else {
        struct loop_slot *s = here.loop;
        count = s->count;
        stride = s->step;
        base = s->first;
        if (!s->guided) { /* dynamic: one add, no retries */
            first = atomic_fetch_add(&s->next, s->chunk);
            if (first >= count) return 0;
            taken = count - first < s->chunk ? count - first : s->chunk;
        } else { /* a share of what is left, as LLVM's guided schedule: about half a thread's, at least a chunk */
            first = atomic_load(&s->next);
            do {
                if (first >= count) return 0;
                uint64_t left = count - first, share = left / (2 * (uint64_t)atomic_load_explicit(&region.wanted, memory_order_relaxed));
                taken = share > s->chunk ? share : s->chunk;
                if (taken > left) taken = left;
            } while (!atomic_compare_exchange_weak(&s->next, &first, first + taken));
        }
    }
    *lower = base + first * stride;
    *upper = base + (first + taken - 1) * stride;
    *step = (int64_t)stride;
    if (last != NULL) *last = first + taken == count;
    return 1;
}

/* -- thread counts and blocktime: per calling thread, as libiomp5's -------------------------------------- */
EXPORT int omp_get_max_threads(void) { return wanted_threads > 0 ? wanted_threads : default_threads; }

EXPORT void omp_set_num_threads(int count) { wanted_threads = count > 0 ? count : 1; }

EXPORT void kmp_set_blocktime(int ms) { blocktime_ns = ms < 0 ? 0 : (int64_t)ms * 1000000; }

EXPORT int kmp_get_blocktime(void) {
    int64_t ns = blocktime_ns != -2 ? blocktime_ns : default_blocktime_ns;
    return ns < 0 ? INT_MAX : (int)(ns / 1000000);
}

EXPORT int omp_get_thread_num(void) { return here.in_team ? here.thread_num : 0; }

EXPORT int omp_in_parallel(void) { return here.in_team; }
