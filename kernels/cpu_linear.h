/* Products with weights in their stored formats, on CPU: the one place a format is read.
 *
 * A weight is a `Matrix` `[in, out]` in one of the formats below; activations and sums are
 * always float32. Narrow formats are widened to float32 in registers as they stream past, so a
 * product reads 2 (BF16, F16) or 1 (I8) bytes per weight instead of 4:
 *
 *   F32   float32
 *   BF16  the top half of a float32: widened by a 16-bit shift
 *   F16   IEEE half: widened by F16C's conversion
 *   I8    symmetric int8 with one float32 scale per output column (`scales`): the product
 *         sums x * q in float32 and multiplies each output once by its scale (stored as quad
 *         panels on a CPU with AVX-512 VNNI: exact integer sums, see `quad_product`)
 *
 * `linear` is what every kind of block multiplies by (inside the decode step's parallel region)
 * and `matmul` in `cpu_decode.c` the same product on its own (the LM head, products of the
 * torch path). A weight is read either as a contiguous [in, out] (each thread streams its own
 * band of input rows into a private partial sum, taking the rest of a slower thread's band at
 * the end, see `linear_band_shared`, rows of x in groups of up to 8 so that each
 * widened weight vector serves the whole group, whose sums stay in registers through eight input
 * rows (`band_group`); a single row of x takes eight input rows per load and store of its
 * partial sums, in four independent chains, which brought one-row products of the narrow
 * formats near their read floors (int8 1.7x -> 1.1x of it), or, through outputs at most
 * `NARROW_COLUMNS` wide, one input row at a time (one stream);
 * the partials are then added by column; a one-row bf16 product widens 32 columns per load
 * and keeps its sums in the order that gives them, see `band_bf16_deinterleaved`),
 * as the same [in, out] packed by groups of eight input rows (`PACK_ROWS`, the narrow formats'
 * layout wherever the shape allows: the same passes, each group of rows one stream),
 * as panels of 32 columns (an LM head, `panel_product`) or, in I8, quad panels
 * (`quad_product`): each thread whole panels, sums in registers over every input row,
 * or, in F32 only, as a contiguous [out, in] (each thread owns a band of output rows: dot
 * products). Measured on the 2-core CPU (see `bench/matmul_formats.py`): widening in
 * registers keeps a one-row product at its read floor in every format, and grouping rows made
 * eight-row products of the narrow formats 1.5-3x faster than widening once per row.
 * Vectors are 16 floats where the compiler targets AVX-512 and 8 elsewhere (`LANES`), and rows
 * are prefetched ahead where the hardware alone fell short (`PREFETCH_BYTES`).
 */

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

/* The barrier every product and block phase meets at: it spins a moment, then yields its core
 * until the last thread arrives. Measured on the shared 2-core CPU, OpenMP's own barrier spins
 * (under OMP_WAIT_POLICY=active a two-thread decode step took 412 ms at the median, 4.3 ms at
 * best): a thread spinning for one the OS set aside keeps the core from whoever runs next. A
 * parallel region's threads share one `Barrier` (`enter_region`); outside one, OpenMP's. */
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

enum format { F32 = 1, BF16 = 2, F16 = 3, I8 = 4 };

typedef struct {
    const void *data;            /* [in, out], packed, or (F32 only) its [out, in] transpose */
    const float *scales;         /* [out]: I8's scale of each output column; NULL otherwise */
    int32_t format;
    int32_t out_in;              /* 1: stored [out, in] */
    int32_t in, out;
    int32_t packed;              /* 1: stored as [in / 8][out / 32][8][32], see `weight_at`;
                                  * 2: as panels [out / 32][in][32], see `panel_product`;
                                  * 3: I8 as quad panels [out / 32][in / 4][32][4], see
                                  * `quad_product` */
} Matrix;

/* A packed matrix holds each group of PACK_ROWS input rows as PACK_COLUMNS-column tiles, one
 * after another, each tile its PACK_ROWS rows of PACK_COLUMNS contiguous elements: the pass of
 * a group of rows over all columns reads one contiguous stream (the [in, out] layout reads one
 * stream per row). Measured on a 2-core AVX-512 CPU (Zen 4), one row through a 3B model's
 * four bf16 projections, cycled from memory, took 0.84 of the [in, out] layout's time (a
 * plain read of the same bytes 0.69), through a hybrid's 768-3712 wide ones 0.80-0.86. */
#define PACK_ROWS 8
#define PACK_COLUMNS 32
#define PANELS 2         /* `Matrix.packed` of a matrix stored as panels (`panel_product`) */
#define PANEL_COLUMNS 32
#define QUADS 3          /* `Matrix.packed` of an I8 matrix stored as quad panels */
#define QUAD_ROWS 4
#define QUAD_MAX_IN 65536 /* the most input rows whose integer sums stay in 32 bits */

/* The element offset of w[i][c] (in a packed matrix, i a multiple of PACK_ROWS), and the step
 * from there to w[i + 1][c] (for i + 1 in the same group of rows). */
INLINE size_t weight_at(int packed, int out, int i, int c) {
    if (!packed) return (size_t)i * out + c;
    return (size_t)i * out + (size_t)(c & ~(PACK_COLUMNS - 1)) * PACK_ROWS +
           (c & (PACK_COLUMNS - 1));
}

INLINE size_t row_step(int packed, int out) { return packed ? PACK_COLUMNS : (size_t)out; }

typedef float vec8 __attribute__((vector_size(32)));
typedef int32_t ivec8 __attribute__((vector_size(32)));
#define SPLAT(c) ((vec8){c, c, c, c, c, c, c, c})

static inline vec8 load8(const float *p) {
    vec8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float bits_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* IEEE half -> float (the scalar path where F16C is missing, and vector tails). */
static float half_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24 */
        float magnitude = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -magnitude : magnitude;
    }
    if (exponent == 0x1f) return bits_float(sign | 0x7f800000 | mantissa << 13); /* inf, nan */
    return bits_float(sign | (exponent + 112) << 23 | mantissa << 13);
}

/* Element `at` of `data` in `format`, as float32. */
INLINE float widen1(int format, const void *data, size_t at) {
    switch (format) {
    case BF16: return bits_float((uint32_t)((const uint16_t *)data)[at] << 16);
    case F16: return half_float(((const uint16_t *)data)[at]);
    case I8: return (float)((const int8_t *)data)[at];
    default: return ((const float *)data)[at];
    }
}

/* Elements [at, at + 8) of `data` in `format`, as float32 lanes. */
INLINE vec8 widen8(int format, const void *data, size_t at) {
#if defined(__AVX2__) && defined(__F16C__)
    const __m128i *p = (const __m128i *)((const char *)data + at * (format == I8 ? 1 : 2));
    switch (format) {
    case BF16: return (vec8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p)), 16);
    case F16: return (vec8)_mm256_cvtph_ps(_mm_loadu_si128(p));
    case I8: return (vec8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p)));
    default: return load8((const float *)data + at);
    }
