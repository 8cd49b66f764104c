/* The round trip of one cache line between two threads pinned to two CPUs (benchmarks/core_latency.py). */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define TRIPS 100000

static _Atomic int ball __attribute__((aligned(64)));
static int second_cpu;

static int pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *returner(void *arg) {
    (void)arg;
    if (pin(second_cpu) != 0) return (void *)1;
    for (int i = 0; i < TRIPS; i++) {
        while (atomic_load_explicit(&ball, memory_order_acquire) != 1) {
        }
        atomic_store_explicit(&ball, 0, memory_order_release);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s CPU CPU\n", argv[0]);
        return 2;
    }
    second_cpu = atoi(argv[2]);
    if (pin(atoi(argv[1])) != 0) return 3;
    pthread_t thread;
    if (pthread_create(&thread, NULL, returner, NULL) != 0) return 4;
    struct timespec start, stop;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (int i = 0; i < TRIPS; i++) {
        atomic_store_explicit(&ball, 1, memory_order_release);
        while (atomic_load_explicit(&ball, memory_order_acquire) != 0) {
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &stop);
    void *failed;
    pthread_join(thread, &failed);
    if (failed != NULL) return 3;
    printf("%.1f\n", ((stop.tv_sec - start.tv_sec) * 1e9 + (stop.tv_nsec - start.tv_nsec)) / TRIPS);
    return 0;
}
