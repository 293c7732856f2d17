/* Long-batch products (prefill) in the CPU's dot-product arithmetic, reading each weight in the
 * layout the decode step stores it in: no unpacked copy of a weight is made.
 *
 *   BF16  x (float32, rounded to bfloat16 here) @ a bfloat16 weight packed as
 *         [in / 8][out / 32][8][32] (`pack_matrix`), float32 sums out
 *   W8A8  x quantized per row here (s = max|row| / 127, q = round-half-even(x / s), clipped to
 *         +-127; a zero row has s = 0 and q = 0) @ an int8 weight as quad panels
 *         [out / 32][in / 4][32][4] (`pack_quads`), exact int32 sums, times both scales
 *
 * Two ways to take the dot products, chosen by the caller (`isa`): TILES, AMX's tile products
 * (`tdpbf16ps`, `tdpbssd`: a 16 x 16 block of sums over 32 bf16 or 64 int8 products per
 * instruction), and VECTOR, AVX-512's (`vdpbf16ps`, `vpdpbusd`: 16 sums over pairs or quads).
 * `gemm_isas` says which this build and this process have; where neither, the caller keeps
 * torch's products.
 *
 * Each thread takes whole blocks of 32 rows (or, for a short batch, whole 32-column panels of
 * the weight) and walks them a chunk of rows at a time (`CHUNK_BYTES` of converted rows, kept
 * in the core's L2): for each group of panels of its columns (`GROUP_BYTES`), it lays the group
 * out as the dot products read it, once per chunk, and runs every block of the chunk's rows
 * through each panel of it, writing each block's 32 x 32 sums (scaled, plus a bias or a
 * residual) into the output. A quad panel is already what `vpdpbusd` and `tdpbssd` read (four
 * inputs of a column side by side, 128 bytes per four inputs: a tile loads 16 of them at that
 * stride), so int8 reads the weight in place; a bfloat16 packed tile holds its rows whole, so
 * each pair of rows is interleaved in registers into a panel of `in * 64` bytes that stays in
 * L2 (what `vdpbf16ps` and `tdpbf16ps` take: the two inputs of a column side by side).
 * Laying the panels out is a sizeable share of a bf16 product's time at a few hundred rows
 * (figures: `bench/RESULTS.md`, "The native kernels' choices"): what a bf16 weight stored as
 * pairs would save, were the decode step to read that layout as well.
 */

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_VECTOR 1
#else
#define BF16_VECTOR 0
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define I8_VECTOR 1
#else
#define I8_VECTOR 0
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && BF16_VECTOR
#define BF16_TILES 1
#else
#define BF16_TILES 0
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__)
#define I8_TILES 1
#else
#define I8_TILES 0
#endif

#define PACK_ROWS 8      /* a packed weight's row groups, as `formats.h` */
#define COLUMNS 32       /* a packed tile's and a quad panel's columns: one block's */
#define QUAD 4           /* a quad panel's inputs side by side */
#define BLOCK_ROWS 32    /* rows per block: two tiles of 16 */
#define CHUNK_BYTES (1 << 20) /* a chunk's converted rows, kept in L2 (measured: 512 KB laid
                                 * the panels of 1536-input weights out twice as often) */
#define GROUP_BYTES (256 << 10) /* a group of panels laid out, kept in L2 */
#define MIN_CHUNK_ROWS 256 /* but never fewer rows: every chunk lays each panel out again, and a
                           * wide input's 1 MB of rows was one block (bench/RESULTS.md) */

enum isa { VECTOR = 1, TILES = 2 };
enum product { BF16 = 0, W8A8 = 1, SUMS = 2 };

typedef struct {
    const void *weight;    /* packed bf16 or int8 quad panels */
    const float *scales;   /* W8A8: the weight's scale per column [out] */
    int in, out;
    const void *x;         /* float32 rows (BF16, W8A8) or int8 ones (SUMS) */
    int64_t x_stride;      /* elements */
    int rows;
    const float *add;      /* NULL, a bias [out] (stride 0) or rows [rows, out] */
    int64_t add_stride;
    void *y;               /* float32 [rows, out] (int32 for SUMS) */
    int isa, kind;
} Product;