#else
    if (format == F32) return load8((const float *)data + at);
    vec8 v;
    for (int lane = 0; lane < 8; lane++) v[lane] = widen1(format, data, at + lane);
    return v;
#endif
}

/* The products' own vectors: 16 lanes where the CPU has AVX-512, else 8. Measured on a 2-core
 * AVX-512 CPU, streaming a weight from memory with 512-bit loads reads it at the bandwidth
 * torch's own reductions reach (about 80 GB/s), 256-bit loads at about 53: with half the
 * instructions per byte, more of the weight's cache lines are in flight at once. */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vecw __attribute__((vector_size(LANES * 4)));

static inline vecw loadw(const float *p) {
    vecw v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Elements [at, at + LANES) of `data` in `format`, as float32 lanes. */
INLINE vecw widenw(int format, const void *data, size_t at) {
#if defined(__AVX512F__)
    const void *p = (const char *)data + at * (format == I8 ? 1 : 2);
    switch (format) {
    case BF16:
        return (vecw)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p)), 16);
    case F16: return (vecw)_mm512_cvtph_ps(_mm256_loadu_si256(p));
    case I8: return (vecw)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
    default: return loadw((const float *)data + at);
    }
#else
    return widen8(format, data, at);
#endif
}

/* float32 -> bfloat16, rounded to nearest even (as torch's conversion; NaN stays NaN). */
static inline uint16_t bfloat16_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)(bits >> 16 | 0x40);
    return (uint16_t)((bits + 0x7fff + (bits >> 16 & 1)) >> 16);
}

/* Rows `[at, at + n)` of `data` in `format` as float32 into `out`. */
INLINE void widen_row(int format, const void *data, size_t at, int n, float *out) {
    int d = 0;
    for (; d + 8 <= n; d += 8) {
        vec8 v = widen8(format, data, at + d);
        memcpy(out + d, &v, sizeof v);
    }
    for (; d < n; d++) out[d] = widen1(format, data, at + d);
}

/* Software prefetch, where the hardware prefetcher alone left the read short of the bandwidth
 * (measured on a 2-core AVX-512 CPU beside a plain read of about 73 GB/s):
 * - a one-row int8 product read its weight at 37 GB/s (each widened vector takes only 16
 *   bytes, so fewer of its cache lines are in flight); asking for each row's line 2 KiB ahead,
 *   once per line, brought it to 62. The wider formats gained nothing from it there.
 * - products of 2-16 rows do 4-16 FMAs per weight vector, so the loads of the next lines
 *   start late; the same prefetch in every format took a 5-row fp32 verify step (its 150k-row
 *   head read at 26 GB/s) from 12.0 to 10.5 ms (1 KiB ahead: the same; 4 KiB: 11.6).
 * - a stream that runs past its row's end goes on in the next group's rows (`prefetch_rows`):
 *   with that, a 3B int8 decode step went from 1.64x to 1.23x its read floor (66 -> 51 ms
 *   beside a 75 GB/s read); a bf16 one was the same with or without one-row prefetch.
 * - one-row products of narrow weights, rows of at most `NARROW_BYTES` (a hybrid model's
 *   Mamba2 in_proj at hidden 768; its experts and projections, at most `NARROW_COLUMNS` wide,
 *   have since read one input row at a time, a single stream): their row streams end before
 *   the hardware prefetcher is ahead of them. With the prefetch in every format, the blocks of
 *   a 136M-parameter bf16 hybrid's decode step took 2.31-2.38 ms against 2.68 without (a
 *   73 GB/s read, paired rounds in one process); with it for every width as well, a 3B bf16
 *   step was the same (115 against 118 ms, rows of 4-44 KiB). */
#define PREFETCH_BYTES 2048
#define NARROW_BYTES 8192

INLINE size_t format_bytes(int format) { return format == F32 ? 4 : format == I8 ? 1 : 2; }

/* Ahead of columns [c, c + LANES) of `rows` rows of w `stride` elements apart from `at`: a
 * prefetch of each row's line once per line, for one-row products only in int8 or of rows of
 * at most `NARROW_BYTES`. Each row is a stream that goes on, past its row's end, at the same
 * row of the next group (`rows` rows on); a weight narrower than the distance (a 2048-column
 * down projection in int8) would otherwise only fetch what its neighbouring row's stream had
 * already read. */
INLINE void prefetch_rows(int format, const void *w, size_t at, size_t stride, int rows, int c,
                          int single) {
    size_t bytes = format_bytes(format), ahead = PREFETCH_BYTES / bytes;
    if ((single && format != I8 && stride * bytes > NARROW_BYTES) || (c * bytes) % 64) return;
    if (c + ahead >= stride) ahead += (rows - 1) * stride;
    for (int j = 0; j < rows; j++)
        __builtin_prefetch((const char *)w + (at + j * stride + ahead) * bytes);
}

/* Rows of x a `band_group` takes at once: their sums stay in registers beside a weight vector
 * (16 rows would leave too few of AVX-512's 32 registers: 5 rows through a 150k-column head
 * were the same as with 8, 16 rows 14% slower); more rows are split into groups of equal size.
 * Measured with AVX-512 (Zen 4), 8 rows through a 150k-column fp32 head took 12.7-12.9 ms in
 * one group against 14.5 in two of 4, and 8 rows through a bf16 2048 x 2560 0.76 ms against
 * 0.94 with groups of up to 6 (a 43 GB/s read). */
#if LANES == 16
#define MAX_GROUP 8
#else
#define MAX_GROUP 4
#endif

/* The size of the equal groups (at most MAX_GROUP rows each) that `rows` rows of x split into. */
INLINE int group_size(int rows) {
    int groups = (rows + MAX_GROUP - 1) / MAX_GROUP;
    return (rows + groups - 1) / groups;
}

/* `CALL(n)` with n the constant `size` (1 to MAX_GROUP): each group size's loops unrolled. */
#if MAX_GROUP == 8
#define WIDE_GROUP_CASES(CALL)                                                              \
    case 8: CALL(8); break; case 7: CALL(7); break; case 6: CALL(6); break; case 5: CALL(5); break;
#else
#define WIDE_GROUP_CASES(CALL)
#endif
#define WITH_GROUP_SIZE(size, CALL)                                                          \
    switch (size) {                                                                         \
    WIDE_GROUP_CASES(CALL)                                                                  \
    case 4: CALL(4); break;                                                                 \
    case 3: CALL(3); break;                                                                 \
    case 2: CALL(2); break;                                                                 \
    default: CALL(1);                                                                       \
    }

/* Input rows a `band_group` takes per load and store of its partial sums. */
#define GROUP_DEPTH 8

/* partial[k][c] += sum over j < GROUP_DEPTH of x[k][i + j] * w[i + j][c] for the `group` rows k
 * of x and columns c in [c0, c1): each widened vector of w serves the whole group, and each
 * row's sums stay in a register through the GROUP_DEPTH input rows (x's values broadcast from
 * memory inside the FMAs). Measured on a 2-core AVX-512 CPU (Zen 4) beside a 44 GB/s read:
 * 5 rows through a 150k-column fp32 head took 11.3-12.0 ms against 15.1-15.6 with four input
 * rows per load and store of the sums (each pass moved the group's partial sums, larger than
 * L2 there, twice for every four weight rows read), 8 rows 14.0-15.5 against 16.7-17.4. */
