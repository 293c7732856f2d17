/* Panels: a matrix stored as [out / PANEL_COLUMNS][in][PANEL_COLUMNS], each panel its columns'
 * input rows one after another (an LM head: `engine.models.matmul.head_layout`). A thread
 * takes whole panels, and each panel is one contiguous stream whose sums stay in registers
 * through every input row: no partial sums leave them (figures: `bench/RESULTS.md`, "The
 * native kernels' choices"). */

#pragma once

#include "formats.h"

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