static int round_up(int n, int to) { return (n + to - 1) / to * to; }

/* Rows [begin, end) of `count` split evenly over `parts`: part `index`'s share. */
static void share(int count, int parts, int index, int *begin, int *end) {
    int base = count / parts, extra = count % parts;
    *begin = index * base + (index < extra ? index : extra);
    *end = *begin + base + (index < extra ? 1 : 0);
}

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Whether this process may use AMX tiles: Linux grants their state on request. */
static int tiles_permitted(void) {
    static int permitted = -1;
    if (permitted < 0)
        permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}

/* Which products this build can run here: bit 0 BF16 VECTOR, 1 BF16 TILES, 2 W8A8 VECTOR,
 * 3 W8A8 TILES (tiles only where the OS grants them). */
int gemm_isas(void) {
    int tiles = (BF16_TILES || I8_TILES) && tiles_permitted();
    return BF16_VECTOR | (BF16_TILES && tiles) << 1 | I8_VECTOR << 2 | (I8_TILES && tiles) << 3;
}

#if BF16_VECTOR || I8_VECTOR || I8_TILES

#define EXACT _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC /* never fused into an FMA */

/* The result of one block: `sums` [32][32] (float32, or int32 for W8A8 and SUMS) of rows
 * [row, row + count) and panel `panel`, into `y` (W8A8: as torch's, sums.float() * s_x * s_w,
 * then + add; BF16: + add). */
static void store_block(const Product *p, const void *sums, const float *row_scales, int row,
                        int count, int panel) {
    size_t column = (size_t)panel * COLUMNS;
    for (int i = 0; i < count; i++) {
        size_t at = (size_t)(row + i) * p->out + column;
        if (p->kind == SUMS) {
            memcpy((int32_t *)p->y + at, (const int32_t *)sums + i * COLUMNS, COLUMNS * 4);
            continue;
        }
        const float *add = p->add ? p->add + (size_t)(row + i) * p->add_stride + column : NULL;
        for (int j = 0; j < COLUMNS; j += 16) {
            __m512 value;
            if (p->kind == W8A8) {
                __m512i whole = _mm512_loadu_si512((const int32_t *)sums + i * COLUMNS + j);
                value = _mm512_mul_round_ps(_mm512_cvtepi32_ps(whole),
                                            _mm512_set1_ps(row_scales[i]), EXACT);
                value = _mm512_mul_round_ps(value, _mm512_loadu_ps(p->scales + column + j), EXACT);
            } else {
                value = _mm512_loadu_ps((const float *)sums + i * COLUMNS + j);
            }
            if (add) value = _mm512_add_round_ps(value, _mm512_loadu_ps(add + j), EXACT);
            _mm512_storeu_ps((float *)p->y + at + j, value);
        }
    }
}

/* Rows [0, count) of float32 `x` as int8 `q` [count][padded] (zeros past `in`) and their
 * scales (see the top of the file; the division and the rounding are torch's, bit for bit). */
