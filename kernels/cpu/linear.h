/* Products with weights in their stored formats, on CPU: how `linear` splits the work.
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
 * and `matmul` in `decode.c` the same product on its own (the LM head, products of the torch
 * path). A weight is read either as a contiguous [in, out] (each thread streams its own band of
 * input rows into a private partial sum, taking the rest of a slower thread's band at the end,
 * see `linear_band_shared`, rows of x in groups of up to 8 so that each widened weight vector
 * serves the whole group, whose sums stay in registers through eight input rows (`band_group`); a
 * single row of x takes eight input rows per load and store of its partial sums, in four
 * independent chains, which brings one-row products of the narrow formats near their read floors,
 * or, through outputs at most `NARROW_COLUMNS` wide, one input row at a time (one stream); the
 * partials are then added by column; a one-row bf16 product widens 32 columns per load and keeps
 * its sums in the order that gives them, see `band_bf16_deinterleaved`), as the same [in, out]
 * packed by groups of eight input rows (`PACK_ROWS`, the narrow formats' layout wherever the
 * shape allows: the same passes, each group of rows one stream), as panels of 32 columns (an LM
 * head, `panel_product`) or, in I8, quad panels (`quad_product`): each thread whole panels, sums
 * in registers over every input row, or, in F32 only, as a contiguous [out, in] (each thread owns
 * a band of output rows: dot products). Widening in registers keeps a one-row product at its read
 * floor in every format, and grouping rows makes many-row products of the narrow formats faster
 * than widening once per row (figures: `bench/RESULTS.md`, "The native kernels' choices").
 * Vectors are 16 floats where the compiler targets AVX-512 and 8 elsewhere (`LANES`), and rows
 * are prefetched ahead where the hardware alone fell short (`PREFETCH_BYTES`).
 */

#pragma once

#include "band.h"
#include "panels.h"
#include "quads.h"

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

/* `linear_band` where a thread that finished its band takes the chunks other threads have not
 * reached yet, from the far end of theirs: a thread another process slowed leaves less for the
 * barrier to wait for, and each thread still streams its own band in order. The chunks left to
 * each thread are one word in the region's `Barrier`, which its owner sets as its band starts: a
 * thread that looks earlier sees the last product's, all taken. Reads x whole: x must be written
 * before (a barrier). Dealing every chunk out from one counter instead (threads taking turns
 * through the weight) breaks each thread's stream at every chunk (figures: `bench/RESULTS.md`,
 * "The native kernels' choices"). */
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

/* y = x @ w (+ add) where each thread takes its own columns of y (in multiples of 32) over
 * every input row: no partial sums to add up across threads, and each thread's partial sums
 * are half as wide. For weights at least `SPLIT_COLUMNS_FROM` wide (a vocabulary), whose rows'
 * partial sums outgrow the L2 cache; narrower ones are the same or slower this way
 * (figures: `bench/RESULTS.md`, "The native kernels' choices"). */
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
