/* Dealing out work and meeting at barriers: the threads of one OpenMP parallel region (a
 * decode step, or one product on its own) split rows evenly (`share`), meet at a barrier that
 * spins a moment and then yields its core (`region_barrier`), and take over what a slower
 * thread has not reached yet (`offer_share`, `take_next`). Why the barrier yields rather than
 * spin: a thread spinning for one the OS set aside keeps the core from whoever runs next
 * (figures: `bench/RESULTS.md`, "The native kernels' choices"). */

#pragma once

#include <omp.h>
#include <math.h>
#include <sched.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

/* The barrier every product and block phase meets at. A parallel region's threads share one
 * `Barrier` (`enter_region`); outside one, OpenMP's. */
#define MAX_SHARING 64 /* threads of a region that deal out their products' chunks */

typedef struct {
    int arrived, generation;
    /* each thread's chunks of the running product not yet taken: the first (high half) and
     * one past the last (low half), see `linear_band_shared` */
    uint64_t chunks[MAX_SHARING];
} Barrier;

#define SPINS 64 /* pause-spins before yielding: a quiet step's threads arrive within them */

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause() /* a spinning thread's hint to its core */
#else
#define CPU_RELAX() ((void)0)
#endif

static __thread Barrier *region_barrier_of_thread;

static void enter_region(Barrier *barrier) { region_barrier_of_thread = barrier; }

static void region_barrier(void) {
    Barrier *b = region_barrier_of_thread;
    int threads = omp_get_num_threads();
    if (!b) {
#pragma omp barrier
        return;
    }
    if (threads == 1) return;
    int generation = __atomic_load_n(&b->generation, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&b->arrived, 1, __ATOMIC_ACQ_REL) == threads) {
        __atomic_store_n(&b->arrived, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->generation, generation + 1, __ATOMIC_RELEASE);
        return;
    }
    for (int spin = 0; __atomic_load_n(&b->generation, __ATOMIC_ACQUIRE) == generation; spin++) {
        if (spin < SPINS) CPU_RELAX();
        else sched_yield();
    }
}

/* Rows [begin, end) of `count` split evenly over `parts`: part `index`'s share. */
static void share(int count, int parts, int index, int *begin, int *end) {
    int base = count / parts, extra = count % parts;
    *begin = index * base + (index < extra ? index : extra);
    *end = *begin + base + (index < extra ? 1 : 0);
}

/* A chunk taken from `range` (first chunk in the high half, one past the last in the low
 * half): its first (`from_front`) or its last; -1 when none is left. */
static int take_chunk(uint64_t *range, int from_front) {
    uint64_t seen = __atomic_load_n(range, __ATOMIC_ACQUIRE);
    for (;;) {
        uint32_t first = (uint32_t)(seen >> 32), last = (uint32_t)seen;
        if (first >= last) return -1;
        uint64_t left = from_front ? seen + ((uint64_t)1 << 32) : seen - 1;
        if (__atomic_compare_exchange_n(range, &seen, left, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return (int)(from_front ? first : last - 1);
    }
}

/* Offer this thread's share [first, last) of a product's units (chunks, panels) in the
 * region's `Barrier`, for `take_next`. */
static void offer_share(Barrier *b, int thread, int first, int last) {
    __atomic_store_n(b->chunks + thread, (uint64_t)first << 32 | (uint32_t)last, __ATOMIC_RELEASE);
}

/* The next unit for this thread: its own share in order, then (`*k` counting the threads
 * looked at, from 0) the units other threads have not reached, from the far end of theirs;
 * -1 once none is left. */
static int take_next(Barrier *b, int thread, int threads, int *k) {
    for (; *k < threads; ++*k) {
        int unit = take_chunk(b->chunks + (thread + *k) % threads, *k == 0);
        if (unit >= 0) return unit;
    }
    return -1;
}