static void quantize_rows(const float *x, int64_t stride, int count, int in, int padded, int8_t *q,
                          float *scales) {
    for (int i = 0; i < count; i++) {
        const float *row = x + (size_t)i * stride;
        int8_t *out = q + (size_t)i * padded;
        __m512 largest = _mm512_setzero_ps();
        for (int k = 0; k < in; k += 16) {
            __mmask16 mask = in - k >= 16 ? 0xffff : (__mmask16)((1u << (in - k)) - 1);
            largest = _mm512_max_ps(largest, _mm512_abs_ps(_mm512_maskz_loadu_ps(mask, row + k)));
        }
        float scale = _mm512_reduce_max_ps(largest) / 127.0f;
        scales[i] = scale;
        memset(out, 0, padded);
        if (scale == 0.0f) continue;
        __m512 divisor = _mm512_set1_ps(scale);
        __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127);
        for (int k = 0; k < in; k += 16) {
            __mmask16 mask = in - k >= 16 ? 0xffff : (__mmask16)((1u << (in - k)) - 1);
            __m512 ratio = _mm512_div_ps(_mm512_maskz_loadu_ps(mask, row + k), divisor);
            __m512i value = _mm512_cvtps_epi32(ratio); /* rounds half to even (MXCSR's default) */
            value = _mm512_min_epi32(_mm512_max_epi32(value, low), high);
            _mm512_mask_cvtepi32_storeu_epi8(out + k, mask, value);
        }
    }
}

#endif

#if BF16_VECTOR

/* Rows [0, count) of float32 `x` rounded to bfloat16 (to nearest even) into `a`
 * [count][padded], zeros past `in`. */
static void bf16_rows(const float *x, int64_t stride, int count, int in, int padded, uint16_t *a) {
    for (int i = 0; i < count; i++) {
        const float *row = x + (size_t)i * stride;
        for (int k = 0; k < padded; k += 32) {
            int left = in - k < 0 ? 0 : in - k;
            __mmask16 low = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            int upper = left > 16 ? left - 16 : 0;
            __mmask16 high = upper >= 16 ? 0xffff : (__mmask16)((1u << upper) - 1);
            __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(high, row + k + 16),
                                                 _mm512_maskz_loadu_ps(low, row + k));
            _mm512_storeu_si512(a + (size_t)i * padded + k, (__m512i)pairs);
        }
    }
}

/* Panels [panel, panel + count) (32 columns each) of a packed bf16 weight as pairs of inputs:
 * `b` [count][padded / 2][32][2] (inputs past `in` zero), each pair of packed rows interleaved
 * in registers; the weight is read in its memory order (a group of rows, then its tiles). */
static void pair_panels(const uint16_t *weight, int in, int out, int panel, int count,
                        int padded, uint16_t *b) {
    /* lanes 2c and 2c + 1 of a pair row: column c of the first and of the second row */
    static const uint16_t order[2][32] = {
        {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
         8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
        {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
         24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63},
    };
    __m512i first = _mm512_loadu_si512(order[0]), second = _mm512_loadu_si512(order[1]);
    size_t tiles = out / COLUMNS, panel_elements = (size_t)padded * COLUMNS;
    for (int k = 0; k < padded; k += 2) {
        for (int q = 0; q < count; q++) {
            uint16_t *pair = b + q * panel_elements + (size_t)k * COLUMNS;
            if (k >= in) { /* in is whole groups of 8: a pair is all inside or all past it */
                memset(pair, 0, 2 * COLUMNS * sizeof *pair);
                continue;
            }
            const uint16_t *row =
                weight + ((size_t)(k / PACK_ROWS) * tiles + panel + q) * PACK_ROWS * COLUMNS +
                (k % PACK_ROWS) * COLUMNS;
            __m512i top = _mm512_loadu_si512(row), bottom = _mm512_loadu_si512(row + COLUMNS);
            _mm512_storeu_si512(pair, _mm512_permutex2var_epi16(top, first, bottom));
            _mm512_storeu_si512(pair + COLUMNS, _mm512_permutex2var_epi16(top, second, bottom));
        }
    }
}

/* `c` [32][32] = a [32][padded] @ the pair panel `b`, by `vdpbf16ps`, eight rows at a time. */
static void vector_bf16_block(const uint16_t *a, int padded, const uint16_t *b, float *c) {
    for (int m = 0; m < BLOCK_ROWS; m += 8) {
        __m512 acc[8][2];
        for (int i = 0; i < 8; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        for (int k = 0; k < padded; k += 2) {
            __m512bh left = (__m512bh)_mm512_loadu_si512(b + (size_t)k * COLUMNS);
            __m512bh right = (__m512bh)_mm512_loadu_si512(b + (size_t)k * COLUMNS + COLUMNS);
            for (int i = 0; i < 8; i++) {
                int32_t pair;
                memcpy(&pair, a + (size_t)(m + i) * padded + k, sizeof pair);
                __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x, left);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x, right);
            }
        }
        for (int i = 0; i < 8; i++) {
            _mm512_storeu_ps(c + (m + i) * COLUMNS, acc[i][0]);
            _mm512_storeu_ps(c + (m + i) * COLUMNS + 16, acc[i][1]);
        }
    }
}

