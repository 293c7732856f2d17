/* Weights in their stored formats: the `Matrix` every product reads, its layouts, and the
 * widening of each format to float32 lanes in registers (the one place a format is read). */

#pragma once

#include "threads.h"

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
 * after another, each tile its PACK_ROWS rows of PACK_COLUMNS contiguous elements: the pass of a
 * group of rows over all columns reads one contiguous stream (the [in, out] layout reads one
 * stream per row). Fewer streams read faster than eight row streams at once (figures:
 * `bench/RESULTS.md`, "The native kernels' choices"). */
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

/* The products' own vectors: 16 lanes where the CPU has AVX-512, else 8. With half the
 * instructions per byte, more of the weight's cache lines are in flight at once, and the read
 * reaches the bandwidth torch's own reductions reach (figures: `bench/RESULTS.md`, "The native
 * kernels' choices"). */
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
 * (figures: `bench/RESULTS.md`, "The native kernels' choices"):
 * - a one-row int8 product: each widened vector takes only 16 bytes, so fewer of its cache
 *   lines are in flight; each row's line is asked for 2 KiB ahead, once per line.
 * - products of 2-16 rows do 4-16 FMAs per weight vector, so the loads of the next lines
 *   start late: the same prefetch, in every format.
 * - a stream that runs past its row's end goes on in the next group's rows (`prefetch_rows`).
 * - one-row products of narrow weights, rows of at most `NARROW_BYTES` (a hybrid model's
 *   Mamba2 in_proj at hidden 768; its experts and projections, at most `NARROW_COLUMNS` wide,
 *   read one input row at a time, a single stream): their row streams end before the hardware
 *   prefetcher is ahead of them. */
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

/* Rows of x a `band_group` takes at once: their sums stay in registers beside a weight vector (16
 * rows would leave too few of AVX-512's 32 registers); more rows are split into groups of equal
 * size, one group of 8 being faster than two of 4 (figures: `bench/RESULTS.md`, "The native
 * kernels' choices"). */
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

/* `CALL(f)` with f the constant `format`: one copy of a product's loops per format, its
 * widening inlined. */
#define WITH_FORMAT(format, CALL)                                                            \
    switch (format) {                                                                       \
    case BF16: CALL(BF16); break;                                                           \
    case F16: CALL(F16); break;                                                             \
    case I8: CALL(I8); break;                                                               \
    default: CALL(F32);                                                                     \
    }
