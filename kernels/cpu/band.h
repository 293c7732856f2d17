/* Products of a weight stored [in, out] or packed by groups of eight input rows, in every
 * format: each thread streams its band of input rows into private partial sums (`linear.h`
 * adds them up), the rows of x in groups sharing each widened weight vector; and, in float32
 * only, dot products of a weight stored [out, in] (`row_products`). */

#pragma once

#include "formats.h"

/* partial[k][c] += sum over j < GROUP_DEPTH of x[k][i + j] * w[i + j][c] for the `group` rows k
 * of x and columns c in [c0, c1): each widened vector of w serves the whole group, and each row's
 * sums stay in a register through the GROUP_DEPTH input rows (x's values broadcast from memory
 * inside the FMAs). Eight rather than four: each pass moves the group's partial sums (larger than
 * L2 for a vocabulary) once per eight weight rows read instead of twice per four (figures:
 * `bench/RESULTS.md`, "The native kernels' choices"). */
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
/* 32 bf16 of one row at `p` in one load, widened as two vectors: the even columns (a shift) and
 * the odd ones (a mask). Half the loads of `widenw` and no shuffle (figures: `bench/RESULTS.md`,
 * "The native kernels' choices"). */
INLINE void widen_bf16_pair(const void *p, vecw *even, vecw *odd) {
    __m512i v = _mm512_loadu_si512(p);
    *even = (vecw)_mm512_slli_epi32(v, 16);
    *odd = (vecw)_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u));
}

/* One row of x through input rows [i, i1) (eight at a time) of a bf16 w, columns [cb, ce)
 * (32 at a time): the partial sums of each 32 columns are kept as [16 even][16 odd], the order
 * `widen_bf16_pair` gives them, so that each widened vector is one FMA into them, and are put
 * in column order once at the end (`bf16_sums_in_order`, after the product's last chunk).
 * Interleaving each 8 rows' sums back as they were made cost a shuffle per FMA
 * (figures: `bench/RESULTS.md`, "The native kernels' choices"). */
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
 * (`band_row`), a single stream through w with the partial sums (at most 4 KiB) in L1. At 2,048
 * columns and more, eight rows per pass stay ahead (figures: `bench/RESULTS.md`, "The native
 * kernels' choices"). */
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