#endif

#if I8_VECTOR

/* `c` [32][32] = the exact int32 sums of a [32][padded] int8 @ quad panel `panel` [in / 4][32][4]
 * by `vpdpbusd`, which multiplies unsigned by signed bytes: x + 128 (its sign bit flipped)
 * times w, less 128 times each column's sum of w. |sums| <= 255 * 127 * in < 2^31 (in is at
 * most `QUAD_MAX_IN`). */
static void vector_i8_block(const int8_t *a, int padded, const int8_t *panel, int in, int32_t *c) {
    __m512i column_sums[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    __m512i ones = _mm512_set1_epi8(1), flip = _mm512_set1_epi32((int32_t)0x80808080u);
    for (int k = 0; k < in; k += QUAD) {
        const int8_t *quad = panel + (size_t)k * COLUMNS;
        column_sums[0] = _mm512_dpbusd_epi32(column_sums[0], ones, _mm512_loadu_si512(quad));
        column_sums[1] = _mm512_dpbusd_epi32(column_sums[1], ones, _mm512_loadu_si512(quad + 64));
    }
    __m512i offset[2] = {_mm512_slli_epi32(column_sums[0], 7),
                         _mm512_slli_epi32(column_sums[1], 7)};
    for (int m = 0; m < BLOCK_ROWS; m += 8) {
        __m512i acc[8][2];
        for (int i = 0; i < 8; i++) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
        for (int k = 0; k < in; k += QUAD) {
            const int8_t *quad = panel + (size_t)k * COLUMNS;
            __m512i left = _mm512_loadu_si512(quad), right = _mm512_loadu_si512(quad + 64);
            for (int i = 0; i < 8; i++) {
                int32_t four;
                memcpy(&four, a + (size_t)(m + i) * padded + k, sizeof four);
                __m512i x = _mm512_xor_si512(_mm512_set1_epi32(four), flip);
                acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], x, left);
                acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], x, right);
            }
        }
        for (int i = 0; i < 8; i++) {
            _mm512_storeu_si512(c + (m + i) * COLUMNS, _mm512_sub_epi32(acc[i][0], offset[0]));
            _mm512_storeu_si512(c + (m + i) * COLUMNS + 16, _mm512_sub_epi32(acc[i][1], offset[1]));
        }
    }
}

#endif

#if BF16_TILES || I8_TILES

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

/* Tiles 0-3: a block's four 16 x 16 sums; 4-5: its two 16-row slices of x; 6-7: two 16-column
 * slices of the panel. Every tile is 16 rows of 64 bytes. */