INLINE void band_group(int format, int packed, int group, const float *x, size_t stride,
                       const void *w, int out, int i, int c0, int c1, float *partial) {
    size_t o = row_step(packed, out);
    int c = c0;
    for (; c + LANES <= c1; c += LANES) {
        size_t at = weight_at(packed, out, i, c);
        if (!packed) prefetch_rows(format, w, at, o, GROUP_DEPTH, c, 0);
        vecw sums[MAX_GROUP];
        for (int k = 0; k < group; k++) sums[k] = loadw(partial + (size_t)k * out + c);
        for (int j = 0; j < GROUP_DEPTH; j++) {
            vecw wj = widenw(format, w, at + j * o);
            for (int k = 0; k < group; k++) sums[k] += x[k * stride + i + j] * wj;
        }
        for (int k = 0; k < group; k++)
            memcpy(partial + (size_t)k * out + c, sums + k, sizeof *sums);
    }
    for (; c < c1; c++)
        for (int j = 0; j < GROUP_DEPTH; j++) {
            float wj = widen1(format, w, weight_at(packed, out, i, c) + j * o);
            for (int k = 0; k < group; k++)
                partial[(size_t)k * out + c] += x[k * stride + i + j] * wj;
        }
}

#if LANES == 16
/* 32 bf16 of one row at `p` in one load, widened as two vectors: the even columns (a shift)
 * and the odd ones (a mask). Half the loads of `widenw` and no shuffle: measured, a one-row
 * bf16 product read its weight 1.14x faster than with the in-order widening. */
INLINE void widen_bf16_pair(const void *p, vecw *even, vecw *odd) {
    __m512i v = _mm512_loadu_si512(p);
    *even = (vecw)_mm512_slli_epi32(v, 16);
    *odd = (vecw)_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u));
}

/* One row of x through input rows [i, i1) (eight at a time) of a bf16 w, columns [cb, ce)
 * (32 at a time): the partial sums of each 32 columns are kept as [16 even][16 odd], the order
 * `widen_bf16_pair` gives them, so that each widened vector is one FMA into them, and are put
 * in column order once at the end (`bf16_sums_in_order`, after the product's last chunk).
 * Measured beside a 72-74 GB/s read, a 3B bf16 decode step
 * took 110.9 ms against 122.9 when each 8 rows' sums were interleaved back as they were made
 * (1.29x -> 1.45x its read floor; the same at 42-45 GB/s), the 136M hybrid's step 3.45
 * against 3.58 ms at 46 GB/s; the product alone, warm in cache: 138 against 107 GB/s. */
INLINE void band_bf16_deinterleaved(int packed, const float *x, const void *w, int out, int i,
                                    int i1, int cb, int ce, float *partial) {
    size_t o = row_step(packed, out);
    for (; i + 8 <= i1; i += 8) {
        vecw xs[8];
        for (int j = 0; j < 8; j++) xs[j] = (vecw){} + x[i + j];
        for (int c = cb; c + 2 * LANES <= ce; c += 2 * LANES) {
            size_t at = weight_at(packed, out, i, c);
            if (!packed) prefetch_rows(BF16, w, at, o, 8, c, 1);
            vecw even = loadw(partial + c), odd = loadw(partial + c + LANES);
            for (int j = 0; j < 8; j++) {
                vecw e, d;
                widen_bf16_pair((const uint16_t *)w + at + j * o, &e, &d);
                even += xs[j] * e, odd += xs[j] * d;
            }
            memcpy(partial + c, &even, sizeof even);
            memcpy(partial + c + LANES, &odd, sizeof odd);
        }
    }
}

/* Partial sums of columns [cb, ce) (whole 32-column pairs) from `band_bf16_deinterleaved`'s
 * order into column order. */
INLINE void bf16_sums_in_order(int cb, int ce, float *partial) {
    const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
    for (int c = cb; c + 2 * LANES <= ce; c += 2 * LANES) {
        __m512 even = (__m512)loadw(partial + c), odd = (__m512)loadw(partial + c + LANES);
        vecw first = (vecw)_mm512_permutex2var_ps(even, low, odd);
        vecw second = (vecw)_mm512_permutex2var_ps(even, high, odd);
        memcpy(partial + c, &first, sizeof first);
        memcpy(partial + c + LANES, &second, sizeof second);
    }
}
#endif

/* partial[c] += sum over j < 8 of x[i + j] * w[i + j][c] for one row of x and columns c in
 * [c0, c1): eight input rows per load and store of the partial sums, in four independent
 * chains (a single row has no other rows to share a widened vector with). */
INLINE void band_single8(int format, int packed, const float *x, const void *w, int out, int i,
                         int c0, int c1, float *partial) {
    vecw xs[8];
    for (int j = 0; j < 8; j++) xs[j] = (vecw){} + x[i + j];
    size_t o = row_step(packed, out);
    int c = c0;
    for (; c + LANES <= c1; c += LANES) {
        size_t at = weight_at(packed, out, i, c);
        if (!packed) prefetch_rows(format, w, at, o, 8, c, 1);
        vecw s0 = xs[0] * widenw(format, w, at) + xs[1] * widenw(format, w, at + o);
        vecw s1 = xs[2] * widenw(format, w, at + 2 * o) + xs[3] * widenw(format, w, at + 3 * o);
        vecw s2 = xs[4] * widenw(format, w, at + 4 * o) + xs[5] * widenw(format, w, at + 5 * o);
        vecw s3 = xs[6] * widenw(format, w, at + 6 * o) + xs[7] * widenw(format, w, at + 7 * o);
        vecw sum = loadw(partial + c) + ((s0 + s1) + (s2 + s3));
        memcpy(partial + c, &sum, sizeof sum);
    }
    for (; c < c1; c++) {
        size_t at = weight_at(packed, out, i, c);
        float sum = 0.0f;
        for (int j = 0; j < 8; j++) sum += xs[j][0] * widen1(format, w, at + j * o);
        partial[c] += sum;
    }
}

/* partial[r][c] += x[r][i] * w[i][c] for one input row i, every row r and columns [cb, ce). */
INLINE void band_row(int format, const float *x, size_t stride, int rows, const void *w, int out,
                     int i, int cb, int ce, float *partial) {
    for (int r = 0; r < rows; r++) {
        vecw x0 = (vecw){} + x[r * stride + i];
        float *acc = partial + (size_t)r * out;
        int c = cb;
        for (; c + LANES <= ce; c += LANES) {
            vecw sum = loadw(acc + c) + x0 * widenw(format, w, (size_t)i * out + c);
            memcpy(acc + c, &sum, sizeof sum);
        }
        for (; c < ce; c++) acc[c] += x0[0] * widen1(format, w, (size_t)i * out + c);
    }
}

