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
 * of `in` additions instead). Integer dot products lift the cost of widening each vector to
 * float32, which bounds a one-row int8 product otherwise (figures: `bench/RESULTS.md`, "The
 * native kernels' choices"). Without VNNI, or where x is not finite, the panel's weights are
 * widened. */

#pragma once

#include "formats.h"

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