static void configure_tiles(void) {
    TileConfig config = {.palette = 1};
    for (int t = 0; t < 8; t++) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

/* Each of a block's four 16 x 16 sums (tiles 0-3) by `product` of its slices of x and panel. */
#define BLOCK_PRODUCTS(product)                                                                   \
    do {                                                                                          \
        product(0, 4, 6);                                                                         \
        product(1, 4, 7);                                                                         \
        product(2, 5, 6);                                                                         \
        product(3, 5, 7);                                                                         \
    } while (0)

/* `c` [32][32] = the sums of a block `a` [32][row_bytes] (bf16 or int8 inputs) @ a laid-out
 * panel `b`, by tiles: each step takes 64 bytes of each row (`tdpbf16ps`: 32 inputs;
 * `tdpbssd`: 64, exact int32 sums) and the panel's 16 pair or quad rows for them, two 16-column
 * slices at its 128-byte stride. A step past the first `whole` bytes of a row (int8 inputs
 * short of a whole step) reads its panel rows from `tail` (those quads, then zeros) instead. */
static void tiles_block(int integer, const char *a, size_t row_bytes, const char *b,
                        size_t whole, const char *tail, void *c) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (size_t k = 0; k < row_bytes; k += 64) {
        const char *rows = k + 64 <= whole ? b + k * COLUMNS : tail; /* 4 bytes of a : 128 of b */
        _tile_loadd(4, a + k, row_bytes);
        _tile_loadd(5, a + 16 * row_bytes + k, row_bytes);
        _tile_loadd(6, rows, 4 * COLUMNS);
        _tile_loadd(7, rows + 64, 4 * COLUMNS);
#if I8_TILES
        if (integer) BLOCK_PRODUCTS(_tile_dpbssd);
#endif
#if BF16_TILES
        if (!integer) BLOCK_PRODUCTS(_tile_dpbf16ps);
#endif
    }
    _tile_stored(0, c, COLUMNS * 4);
    _tile_stored(1, (char *)c + 64, COLUMNS * 4);
    _tile_stored(2, (char *)c + 16 * COLUMNS * 4, COLUMNS * 4);
    _tile_stored(3, (char *)c + 16 * COLUMNS * 4 + 64, COLUMNS * 4);
}

#endif

#if BF16_VECTOR || I8_VECTOR || I8_TILES

/* A thread's buffers: a chunk of its rows as the dot products read them (`padded` inputs of
 * `element` bytes each, zeros past `in`), their scales (W8A8), and a group of panels laid out
 * (BF16: `pairs`; W8A8 by tiles: each panel's `tails`, see `tiles_i8_block`). */
typedef struct {
    char *rows;
    uint16_t *pairs;
    int8_t *tails;
    float *row_scales;
    int padded, element, chunk, group;
} Work;

static Work work_for(const Product *p, int num_rows) {
    Work w = {0};
    int integer = p->kind != BF16;
    w.padded = round_up(p->in, integer ? 64 : 32);
    w.element = integer ? 1 : 2;
    size_t row_bytes = (size_t)w.padded * w.element;
    w.chunk = CHUNK_BYTES / row_bytes / BLOCK_ROWS * BLOCK_ROWS;
    if (w.chunk < MIN_CHUNK_ROWS) w.chunk = MIN_CHUNK_ROWS;
    if (w.chunk > round_up(num_rows, BLOCK_ROWS)) w.chunk = round_up(num_rows, BLOCK_ROWS);
    w.group = GROUP_BYTES / (row_bytes * COLUMNS);
    if (w.group < 1) w.group = 1;
    w.rows = aligned_alloc(64, (size_t)w.chunk * row_bytes);
    w.row_scales = malloc(w.chunk * sizeof *w.row_scales);
    if (!integer) w.pairs = aligned_alloc(64, (size_t)w.group * w.padded * COLUMNS * 2);
    if (integer) w.tails = aligned_alloc(64, (size_t)w.group * 16 * QUAD * COLUMNS);
    return w;
}

static void free_work(Work *w) {
    free(w->rows);
    free(w->row_scales);
    free(w->pairs);
    free(w->tails);
}

/* Rows [first, first + count) of `p`'s x into `w->rows` (and the rows up to the next whole
 * block zero). */