/* partial[r][c] = sum over input rows i in [i0, i1) of x[r][i] * w[i][c] for columns c in
 * [cb, ce), w contiguous [in, out] in `format` (unscaled), partial's rows `out` apart: the
 * thread streams its band of w once for all rows, GROUP_DEPTH input rows at a time, in column
 * tiles small enough that a tile of w stays in L1 while each group of rows reads it. */
#define TILE 512
/* Outputs of at most this many columns: a one-row product takes its input rows one at a time
 * (`band_row`), a single stream through w with the partial sums (at most 4 KiB) in L1. Measured
 * on a 2-core AVX-512 CPU (Zen 4) beside a 21-33 GB/s read, one row through 1536 x 768 took
 * 114-119 us against 130-144 with eight rows per pass (bf16), 82 against 112 (int8), through
 * 512 x 768 float32 73-76 against 83-85, and the MoE and Mamba2 blocks of a 136M-parameter bf16
 * hybrid's decode step 20-25% less (paired runs); at 2,048 columns and more, eight rows per
 * pass stayed ahead (2048 x 2048 bf16: 0.44 ms with eight rows per pass, 0.47 with one). */
#define NARROW_COLUMNS 1024
INLINE void band_product_as(int format, int packed, const float *x, size_t stride, int rows,
                            const void *w, int out, int i0, int i1, int cb, int ce,
                            float *partial, int in_order) {
    int i = i0;
    if (rows == 1 && out <= NARROW_COLUMNS && !packed) {
        for (; i < i1; i++) band_row(format, x, stride, 1, w, out, i, cb, ce, partial);
        return;
    }
#if LANES == 16
    if (rows == 1 && format == BF16) { /* whole 32-column pairs deinterleaved, then the rest */
        int i8 = i + (i1 - i) / 8 * 8, c32 = cb + (ce - cb) / (2 * LANES) * (2 * LANES);
        band_bf16_deinterleaved(packed, x, w, out, i, i8, cb, c32, partial);
        if (in_order) bf16_sums_in_order(cb, c32, partial);
        if (c32 < ce)
            for (int j = i; j < i8; j += 8)
                band_single8(BF16, packed, x, w, out, j, c32, ce, partial);
        i = i8;
    }
#endif
    if (rows == 1)
        for (; i + 8 <= i1; i += 8)
            for (int c0 = cb; c0 < ce; c0 += TILE)
                band_single8(format, packed, x, w, out, i, c0, c0 + TILE < ce ? c0 + TILE : ce,
                             partial);
    int group = group_size(rows);
    for (; i + GROUP_DEPTH <= i1; i += GROUP_DEPTH)
        for (int c0 = cb; c0 < ce; c0 += TILE) {
            int c1 = c0 + TILE < ce ? c0 + TILE : ce;
            for (int r0 = 0; r0 < rows; r0 += group) {
                const float *xr = x + r0 * stride;
                float *pr = partial + (size_t)r0 * out;
#define BAND_GROUP(n) band_group(format, packed, n, xr, stride, w, out, i, c0, c1, pr)
                WITH_GROUP_SIZE(rows - r0 < group ? rows - r0 : group, BAND_GROUP)
#undef BAND_GROUP
            }
        }
    for (; i < i1; i++) band_row(format, x, stride, rows, w, out, i, cb, ce, partial);
}

/* `CALL(f)` with f the constant `format`: one copy of a product's loops per format, its
 * widening inlined. */
#define WITH_FORMAT(format, CALL)                                                            \
    switch (format) {                                                                       \
    case BF16: CALL(BF16); break;                                                           \
    case F16: CALL(F16); break;                                                             \
    case I8: CALL(I8); break;                                                               \
    default: CALL(F32);                                                                     \
    }

/* One copy of the loops per format and layout, its widening and addressing inlined. */
#define BAND_PRODUCT_AS(format, packed)                                                      \
    band_product_as(format, packed, x, stride, rows, w->data, w->out, i0, i1, cb, ce, partial,   \
                    in_order)
#define BAND_PACKED(format) BAND_PRODUCT_AS(format, 1)
#define BAND_ROW_MAJOR(format) BAND_PRODUCT_AS(format, 0)

/* Whether `band_product_as` keeps the partial sums of one row of w's columns [cb, c32) (the
 * whole 32-column pairs) in `band_bf16_deinterleaved`'s order until `bf16_sums_in_order`. */
INLINE int sums_deinterleaved(const Matrix *w, int rows) {
    return LANES == 16 && rows == 1 && w->format == BF16 && (w->packed || w->out > NARROW_COLUMNS);
}

/* `band_product_as` of the [in, out] (or packed) matrix `w` into `partial`: zeroed first and
 * left in column order for a whole band (`whole`), else added to as one of a product's
 * chunks, in the order `sums_deinterleaved` says (see `linear_band_shared`). */
static void band_product(const Matrix *w, const float *x, size_t stride, int rows, int i0,
                         int i1, int cb, int ce, float *partial, int whole) {
    int in_order = whole;
    if (whole)
        for (int r = 0; r < rows; r++)
            memset(partial + (size_t)r * w->out + cb, 0, sizeof(float) * (ce - cb));
    if (w->packed) {
        WITH_FORMAT(w->format, BAND_PACKED)
    } else {
        WITH_FORMAT(w->format, BAND_ROW_MAJOR)
    }
}

/* The sum of v's lanes, halves added to halves (a sum lane by lane would be LANES dependent
 * adds, the latency that bounded few-row dot products). */
INLINE float tree_sum(vecw v) {
    float lanes[LANES];
    memcpy(lanes, &v, sizeof lanes);
    for (int width = LANES / 2; width; width /= 2)
        for (int lane = 0; lane < width; lane++) lanes[lane] += lanes[lane + width];
    return lanes[0];
}

/* y[r][c] = dot(w[c], x[r]) for the `group` rows of x at `x` (`stride` apart) and output rows
 * c and c + 1 of w: 2 x group vector accumulators along `in`, so each loaded vector of w feeds
 * the whole group and each of x both outputs. */
INLINE void row_pair_group(int group, const float *x, size_t stride, int in, const float *w,
                           int out, int r0, int c, const float *add, float *y) {
    int whole = in - in % LANES;
    const float *w0 = w + (size_t)c * in, *w1 = w0 + in;
    vecw acc[2][MAX_GROUP] = {{{0}}};
    for (int i = 0; i < whole; i += LANES) {
        vecw u = loadw(w0 + i), v = loadw(w1 + i);
        for (int k = 0; k < group; k++) {
            vecw xv = loadw(x + k * stride + i);
            acc[0][k] += u * xv, acc[1][k] += v * xv;
        }
    }
    for (int k = 0; k < group; k++)
        for (int j = 0; j < 2; j++) {
            const float *wj = j ? w1 : w0, *xk = x + k * stride;
            float sum = tree_sum(acc[j][k]);
            for (int i = whole; i < in; i++) sum += wj[i] * xk[i];
            size_t at = (size_t)(r0 + k) * out + c + j;
            y[at] = add ? add[at] + sum : sum;
        }
}

