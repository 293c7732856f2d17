/* What every block kind of the decode step shares: the model, the step and its scratch
 * (`Context`), and the norms, activations and residual projection the kinds call. */

#pragma once

#include "linear.h"

#define MAX_BLOCK 256
#define MAX_TABLES 2

enum kind {
    ATTENTION = 1,
    GATED_MLP = 2,
    MLP = 3,
    MOE = 4,
    MAMBA2 = 5,
    SOFTMAX_MOE = 6,
    GATED_DELTA = 7,
};
enum activation { NO_ACTIVATION = 0, SILU = 1, GELU_TANH = 2, RELU2 = 3 };

typedef struct {
    int32_t kind;
    const float *norm;           /* [hidden]: the block's input norm */
    const float *out_norm;       /* [hidden] or NULL: the block's output added as is */
    const void *params;          /* the kind's struct: Attention, GatedMlp, ... */
} Block;

/* The token embedding [vocab, hidden] in `format`, with the strides below (a tied head's view);
 * row `id` of an I8 table is times scales[id] (a tied head's output column `id`). */
typedef struct {
    const void *data;
    const float *scales;         /* [vocab] or NULL */
    int64_t row_stride, column_stride;
    int32_t format;
    float scale;                 /* every row times this */
    int32_t panels;              /* 1: a tied head's panels [vocab / 32][hidden][32], rows of
                                  * 32 ids `row_stride` apart, id % 32 the element in a row;
                                  * 2: int8 quad panels [vocab / 32][hidden / 4][32][4] */
} Embedding;

typedef struct {
    Embedding embedding;
    const float *final_norm;     /* [hidden] */
    const float *inv_freq[MAX_TABLES]; /* [rotary_dim / 2] each */
    const int32_t *section;      /* [rotary_dim / 2]: the position row of each rotary frequency */
    int32_t hidden, num_tables, rotary_dim;
    float eps;
    const Matrix *head;          /* [hidden, vocab] or NULL: the step's logits, see `decode_step` */
} Model;

typedef struct {
    int32_t rows, threads;
    const int64_t *ids;          /* [rows] */
    const int64_t *positions;    /* [position rows, rows], rows `positions_stride` apart */
    int64_t positions_stride;
    const int32_t *block_tables; /* [rows, block_table_stride] */
    int32_t block_table_stride;
    const int32_t *seq_lens;     /* [rows] */
    const int64_t *slot_mapping; /* [rows] */
    void *const *kv_caches;      /* [num_kv_caches], each in `kv_format` */
    int32_t num_kv_caches, cache_blocks, block_size;
    int32_t kv_format;           /* F32 or BF16 */
    /* recurrent blocks: block state s's tensors are states[2 s] and states[2 s + 1], each
     * [state_slots, ...] float32; row r reads and writes slot state_rows[r], from zeros
     * where fresh[r]; prompt[r]: the row's token is a prompt token */
    float *const *states;
    int32_t num_states, state_slots;
    const int32_t *state_rows;
    const uint8_t *fresh, *prompt;
} Step;

/* What every block of one step shares: the step, the model and the scratch regions. */
typedef struct {
    const Model *model;
    const Step *step;
    float *hidden, *normed, *branch; /* [rows, hidden] each */
    float *cos, *sin;            /* [tables, rows, rotary_dim] each */
    float *work;                 /* the running block's own buffers (`KindOps.work_floats`) */
    float *partials;             /* [threads, rows, widest output] */
} Context;

static void rms_norm(const float *x, const float *weight, float *out, int n, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < n; i++) sum += x[i] * x[i];
    float inv = 1.0f / sqrtf(sum / (float)n + eps);
#pragma omp simd
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * weight[i];
}

/* e^x in eight lanes (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n;
 * within 2 ulp of expf). Lanes below -87.3 (e^x < 2^-126) give 2^-126-ish, not 0: callers
 * here only read lanes whose exponent is a score minus its running max. */
static inline vec8 exp8(vec8 x) {
    const vec8 low = SPLAT(-87.3365447f), high = SPLAT(88.3762626f);
    ivec8 below = x < low, above = x > high;
    x = (vec8)((below & (ivec8)low) | (~below & (ivec8)x));
    x = (vec8)((above & (ivec8)high) | (~above & (ivec8)x));
    vec8 n = x * 1.44269504088896341f + 12582912.0f; /* round to nearest by the 1.5 * 2^23 trick */
    n = n - 12582912.0f;
    x = x - n * 0.693359375f - n * -2.12194440e-4f;
    vec8 y = x * 1.9875691500e-4f + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * x * x + x + 1.0f;
    ivec8 bits = (__builtin_convertvector(n, ivec8) + 127) << 23;
    return y * (vec8)bits;
}

/* hidden += [RMSNorm](x @ w (+ bias)): a block's output projection and its residual add.
 * Without an out norm or a bias the add rides along in the product; otherwise each thread adds
 * the rows it then also normalises first in the next block (or the final norm), so no barrier
 * is needed. */
static void residual_projection(const Context *c, const float *x, size_t stride,
                                const Matrix *w, const float *out_norm, const float *bias) {
    int rows = c->step->rows, H = c->model->hidden, begin, end;
    if (!out_norm && !bias) {
        linear(x, stride, rows, w, c->hidden, c->hidden, c->partials);
        return;
    }
    linear(x, stride, rows, w, NULL, c->branch, c->partials);
    share(rows, omp_get_num_threads(), omp_get_thread_num(), &begin, &end);
    for (int r = begin; r < end; r++) {
        float *branch = c->branch + (size_t)r * H, *hidden = c->hidden + (size_t)r * H;
        if (bias)
            for (int i = 0; i < H; i++) branch[i] += bias[i];
        if (out_norm) rms_norm(branch, out_norm, branch, H, c->model->eps);
        for (int i = 0; i < H; i++) hidden[i] += branch[i];
    }
}

static float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

static float activate(int activation, float x) {
    switch (activation) {
    case SILU: return x / (1.0f + expf(-x));
    case GELU_TANH: return gelu_tanh(x);
    case RELU2: return x > 0.0f ? x * x : 0.0f;
    default: return x;
    }
}

static int larger(int a, int b) { return a > b ? a : b; }