static void load_rows(const Product *p, const Work *w, int first, int count) {
    size_t row_bytes = (size_t)w->padded * w->element;
    memset(w->rows + count * row_bytes, 0, (round_up(count, BLOCK_ROWS) - count) * row_bytes);
    if (p->kind == SUMS) {
        for (int i = 0; i < count; i++) {
            const int8_t *values = (const int8_t *)p->x + (first + i) * p->x_stride;
            memcpy(w->rows + i * row_bytes, values, p->in);
            memset(w->rows + i * row_bytes + p->in, 0, w->padded - p->in);
        }
        return;
    }
    const float *x = (const float *)p->x + first * p->x_stride;
    if (p->kind == W8A8)
        quantize_rows(x, p->x_stride, count, p->in, w->padded, (int8_t *)w->rows, w->row_scales);
#if BF16_VECTOR
    else
        bf16_rows(x, p->x_stride, count, p->in, w->padded, (uint16_t *)w->rows);
#endif
}

/* Panels [panel, panel + count) laid out for the dot products (see `Work`). */
static void lay_out_panels(const Product *p, const Work *w, int panel, int count) {
#if BF16_VECTOR
    if (p->kind == BF16) pair_panels(p->weight, p->in, p->out, panel, count, w->padded, w->pairs);
#endif
    for (int q = 0; q < count; q++) {
        if (p->kind != BF16 && p->isa == TILES && p->in % 64) {
            size_t whole = (size_t)p->in / 64 * 64, tail_bytes = 16 * QUAD * COLUMNS;
            const int8_t *quads = (const int8_t *)p->weight + (size_t)(panel + q) * p->in * COLUMNS;
            memset(w->tails + q * tail_bytes, 0, tail_bytes);
            memcpy(w->tails + q * tail_bytes, quads + whole * COLUMNS, (p->in - whole) * COLUMNS);
        }
    }
}

/* `sums` [32][32] of the block of rows at `x` and panel `panel`, the `q`th of its group. */
static void block_product(const Product *p, const Work *w, const char *x, int panel, int q,
                          void *sums) {
    if (p->kind != BF16) {
        const int8_t *quads = (const int8_t *)p->weight + (size_t)panel * p->in * COLUMNS;
#if BF16_TILES || I8_TILES
        if (p->isa == TILES)
            tiles_block(1, x, w->padded, (const char *)quads, p->in,
                        (const char *)w->tails + (size_t)q * 16 * QUAD * COLUMNS, sums);
#endif
#if I8_VECTOR
        if (p->isa == VECTOR) vector_i8_block((const int8_t *)x, w->padded, quads, p->in, sums);
#endif
        return;
    }
#if BF16_VECTOR
    const uint16_t *pairs = w->pairs + (size_t)q * w->padded * COLUMNS;
#if BF16_TILES
    size_t row_bytes = (size_t)w->padded * 2;
    if (p->isa == TILES)
        tiles_block(0, x, row_bytes, (const char *)pairs, row_bytes, NULL, sums);
#endif
    if (p->isa == VECTOR) vector_bf16_block((const uint16_t *)x, w->padded, pairs, sums);
#endif
}

#endif

/* One thread's share: rows [row_begin, row_end) of panels [panel_begin, panel_end), a chunk of
 * rows at a time, and within it a group of panels at a time (laid out once per chunk), each
 * block of the chunk's rows through every panel of the group. */
static void run_share(const Product *p, int row_begin, int row_end, int panel_begin,
                      int panel_end) {
#if BF16_VECTOR || I8_VECTOR || I8_TILES
    Work w = work_for(p, row_end - row_begin);
    union {
        float floats[BLOCK_ROWS * COLUMNS];
        int32_t ints[BLOCK_ROWS * COLUMNS];
    } sums __attribute__((aligned(64)));
#if BF16_TILES || I8_TILES
    if (p->isa == TILES) configure_tiles();
#endif
    for (int first = row_begin; first < row_end; first += w.chunk) {
        int count = row_end - first < w.chunk ? row_end - first : w.chunk;
        load_rows(p, &w, first, count);
        for (int group = panel_begin; group < panel_end; group += w.group) {
            int panels = panel_end - group < w.group ? panel_end - group : w.group;
            lay_out_panels(p, &w, group, panels);
            for (int block = 0; block < count; block += BLOCK_ROWS) {
                const char *x = w.rows + (size_t)block * w.padded * w.element;
                int rows = count - block < BLOCK_ROWS ? count - block : BLOCK_ROWS;
                for (int q = 0; q < panels; q++) {
                    block_product(p, &w, x, group + q, q, &sums);
                    store_block(p, &sums, w.row_scales + block, first + block, rows, group + q);
                }
            }
        }
    }
#if BF16_TILES || I8_TILES
    if (p->isa == TILES) _tile_release();
#endif
    free_work(&w);
#else
    (void)p, (void)row_begin, (void)row_end, (void)panel_begin, (void)panel_end;
#endif
}