/* y[r][c] = dot(w[c], x[r]) (+ add[r][c]) for output rows c in [c0, c1), w contiguous [out, in]
 * float32: pairs of output rows with the rows of x in `group_size` groups (as
 * `band_product_as`), each `row_pair_group`; an odd output row left over takes plain dot
 * products. */
static void row_products(const float *x, size_t stride, int rows, int in, const float *w,
                         int out, int c0, int c1, const float *add, float *y) {
    int pairs_end = c0 + (c1 - c0) / 2 * 2, group = group_size(rows);
    for (int c = c0; c < pairs_end; c += 2)
        for (int r0 = 0; r0 < rows; r0 += group) {
            const float *xr = x + r0 * stride;
#define ROW_PAIR_GROUP(n) row_pair_group(n, xr, stride, in, w, out, r0, c, add, y)
            WITH_GROUP_SIZE(rows - r0 < group ? rows - r0 : group, ROW_PAIR_GROUP)
#undef ROW_PAIR_GROUP
        }
    for (int c = pairs_end; c < c1; c++) {
        const float *wc = w + (size_t)c * in;
        for (int r = 0; r < rows; r++) {
            const float *xr = x + r * stride;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < in; i++) sum += wc[i] * xr[i];
            y[(size_t)r * out + c] = add ? add[(size_t)r * out + c] + sum : sum;
        }
    }
}

/* Whether `w` is a matrix `linear` reads: `in` x `out`, a known format, [out, in] only in F32,
 * packed only [in, out] in whole groups of rows and tiles (panels: whole panels), scales
 * exactly for I8. */
static int check_matrix(const Matrix *w, int in, int out) {
    int known = w->format >= F32 && w->format <= I8;
    int packs = !w->packed || (w->packed == 1 && !w->out_in && in % PACK_ROWS == 0 &&
                               out % PACK_COLUMNS == 0) ||
                (w->packed == PANELS && !w->out_in && out % PANEL_COLUMNS == 0) ||
                (w->packed == QUADS && !w->out_in && w->format == I8 && in % QUAD_ROWS == 0 &&
                 in <= QUAD_MAX_IN && out % PANEL_COLUMNS == 0);
    return w->data && known && w->in == in && w->out == out && packs &&
           (!w->out_in || w->format == F32) && (w->format == I8) == (w->scales != NULL);
}

/* The output columns [begin, end) of y this thread writes in `linear_columns` (and the input
 * columns of x it reads in a `linear_band` of a weight with as many inputs), whole groups of
 * PACK_ROWS where `columns` is a multiple of it: a packed weight's band is whole groups. */
static void linear_share(int columns, int *begin, int *end) {
    int unit = columns % PACK_ROWS ? 1 : PACK_ROWS;
    share(columns / unit, omp_get_num_threads(), omp_get_thread_num(), begin, end);
    *begin *= unit, *end *= unit;
}

/* The first half of `linear` on this thread: its band of input rows of w into its partial sums
 * (`partials` holds threads * rows * w.out floats); nothing for an [out, in] weight, which is
 * read whole in the second half. Before the second half, a barrier. */
static void linear_band(const float *x, size_t stride, int rows, const Matrix *matrix,
                        float *partials) {
    if (matrix->out_in) return;
    int begin, end;
    linear_share(matrix->in, &begin, &end);
    band_product(matrix, x, stride, rows, begin, end, 0, matrix->out,
                 partials + (size_t)omp_get_thread_num() * rows * matrix->out, 1);
}

/* Input rows per chunk of `linear_band_shared`: whole groups of PACK_ROWS, at least about
 * `CHUNK_BYTES` of the weight. */