/* Whether this build and process can run `kind` by `isa` (see `gemm_isas`). */
static int runs(int kind, int isa) {
    int bit = (kind == BF16 ? 0 : 2) + (isa == TILES);
    return (isa == VECTOR || isa == TILES) && (gemm_isas() >> bit & 1);
}

/* Runs `p` on `threads` threads: each whole blocks of rows where there are at least two per
 * thread (each thread then lays out every panel once per chunk), else whole panels (each
 * thread converts every row). 0, or 1 when the product cannot run here or its shape is not
 * one it reads. */
static int run(const Product *p, int threads) {
    int quantized = p->kind != BF16;
    if (!runs(p->kind, p->isa) || p->rows < 1 || p->out % COLUMNS ||
        p->in % (quantized ? QUAD : PACK_ROWS) || p->in < 1 || p->in > 65536)
        return 1;
    int blocks = round_up(p->rows, BLOCK_ROWS) / BLOCK_ROWS, panels = p->out / COLUMNS;
#pragma omp parallel num_threads(threads)
    {
        int parts = omp_get_num_threads(), index = omp_get_thread_num(), begin, end;
        if (blocks >= 2 * parts) {
            share(blocks, parts, index, &begin, &end);
            int last = end * BLOCK_ROWS < p->rows ? end * BLOCK_ROWS : p->rows;
            if (begin < end) run_share(p, begin * BLOCK_ROWS, last, 0, panels);
        } else {
            share(panels, parts, index, &begin, &end);
            if (begin < end) run_share(p, 0, p->rows, begin, end);
        }
    }
    return 0;
}

/* y [rows, out] (float32) = x [rows, in] (float32, rows `x_stride` apart) @ `weight` (packed
 * bf16) in bf16 products with float32 sums, plus `add` (NULL; a bias [out] with `add_stride`
 * 0; or rows `add_stride` apart). 0, or 1 (see `run`). */
int gemm_bf16(const void *weight, int in, int out, const float *x, int64_t x_stride, int rows,
              const float *add, int64_t add_stride, float *y, int isa, int threads) {
    Product p = {weight, NULL, in, out, x, x_stride, rows, add, add_stride, y, isa, BF16};
    return run(&p, threads);
}

/* y [rows, out] (float32) = x quantized per row @ `weight` (int8 quad panels, `scales` [out]),
 * in exact integer sums times both scales, plus `add` (as `gemm_bf16`). 0, or 1. */
int gemm_w8a8(const void *weight, const float *scales, int in, int out, const float *x,
              int64_t x_stride, int rows, const float *add, int64_t add_stride, float *y, int isa,
              int threads) {
    Product p = {weight, scales, in, out, x, x_stride, rows, add, add_stride, y, isa, W8A8};
    return run(&p, threads);
}

/* sums [rows, out] (int32) = int8 `values` [rows, in] (rows `stride` apart) @ `weight` (int8
 * quad panels), exactly: W8A8's integer sums alone. 0, or 1. */
int int8_sums(const void *weight, int in, int out, const int8_t *values, int64_t stride, int rows,
              int32_t *sums, int isa, int threads) {
    Product p = {weight, NULL, in, out, values, stride, rows, NULL, 0, sums, isa, SUMS};
    return run(&p, threads);
}