#define CHUNK_BYTES 65536
INLINE int chunk_rows(const Matrix *matrix) {
    size_t group = (size_t)PACK_ROWS * matrix->out * format_bytes(matrix->format);
    return PACK_ROWS * (int)(group >= CHUNK_BYTES ? 1 : CHUNK_BYTES / group);
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

/* `linear_band` where a thread that finished its band takes the chunks other threads have not
 * reached yet, from the far end of theirs: a thread another process slowed leaves less for
 * the barrier to wait for, and each thread still streams its own band in order. The chunks
 * left to each thread are one word in the region's `Barrier`, which its owner sets as its
 * band starts: a thread that looks earlier sees the last product's, all taken. Reads x
 * whole: x must be written before (a barrier). Measured on a 2-core AVX-512 CPU (Zen 4),
 * steps alternating with equal bands in one process: a 3B bf16 decode step 0.957-0.966x the
 * time (its threads' waits at barriers 20 against 57-79 ms over two steps), batch 8 0.968x,
 * int8 0.967x; a 136M hybrid's the same (its experts' products keep equal bands). Dealing
 * every chunk out from one counter instead (threads taking turns through the weight) left
 * the waits as low but the bands about 1.2x slower (separate processes): each thread's stream
 * broke at every chunk. */
static void linear_band_shared(const float *x, size_t stride, int rows, const Matrix *matrix,
                               float *partials) {
    Barrier *b = region_barrier_of_thread;
    int threads = omp_get_num_threads(), thread = omp_get_thread_num();
    if (matrix->out_in) return;
    /* (the input rows past the last 8, one at a time, add in column order) */
    int tail = matrix->in % 8 && sums_deinterleaved(matrix, rows);
    if (!b || threads == 1 || threads > MAX_SHARING || tail) {
        linear_band(x, stride, rows, matrix, partials);
        return;
    }
    int in = matrix->in, unit = chunk_rows(matrix), first, last;
    share((in + unit - 1) / unit, threads, thread, &first, &last);
    float *partial = partials + (size_t)thread * rows * matrix->out;
    memset(partial, 0, sizeof(float) * rows * matrix->out);
    offer_share(b, thread, first, last);
    for (int k = 0, chunk; (chunk = take_next(b, thread, threads, &k)) >= 0;) {
        int begin = chunk * unit, end = begin + unit < in ? begin + unit : in;
        band_product(matrix, x, stride, rows, begin, end, 0, matrix->out, partial, 0);
    }
#if LANES == 16
    if (sums_deinterleaved(matrix, rows))
        bf16_sums_in_order(0, matrix->out / (2 * LANES) * (2 * LANES), partial);
#endif
}

/* The second half of `linear` on this thread: its `linear_share` of y's columns, the partial
 * sums added (times I8's scales) or, for an [out, in] weight, dot products (+ add). */
static void linear_columns(const float *x, size_t stride, int rows, const Matrix *matrix,
                           const float *add, float *y, const float *partials) {
    int threads = omp_get_num_threads(), begin, end, in = matrix->in, out = matrix->out;
    linear_share(out, &begin, &end);
    if (matrix->out_in) {
        row_products(x, stride, rows, in, matrix->data, out, begin, end, add, y);
        return;
    }
    size_t size = (size_t)rows * out;
    const float *scales = matrix->scales;
    for (int r = 0; r < rows; r++) {
        for (int c = begin; c < end; c++) {
            size_t at = (size_t)r * out + c;
            float sum = 0.0f;
            for (int t = 0; t < threads; t++) sum += partials[(size_t)t * size + at];
            if (scales) sum *= scales[c];
            y[at] = add ? add[at] + sum : sum;
        }
    }
}

/* y = x @ w (+ add), x [rows, w.in] with rows `stride` apart, y [rows, w.out]. Every thread of
 * the region calls it, x whole by then (its rows are dealt out, `linear_band_shared`); it ends
 * with a barrier. `partials` holds threads * rows * w.out floats. */
static void panel_product(const float *x, size_t stride, int rows, const Matrix *matrix,
                          const float *add, float *y);

static void quad_product(const float *x, size_t stride, int rows, const Matrix *matrix,
                         const float *add, float *y, int shared);

static void linear(const float *x, size_t stride, int rows, const Matrix *matrix,
                   const float *add, float *y, float *partials) {
    if (matrix->packed == PANELS) {
        panel_product(x, stride, rows, matrix, add, y);
        return;
    }
    if (matrix->packed == QUADS) {
        quad_product(x, stride, rows, matrix, add, y, 1);
        region_barrier();
        return;
    }
    linear_band_shared(x, stride, rows, matrix, partials);
    if (!matrix->out_in) region_barrier();
    linear_columns(x, stride, rows, matrix, add, y, partials);
    region_barrier();
}

/* Panels: a matrix stored as [out / PANEL_COLUMNS][in][PANEL_COLUMNS], each panel its columns'
 * input rows one after another (an LM head: `engine.models.matmul.head_layout`). A thread
 * takes whole panels, and each panel is one contiguous stream whose sums stay in registers
 * through every input row: no partial sums leave them. Measured on a 2-core AVX-512 CPU
 * (Zen 4), cycled from memory beside the same head read row-major by columns (the
 * `linear_by_columns` split): 512 x 151,936 float32 (the speculation bench's tied head) 0.86x
 * the time for one row and 0.79x for five; 2048 x 151,936 bf16 0.94x and 0.99x. The demo
 * model's verify step of 5 tokens, in processes alternating with the row-major head: 19.2-20.1
 * ms, 1.35-1.40x its floor, against 21.0-22.4 ms, 1.50-2.03x; one token 15.8-18.2 ms against
 * 18.3-18.8 (torch's banded matvec, there). */
#define PANEL_VECTORS (PANEL_COLUMNS / LANES)

/* The sums of panel `p`'s columns into y's row at `y` (times I8's scale, + add's row). */
INLINE void panel_store(const Matrix *m, int p, const vecw *sums, const float *add, float *y) {
    for (int v = 0; v < PANEL_VECTORS; v++) {
        int c = p * PANEL_COLUMNS + v * LANES;
        vecw sum = sums[v];
        if (m->scales) sum *= loadw(m->scales + c);
        if (add) sum += loadw(add + c);
        memcpy(y + c, &sum, sizeof sum);
    }
}

/* y[r][c] = sum over input rows i of x[r][i] * w[i][c] (times I8's scale, + add) for the
 * `group` rows r of x at `x` and the columns of panel `p`. */
INLINE void panel_group(int format, int group, const float *x, size_t stride, const Matrix *m,
                        int p, const float *add, float *y) {
    const void *w = m->data;
    size_t base = (size_t)p * m->in * PANEL_COLUMNS;
    vecw sums[MAX_GROUP][PANEL_VECTORS];
    for (int k = 0; k < group; k++)
        for (int v = 0; v < PANEL_VECTORS; v++) sums[k][v] = (vecw){};
    for (int i = 0; i < m->in; i++)
        for (int v = 0; v < PANEL_VECTORS; v++) {
            vecw wv = widenw(format, w, base + (size_t)i * PANEL_COLUMNS + v * LANES);
            for (int k = 0; k < group; k++) sums[k][v] += x[k * stride + i] * wv;
        }
    for (int k = 0; k < group; k++)
        panel_store(m, p, sums[k], add ? add + (size_t)k * m->out : NULL, y + (size_t)k * m->out);
}

/* `panel_group` of one row: even and odd input rows in separate sums, two chains of FMAs per
 * vector at once. */
INLINE void panel_row(int format, const float *x, const Matrix *m, int p, const float *add,
                      float *y) {
    const void *w = m->data;
    size_t base = (size_t)p * m->in * PANEL_COLUMNS;
    vecw even[PANEL_VECTORS], odd[PANEL_VECTORS];
    for (int v = 0; v < PANEL_VECTORS; v++) even[v] = odd[v] = (vecw){};
    int i = 0;
    for (; i + 2 <= m->in; i += 2) {
        size_t at = base + (size_t)i * PANEL_COLUMNS;
        for (int v = 0; v < PANEL_VECTORS; v++) {
            even[v] += x[i] * widenw(format, w, at + v * LANES);
            odd[v] += x[i + 1] * widenw(format, w, at + PANEL_COLUMNS + v * LANES);
        }
    }
    for (; i < m->in; i++)
        for (int v = 0; v < PANEL_VECTORS; v++)
            even[v] += x[i] * widenw(format, w, base + (size_t)i * PANEL_COLUMNS + v * LANES);
    for (int v = 0; v < PANEL_VECTORS; v++) even[v] += odd[v];
    panel_store(m, p, even, add, y);
}

/* y = x @ w (+ add) of a panels matrix, each thread its share of whole panels, the rows of x
 * in `group_size` groups; then a barrier. */
static void panel_product(const float *x, size_t stride, int rows, const Matrix *matrix,
                          const float *add, float *y) {
    int first, last, group = group_size(rows);
    share(matrix->out / PANEL_COLUMNS, omp_get_num_threads(), omp_get_thread_num(), &first,
          &last);
    for (int p = first; p < last; p++)
        for (int r0 = 0; r0 < rows; r0 += group) {
            const float *xr = x + r0 * stride;
            const float *ar = add ? add + (size_t)r0 * matrix->out : NULL;
            float *yr = y + (size_t)r0 * matrix->out;
#define PANEL_ROW(format) panel_row(format, xr, matrix, p, ar, yr)
#define PANEL_GROUP_AS(format) panel_group(format, n, xr, stride, matrix, p, ar, yr)
#define PANEL_GROUP(size)                                                                    \
    {                                                                                       \
        const int n = size;                                                                 \
        if (n == 1) WITH_FORMAT(matrix->format, PANEL_ROW)                                  \
        else WITH_FORMAT(matrix->format, PANEL_GROUP_AS)                                    \
    }
            WITH_GROUP_SIZE(rows - r0 < group ? rows - r0 : group, PANEL_GROUP)
#undef PANEL_GROUP
#undef PANEL_GROUP_AS
#undef PANEL_ROW
        }
    region_barrier();
}

/* Quad panels: an I8 matrix stored as [out / 32][in / 4][32][4], each panel its 32 columns'
 * input rows four at a time, the four rows of a column side by side (`QUADS`). A thread takes
 * whole panels (as `panel_product`), and with AVX-512 VNNI sums them in integers: x's row is
 * written as integers x_int = round(x * 2^s), s the largest with every |x_int| <= 2^30, in
 * four signed base-256 digits, and each 64-byte load of w (16 columns of four rows) meets
 * each digit of the four rows' x in one `vpdpbusd` (w's bytes as unsigned, w + 128: x's sum
 * times 128 comes off once per row). Sums of products are exact integers (in 32 bits while
 * in <= QUAD_MAX_IN) put together once per panel in double; the only rounding before the
 * output's is x's to 2^-s, where 2^(30 - s) exceeds max |x|: exact for every element within
 * 2^7 of the largest, at most max |x| * 2^-31 off for the rest (float32 sums round at each
 * of `in` additions instead). Measured on a 2-core AVX-512 CPU (Zen 4), one row through an
 * int8 panel warm in cache: 58 GB/s per core against 25 widening each vector to float32
 * (`vpmovsxbd` and `vcvtdq2ps` for every 16 weights: one row's product was bound by them, not
 * by the read); a 3B int8 decode step, in processes alternating with the packed layout while
 * the read was at 45-49 GB/s, 107-115 ms against 136-146 (0.78x; at a 30 GB/s read the two
 * were within 3%: the read bounds both). Without VNNI, or where x is not finite, the panel's
 * weights are widened. */
#define QUAD_GROUP 3 /* rows of x through a panel at once: 8 integer sums of 32 lanes each */

/* Each thread's digits of x, kept for its next product (rows * in int32). */
static __thread int32_t *quad_digits_data;
static __thread size_t quad_digits_count;

static int32_t *quad_digits(size_t count) {
    if (count > quad_digits_count) {
        free(quad_digits_data);
        quad_digits_data = NULL, quad_digits_count = 0;
        if (posix_memalign((void **)&quad_digits_data, 64, count * sizeof(int32_t))) return NULL;
        quad_digits_count = count;
    }
    return quad_digits_data;
}

typedef struct {
    double unit;   /* the value of x_int's 1: 2^-s (0 for a row of zeros) */
    int64_t sum;   /* sum of x_int over the row */
} QuadRow;

/* x_int of `x` [from, in) (in whole quads) as digits (see `quad_row`), their sum added to
 * `row->sum`. */
static void quad_digits_scalar(const float *x, int from, int in, double scale, int32_t *digits,
                               QuadRow *row) {
    for (int q = from / QUAD_ROWS; q < in / QUAD_ROWS; q++) {
        uint8_t bytes[4][QUAD_ROWS];
        for (int t = 0; t < QUAD_ROWS; t++) {
            int32_t v = (int32_t)llrint((double)x[q * QUAD_ROWS + t] * scale);
            row->sum += v;
            for (int p = 0; p < 3; p++) { /* balanced digits: each in [-128, 127] */
                int32_t d = (int8_t)(uint8_t)v;
                bytes[p][t] = (uint8_t)d;
                v = (v - d) / 256;
            }
            bytes[3][t] = (uint8_t)(int8_t)v; /* |v| <= 64 here */
        }
        memcpy(digits + (size_t)q * 4, bytes, sizeof bytes);
    }
}

/* Row `x` [in] as `digits` [in / 4][4]: for each four input rows, digit p of the four x_int
 * as the bytes of one int32 (what `vpdpbusd` broadcasts); 0 when x has a value that is not
 * finite. */
static int quad_row(const float *x, int in, int32_t *digits, QuadRow *row) {
    float largest = 0.0f;
    int i = 0, finite = 1;
#if defined(__AVX512F__)
    __m512 top = _mm512_setzero_ps();
    for (; i + 16 <= in; i += 16) {
        __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i));
        finite &= !_mm512_cmp_ps_mask(a, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ);
        top = _mm512_max_ps(top, a);
    }
    largest = _mm512_reduce_max_ps(top);
#endif
    for (; i < in; i++) {
        finite &= isfinite(x[i]) != 0;
        largest = fmaxf(largest, fabsf(x[i]));
    }
    if (!finite) return 0;
    int e = 0;
    frexpf(largest, &e); /* largest < 2^e */
    double scale = largest > 0.0f ? ldexp(1.0, 30 - e) : 0.0;
    row->unit = largest > 0.0f ? ldexp(1.0, e - 30) : 0.0;
    row->sum = 0;
    i = 0;
#if defined(__AVX512BW__)
    if (30 - e <= 127) { /* 2^(30 - e) a float: x * it exact, rounded to nearest as llrint */
        __m512 by = _mm512_set1_ps((float)scale);
        __m512i sums = _mm512_setzero_si512();
        for (; i + 16 <= in; i += 16) {
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), by));
            sums = _mm512_add_epi64(sums, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(v)));
            sums = _mm512_add_epi64(sums, _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1)));
            __m128i plane[4];
            for (int p = 0; p < 3; p++) {
                __m512i d = _mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24);
                plane[p] = _mm512_cvtepi32_epi8(d);
                v = _mm512_srai_epi32(_mm512_sub_epi32(v, d), 8);
            }
            plane[3] = _mm512_cvtepi32_epi8(v);
            /* [plane][quad] -> [quad][plane]: a 4 x 4 transpose of int32 */
            __m128i a = _mm_unpacklo_epi32(plane[0], plane[1]);
            __m128i b = _mm_unpacklo_epi32(plane[2], plane[3]);
            __m128i c = _mm_unpackhi_epi32(plane[0], plane[1]);
            __m128i d = _mm_unpackhi_epi32(plane[2], plane[3]);
            __m128i *out = (__m128i *)(digits + (size_t)i);
            _mm_storeu_si128(out, _mm_unpacklo_epi64(a, b));
            _mm_storeu_si128(out + 1, _mm_unpackhi_epi64(a, b));
            _mm_storeu_si128(out + 2, _mm_unpacklo_epi64(c, d));
            _mm_storeu_si128(out + 3, _mm_unpackhi_epi64(c, d));
        }
        row->sum += _mm512_reduce_add_epi64(sums);
    }
#endif
    quad_digits_scalar(x, i, in, scale, digits, row);
    return 1;
}

#if defined(__AVX512VNNI__) && LANES == 16
/* `sums` [n][4][32]: for each of n rows of x (digits `stride` int32 apart) and digit p, the
 * integer sum over the panel's input rows of (w + 128) * digit, by column. */
INLINE void quad_sums(int n, const int32_t *digits, size_t stride, const int8_t *panel,
                      int quads, int32_t *sums) {
    __m512i acc[QUAD_GROUP][4][2];
    for (int k = 0; k < n; k++)
        for (int p = 0; p < 4; p++) acc[k][p][0] = acc[k][p][1] = _mm512_setzero_si512();
    const __m512i flip = _mm512_set1_epi8(-128);
    for (int q = 0; q < quads; q++) {
        const int8_t *at = panel + (size_t)q * QUAD_ROWS * PANEL_COLUMNS;
        __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(at), flip);
        __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(at + 64), flip);
        for (int k = 0; k < n; k++)
            for (int p = 0; p < 4; p++) {
                __m512i d = _mm512_set1_epi32(digits[k * stride + (size_t)q * 4 + p]);
                acc[k][p][0] = _mm512_dpbusd_epi32(acc[k][p][0], w0, d);
                acc[k][p][1] = _mm512_dpbusd_epi32(acc[k][p][1], w1, d);
            }
    }
    for (int k = 0; k < n; k++)
        for (int p = 0; p < 4; p++)
            for (int v = 0; v < 2; v++)
                _mm512_storeu_si512(sums + ((size_t)k * 4 + p) * PANEL_COLUMNS + v * 16,
                                    acc[k][p][v]);
}
#define QUAD_INTEGER 1
#else
#define QUAD_INTEGER 0
#endif

/* y's columns of panel `p` for `n` rows of x from their widened sums `sums` [n][32]. */
INLINE void quad_store(const Matrix *m, int p, int n, const double *sums, const float *add,
                       float *y) {
    for (int k = 0; k < n; k++)
        for (int j = 0; j < PANEL_COLUMNS; j++) {
            int c = p * PANEL_COLUMNS + j;
            size_t at = (size_t)k * m->out + c;
            float value = (float)(sums[k * PANEL_COLUMNS + j] * m->scales[c]);
            y[at] = add ? add[at] + value : value;
        }
}

/* `sums` [n][32] of n rows of x (`stride` apart) through panel `panel`, widening its weights. */
static void quad_sums_widened(int n, const float *x, size_t stride, const int8_t *panel, int in,
                              double *sums) {
    float acc[QUAD_GROUP][PANEL_COLUMNS] = {{0}};
    for (int q = 0; q < in / QUAD_ROWS; q++)
        for (int t = 0; t < QUAD_ROWS; t++) {
            const int8_t *w = panel + (size_t)q * QUAD_ROWS * PANEL_COLUMNS + t;
            for (int k = 0; k < n; k++) {
                float xv = x[k * stride + q * QUAD_ROWS + t];
                for (int j = 0; j < PANEL_COLUMNS; j++) acc[k][j] += xv * w[j * QUAD_ROWS];
            }
        }
    for (int k = 0; k < n; k++)
        for (int j = 0; j < PANEL_COLUMNS; j++) sums[k * PANEL_COLUMNS + j] = acc[k][j];
}

/* y's columns of panel `p` (+ add) for every row of x: integer sums from the rows' `digits`
 * (`info`), or (`digits` NULL) widened sums. */
static void quad_panel(const float *x, size_t stride, int rows, const Matrix *m, int p,
                       const int32_t *digits, const QuadRow *info, const float *add, float *y) {
    int in = m->in;
    const int8_t *panel = (const int8_t *)m->data + (size_t)p * in * PANEL_COLUMNS;
    for (int r0 = 0; r0 < rows; r0 += QUAD_GROUP) {
        int n = rows - r0 < QUAD_GROUP ? rows - r0 : QUAD_GROUP;
        double sums[QUAD_GROUP * PANEL_COLUMNS];
#if QUAD_INTEGER
        if (digits) {
            int32_t parts[QUAD_GROUP * 4 * PANEL_COLUMNS];
            quad_sums(n, digits + (size_t)r0 * in, in, panel, in / QUAD_ROWS, parts);
            for (int k = 0; k < n; k++)
                for (int j = 0; j < PANEL_COLUMNS; j++) {
                    const int32_t *d = parts + (size_t)k * 4 * PANEL_COLUMNS + j;
                    double whole = ((d[3 * PANEL_COLUMNS] * 256.0 + d[2 * PANEL_COLUMNS]) * 256.0 +
                                    d[PANEL_COLUMNS]) * 256.0 + d[0];
                    sums[k * PANEL_COLUMNS + j] =
                        (whole - 128.0 * (double)info[r0 + k].sum) * info[r0 + k].unit;
                }
        } else
#endif
            quad_sums_widened(n, x + r0 * stride, stride, panel, in, sums);
        quad_store(m, p, n, sums, add ? add + (size_t)r0 * m->out : NULL,
                   y + (size_t)r0 * m->out);
    }
}

/* y = x @ w (+ add) of a quad panels matrix, each thread its share of whole panels and then
 * (`shared`: x whole, and a barrier before the region's next product) the panels a slower
 * thread has not reached, from the far end of its share, as `linear_band_shared` deals out
 * chunks. No barrier at the end. */
static void quad_product(const float *x, size_t stride, int rows, const Matrix *m,
                         const float *add, float *y, int shared) {
    Barrier *b = region_barrier_of_thread;
    int in = m->in, threads = omp_get_num_threads(), thread = omp_get_thread_num(), first, last;
    share(m->out / PANEL_COLUMNS, threads, thread, &first, &last);
    shared = shared && b && threads > 1 && threads <= MAX_SHARING;
    if (first >= last && !shared) return;
    QuadRow info[rows];
    int32_t *digits = QUAD_INTEGER ? quad_digits((size_t)rows * in) : NULL;
    for (int r = 0; r < rows && digits; r++)
        if (!quad_row(x + r * stride, in, digits + (size_t)r * in, info + r)) digits = NULL;
    if (!shared) {
        for (int p = first; p < last; p++) quad_panel(x, stride, rows, m, p, digits, info, add, y);
        return;
    }
    offer_share(b, thread, first, last);
    for (int k = 0, p; (p = take_next(b, thread, threads, &k)) >= 0;)
        quad_panel(x, stride, rows, m, p, digits, info, add, y);
}

/* y = x @ w (+ add) where each thread takes its own columns of y (in multiples of 32) over
 * every input row: no partial sums to add up across threads, and each thread's partial sums
 * are half as wide. For weights at least `SPLIT_COLUMNS_FROM` wide (a vocabulary), whose rows'
 * partial sums outgrow the L2 cache: measured on the 2-core AVX-512 CPU beside a 69 GB/s
 * read, 5 rows through a 150k-column fp32 head 6.58 -> 6.01 ms, 8 rows 9.45 -> 8.06, one row
 * the same, and a 5-token verify step of the 110M random-demo model 10.18 -> 9.83 ms; for
 * 2,560-22,016 columns it was the same or slower (8 rows through 2048 x 2560: 0.56 -> 0.77). */
#define SPLIT_COLUMNS_FROM 32768
static void linear_by_columns(const float *x, size_t stride, int rows, const Matrix *matrix,
                              const float *add, float *y) {
    int out = matrix->out, begin, end;
    share((out + 31) / 32, omp_get_num_threads(), omp_get_thread_num(), &begin, &end);
    begin *= 32, end = end * 32 < out ? end * 32 : out;
    if (begin < end) {
        band_product(matrix, x, stride, rows, 0, matrix->in, begin, end, y, 1);
        for (int r = 0; r < rows; r++)
            for (int c = begin; c < end; c++) {
                size_t at = (size_t)r * out + c;
                float sum = matrix->scales ? y[at] * matrix->scales[c] : y[at];
                y[at] = add ? add[at] + sum : sum;
            }
    }
    region_barrier();
}
