/* Decode steps of a decoder stack on CPU, in one OpenMP parallel region.
 *
 * A step of a few single-token rows is bound by reading the weights, but run op by op it also
 * pays a fixed cost per op (dispatch, allocation, waking the thread pool) about forty times per
 * layer, and the first ops after the weights have streamed through the caches run cold. Here
 * the threads stay in one parallel region from the token ids to the final norm and meet at
 * barriers between phases.
 *
 * The model is a stack of residual blocks, each of a kind (`enum kind`):
 *
 *   embedding rows (times a scale), rotary tables (angle j from position row section[j])
 *   per block: x = RMSNorm(hidden) -> y = kind(x) -> hidden += [RMSNorm](y)
 *   final RMSNorm
 *
 *   ATTENTION  qkv = x @ Wqkv (+ b) -> per-head RMSNorm of q, k (optional) -> rotary(q, k)
 *              (optional), k/v into the block's paged cache -> attention (optional sliding
 *              window and soft cap) -> (gated: each head times sigmoid of its gate columns)
 *              -> y = attn @ Wo
 *   GATED_MLP  gate|up = x @ Wgu -> y = (act(gate) * up) @ Wdown, act SiLU or tanh GELU
 *   MLP, MOE, MAMBA2  see `cpu_hybrid_kinds.h`: relu² MLP, mixture of experts (only the
 *              experts a row routes to are read), Mamba2's one-token state update
 *   SOFTMAX_MOE  see `cpu_moe_kinds.h`: softmax-routed gated experts in place of an MLP
 *   GATED_DELTA  see `cpu_gated_delta.h`: a Gated DeltaNet's one-token delta-rule update
 *
 * The kernel reads only the description: which kind each block is, its weights and options.
 * A new kind is a struct beside `Attention`, its functions beside `attention`'s (check,
 * fits, work, widest output, run) and one row of `KINDS`. A weight is a `Matrix` in its
 * stored format, multiplied by through `linear` (`cpu_linear.h`, where every format is read); a
 * new storage format is a case there. RMSNorm is x / sqrt(mean(x^2) + eps) * scale.
 *
 * Rotation is rotate_half's: x * cos + (x[d + D/2], the first half negated) * sin. A KV cache
 * is [2, num_blocks, block_size, num_kv_heads, head_dim] in F32 or BF16 (`Step.kv_format`: new
 * keys and values are rounded to it, read back widened); row r is the single new token of
 * request r, at position seq_lens[r] - 1, and attends to the keys before it (within the window).
 * Recurrent blocks read and write their state rows in place (`Step.states`).
 * Activations and sums are float32; so are norms, biases and rotary tables.
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_linear.h"

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
    Matrix qkv;                  /* [hidden, (heads + 2 kv_heads) * head_dim]: q, k, v columns */
    Matrix o;                    /* [heads * head_dim, hidden] */
    const float *qkv_bias;       /* [qkv width] or NULL */
    const float *qk_norm;        /* [heads + kv_heads, head_dim] or NULL */
    int32_t num_heads, num_kv_heads, head_dim;
    int32_t window;              /* keys within this many positions, 0: all */
    int32_t table;               /* which rotary table; -1: no rotary */
    int32_t cache;               /* which of the step's KV caches */
    float scale;                 /* multiplies scores */
    float soft_cap;              /* scores: cap * tanh(score / cap); 0: none */
    int32_t gated;               /* 1: qkv has heads * head_dim gate columns after v, and each
                                  * head's output is times sigmoid(its gate) */
} Attention;

typedef struct {
    Matrix gate_up;              /* [hidden, 2 * intermediate]: gate columns, then up */
    Matrix down;                 /* [intermediate, hidden] */
    int32_t activation;
} GatedMlp;

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

/* x [head_dim] rotated in place: x * cos + rotate_half(x) * signed sin. */
static void rotate(float *x, const float *cos, const float *sin, int dim) {
    float rotated[dim];
    int half = dim / 2;
    for (int d = 0; d < dim; d++) rotated[d] = x[d] * cos[d] + x[(d + half) % dim] * sin[d];
    memcpy(x, rotated, sizeof(float) * dim);
}

/* The `group` query heads `q` [group, head_dim] that share KV head `kv_head`, over the
 * request's paged keys [first, last): each key and value is read once for the whole group.
 * Online softmax block by block; `part` gets, per query head, its running max, its sum of
 * exponentials and its unnormalised output [head_dim] (max -inf and sum 0 for no keys). */
static void attend_group(const float *q, int group, const void *keys, const void *values,
                         int format, const int32_t *block_table, int first, int last,
                         int kv_head, const Attention *a, int bs, float *part) {
    int dim = a->head_dim;
    float scale = a->scale, soft_cap = a->soft_cap;
    size_t slot_stride = (size_t)a->num_kv_heads * dim;
    if (first >= last) { /* an empty slice */
        for (int g = 0; g < group; g++) {
            float *out = part + (size_t)g * (dim + 2);
            out[0] = -INFINITY, out[1] = 0.0f;
        }
        return;
    }
    int width = (bs + 7) / 8 * 8; /* a block's scores, whole vectors */
    float scores[group][width], acc[group][dim], running_max[group], total[group];
    memset(scores, 0, sizeof scores); /* lanes never scored stay finite */
    for (int g = 0; g < group; g++) {
        running_max[g] = -INFINITY, total[g] = 0.0f;
        memset(acc[g], 0, sizeof(float) * dim);
    }
    for (int start = first - first % bs; start < last; start += bs) {
        int skip = first > start ? first - start : 0;
        int count = last - start < bs ? last - start : bs;
        size_t base = ((size_t)block_table[start / bs] * bs) * slot_stride + (size_t)kv_head * dim;
        for (int j = skip; j < count; j++) {
            float k[dim]; /* the key widened once for the group's heads */
            widen_row(format, keys, base + j * slot_stride, dim, k);
            for (int g = 0; g < group; g++) {
                const float *qg = q + (size_t)g * dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < dim; d++) dot += qg[d] * k[d];
                float score = dot * scale;
                scores[g][j] = soft_cap > 0.0f ? soft_cap * tanhf(score / soft_cap) : score;
            }
        }
        for (int g = 0; g < group; g++) {
            float block_max = -INFINITY;
            for (int j = skip; j < count; j++)
                block_max = scores[g][j] > block_max ? scores[g][j] : block_max;
            float new_max = block_max > running_max[g] ? block_max : running_max[g];
            float rescale = expf(running_max[g] - new_max);
            total[g] *= rescale;
            for (int d = 0; d < dim; d++) acc[g][d] *= rescale;
            running_max[g] = new_max;
            for (int j = 0; j < width; j += 8) { /* lanes outside [skip, count) are not read */
                vec8 p = exp8(load8(scores[g] + j) - new_max);
                memcpy(scores[g] + j, &p, sizeof p);
            }
            for (int j = skip; j < count; j++) total[g] += scores[g][j];
        }
        /* acc[g] += p[g][j] * v[j]: eight dims of one query head in a register at a time, the
         * block's values (in L1 after the first head) streamed past them */
        for (int g = 0; g < group; g++)
            for (int d = 0; d + 8 <= dim; d += 8) {
                vec8 sum = load8(acc[g] + d);
                for (int j = skip; j < count; j++)
                    sum += scores[g][j] * widen8(format, values, base + j * slot_stride + d);
                memcpy(acc[g] + d, &sum, sizeof sum);
            }
        for (int g = 0; g < group; g++) /* dims past the last whole vector */
            for (int d = dim - dim % 8; d < dim; d++)
                for (int j = skip; j < count; j++)
                    acc[g][d] += scores[g][j] * widen1(format, values, base + j * slot_stride + d);
    }
    for (int g = 0; g < group; g++) {
        float *out = part + (size_t)g * (dim + 2);
        out[0] = running_max[g], out[1] = total[g];
        memcpy(out + 2, acc[g], sizeof(float) * dim);
    }
}

/* One query head's output [head_dim] from the `splits` parts of its key range, each `stride`
 * floats apart (see `attend_group`). */
static void merge_parts(const float *part, int splits, size_t stride, int dim, float *out) {
    float top = -INFINITY, total = 0.0f;
    for (int k = 0; k < splits; k++)
        if (part[k * stride + 1] > 0.0f && part[k * stride] > top) top = part[k * stride];
    for (int d = 0; d < dim; d++) out[d] = 0.0f;
    for (int k = 0; k < splits; k++) {
        const float *p = part + k * stride;
        if (p[1] <= 0.0f) continue;
        float weight = expf(p[0] - top);
        total += p[1] * weight;
        for (int d = 0; d < dim; d++) out[d] += p[2 + d] * weight;
    }
    for (int d = 0; d < dim; d++) out[d] /= total;
}

/* Key slices per (row, KV head): enough units to keep every thread busy. */
static int key_splits(const Step *step, int num_kv_heads) {
    int units = step->rows * num_kv_heads;
    return (step->threads + units - 1) / units;
}

static int qkv_width(const Attention *a) {
    return (a->num_heads + 2 * a->num_kv_heads) * a->head_dim;
}

/* A row of the qkv product: q, k, v, then a gated block's gate columns. */
static int qkv_stride(const Attention *a) {
    return qkv_width(a) + (a->gated ? a->num_heads * a->head_dim : 0);
}

/* Attention's work: qkv [rows, qkv width], attn [rows, heads * head_dim], then the key slices'
 * parts [rows, heads, splits, head_dim + 2]. */
static size_t attention_floats(const void *params, const Step *step) {
    const Attention *a = params;
    size_t rows = step->rows, D = a->head_dim, Hq = a->num_heads;
    return rows * qkv_stride(a) + rows * Hq * D +
           rows * Hq * key_splits(step, a->num_kv_heads) * (D + 2);
}

/* q, k, v of every row after bias, q/k norms and rotary; k and v into their slots. */
/* `n` floats of `x` into element `at` of a KV cache in `format`. */
static void store_kv(int format, void *cache, size_t at, const float *x, int n) {
    if (format == BF16)
        for (int d = 0; d < n; d++) ((uint16_t *)cache)[at + d] = bfloat16_bits(x[d]);
    else
        memcpy((float *)cache + at, x, sizeof(float) * n);
}

static void attention_inputs(const Context *c, const Attention *a, float *qkv, void *keys,
                             void *values) {
    const Step *step = c->step;
    int rows = step->rows, D = a->head_dim, Hq = a->num_heads, Hkv = a->num_kv_heads;
    int width = qkv_stride(a), begin, end;
    int table = a->table > 0 ? a->table : 0; /* -1: no rotary, no table read */
    const float *cos = c->cos + (size_t)table * rows * D;
    const float *sin = c->sin + (size_t)table * rows * D;
    share(rows * (Hq + Hkv), omp_get_num_threads(), omp_get_thread_num(), &begin, &end);
    for (int unit = begin; unit < end; unit++) {
        int r = unit / (Hq + Hkv), head = unit % (Hq + Hkv);
        float *row = qkv + (size_t)r * width;
        float *x = row + (size_t)head * D;
        if (a->qkv_bias)
            for (int d = 0; d < D; d++) x[d] += a->qkv_bias[(size_t)head * D + d];
        if (a->qk_norm) rms_norm(x, a->qk_norm + (size_t)head * D, x, D, c->model->eps);
        if (a->table >= 0) rotate(x, cos + (size_t)r * D, sin + (size_t)r * D, D);
        if (head >= Hq) {
            int kv_head = head - Hq;
            float *v = row + (size_t)(Hq + Hkv + kv_head) * D;
            if (a->qkv_bias)
                for (int d = 0; d < D; d++)
                    v[d] += a->qkv_bias[(size_t)(Hq + Hkv + kv_head) * D + d];
            size_t at = ((size_t)step->slot_mapping[r] * Hkv + kv_head) * D;
            store_kv(step->kv_format, keys, at, x, D);
            store_kv(step->kv_format, values, at, v, D);
        }
    }
    region_barrier();
}

static void attention(const Context *c, const void *params, const float *out_norm) {
    const Attention *a = params;
    const Step *step = c->step;
    int rows = step->rows, D = a->head_dim, Hq = a->num_heads, Hkv = a->num_kv_heads;
    int group = Hq / Hkv, width = qkv_stride(a), splits = key_splits(step, Hkv);
    int thread = omp_get_thread_num(), threads = omp_get_num_threads(), begin, end;
    float *qkv = c->work, *attn = qkv + (size_t)rows * width;
    float *parts = attn + (size_t)rows * Hq * D;
    void *keys = step->kv_caches[a->cache];
    size_t half = (size_t)step->cache_blocks * step->block_size * Hkv * D; /* elements */
    void *values = (char *)keys + half * (step->kv_format == BF16 ? 2 : 4);

    linear(c->normed, c->model->hidden, rows, &a->qkv, NULL, qkv, c->partials);
    attention_inputs(c, a, qkv, keys, values);
    /* one unit per (row, KV head, slice of its keys); then the slices of each query head are
     * merged */
    share(rows * Hkv * splits, threads, thread, &begin, &end);
    for (int unit = begin; unit < end; unit++) {
        int r = unit / (Hkv * splits), kv_head = unit / splits % Hkv;
        int slice = unit % splits, seq_len = step->seq_lens[r];
        int first = a->window > 0 && seq_len > a->window ? seq_len - a->window : 0;
        int length = seq_len - first;
        attend_group(qkv + (size_t)r * width + (size_t)kv_head * group * D, group, keys, values,
                     step->kv_format, step->block_tables + (size_t)r * step->block_table_stride,
                     first + (int)((int64_t)length * slice / splits),
                     first + (int)((int64_t)length * (slice + 1) / splits), kv_head, a,
                     step->block_size, parts + (size_t)unit * group * (D + 2));
    }
    region_barrier();
    share(rows * Hq, threads, thread, &begin, &end);
    for (int unit = begin; unit < end; unit++) {
        int r = unit / Hq, head = unit % Hq, kv_head = head / group, g = head % group;
        const float *first_part =
            parts + ((size_t)(r * Hkv + kv_head) * splits * group + g) * (D + 2);
        float *out = attn + ((size_t)r * Hq + head) * D;
        merge_parts(first_part, splits, (size_t)group * (D + 2), D, out);
        if (a->gated) {
            const float *gate = qkv + (size_t)r * width + qkv_width(a) + (size_t)head * D;
            for (int d = 0; d < D; d++) out[d] /= 1.0f + expf(-gate[d]);
        }
    }
    region_barrier();
    residual_projection(c, attn, (size_t)Hq * D, &a->o, out_norm, NULL);
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

/* Gated MLP's work: gate|up [rows, 2 * intermediate]. */
static size_t gated_mlp_floats(const void *params, const Step *step) {
    return (size_t)step->rows * ((const GatedMlp *)params)->gate_up.out;
}

/* act(gate) * up into the gate half of each of `rows` rows `gate_up` [rows, 2 * I] (gate
 * columns, then up), this thread's share of them, then a barrier. */
static void gate_rows(float *gate_up, int rows, int I, int activation) {
    int begin, end;
    share(rows * I, omp_get_num_threads(), omp_get_thread_num(), &begin, &end);
    for (int unit = begin; unit < end; unit++) {
        float *row = gate_up + (size_t)(unit / I) * 2 * I;
        int col = unit % I;
        row[col] = activate(activation, row[col]) * row[I + col];
    }
    region_barrier();
}

static void gated_mlp(const Context *c, const void *params, const float *out_norm) {
    const GatedMlp *m = params;
    int rows = c->step->rows, I = m->down.in;
    float *gate_up = c->work;
    linear(c->normed, c->model->hidden, rows, &m->gate_up, NULL, gate_up, c->partials);
    gate_rows(gate_up, rows, I, m->activation);
    residual_projection(c, gate_up, (size_t)2 * I, &m->down, out_norm, NULL);
}

static int larger(int a, int b) { return a > b ? a : b; }

/* The widest output of the block's products (their partial sums share one buffer). */
static int attention_widest(const void *params) {
    const Attention *a = params;
    return larger(a->qkv.out, a->o.out);
}

static int gated_mlp_widest(const void *params) {
    const GatedMlp *m = params;
    return larger(m->gate_up.out, m->down.out);
}

/* 0 when the kernel can run the block's params in `model` (fields in range, weights' shapes
 * consistent), else a status that names what is wrong. */
static int attention_check(const Model *model, const void *params) {
    const Attention *a = params;
    int H = model->hidden, D = a->head_dim;
    if (a->num_kv_heads < 1 || a->num_heads % a->num_kv_heads) return 11;
    int rotates = a->table >= 0;
    if (a->table < -1 || (rotates && (D != model->rotary_dim || a->table >= model->num_tables)))
        return 12;
    if (!check_matrix(&a->qkv, H, qkv_stride(a))) return 13;
    if (!check_matrix(&a->o, a->num_heads * D, H)) return 14;
    return a->window < 0 || a->cache < 0 ? 15 : 0;
}

static int gated_mlp_check(const Model *model, const void *params) {
    const GatedMlp *m = params;
    int H = model->hidden, I = m->down.in;
    if (m->activation != SILU && m->activation != GELU_TANH) return 20;
    return check_matrix(&m->gate_up, H, 2 * I) && check_matrix(&m->down, I, H) ? 0 : 21;
}

/* Whether the step holds what the block reads and writes besides its weights. */
static int attention_fits(const void *params, const Step *step) {
    return ((const Attention *)params)->cache < step->num_kv_caches;
}

static int gated_mlp_fits(const void *params, const Step *step) {
    (void)params, (void)step;
    return 1;
}

#include "cpu_hybrid_kinds.h"
#include "cpu_moe_kinds.h"
#include "cpu_gated_delta.h"

/* What the kernel does with a block of each kind: every kind is one row here. */
typedef struct {
    int (*check)(const Model *model, const void *params);
    int (*fits)(const void *params, const Step *step);
    size_t (*work_floats)(const void *params, const Step *step); /* its own buffers */
    int (*widest_output)(const void *params);
    void (*run)(const Context *c, const void *params, const float *out_norm);
} KindOps;

static const KindOps KINDS[] = {
    [ATTENTION] = {attention_check, attention_fits, attention_floats, attention_widest, attention},
    [GATED_MLP] = {gated_mlp_check, gated_mlp_fits, gated_mlp_floats, gated_mlp_widest, gated_mlp},
    [MLP] = {mlp_check, gated_mlp_fits, mlp_floats, mlp_widest, mlp},
    [MOE] = {moe_check, gated_mlp_fits, moe_floats, moe_widest, moe},
    [MAMBA2] = {mamba2_check, mamba2_fits, mamba2_floats, mamba2_widest, mamba2},
    [SOFTMAX_MOE] = {softmax_moe_check, gated_mlp_fits, softmax_moe_floats, softmax_moe_widest,
                     softmax_moe},
    [GATED_DELTA] = {gated_delta_check, gated_delta_fits, gated_delta_floats, gated_delta_widest,
                     gated_delta},
};

static const KindOps *kind_ops(int kind) {
    int known = kind > 0 && kind < (int)(sizeof KINDS / sizeof KINDS[0]) && KINDS[kind].run;
    return known ? KINDS + kind : NULL;
}

/* Whether `product` sums `matrix` through per-thread partial sums (threads * rows * out
 * floats): not panels, quads or a vocabulary-wide row-major matrix split by columns. */
static int product_partials(const Matrix *matrix) {
    return matrix->packed < PANELS && (matrix->out_in || matrix->out < SPLIT_COLUMNS_FROM);
}

/* One product of a whole x (read by every thread of the region) by any matrix `linear` reads:
 * a vocabulary-wide row-major one split by columns, others as `linear` splits them. */
static void product(const float *x, size_t stride, int rows, const Matrix *matrix,
                    const float *add, float *y, float *partials) {
    if (matrix->packed < PANELS && !product_partials(matrix))
        linear_by_columns(x, stride, rows, matrix, add, y);
    else
        linear(x, stride, rows, matrix, add, y, partials);
}

/* 0 when `decode_step` can run these blocks, else a status naming what is wrong: 1-4 the
 * model's own fields, 9 a kind this kernel does not know, 10 a block's missing norm or params,
 * from 11 on the kind's own `check`. */
int check_model(const Model *model, const Block *blocks, int num_blocks) {
    if (model->rotary_dim % 2 || model->rotary_dim < 0) return 1;
    if (model->num_tables < 0 || model->num_tables > MAX_TABLES) return 2;
    const Embedding *table = &model->embedding;
    if (table->format < F32 || table->format > I8 || (table->format == I8) != !!table->scales)
        return 3;
    if (model->head && !check_matrix(model->head, model->hidden, model->head->out)) return 4;
    for (int b = 0; b < num_blocks; b++) {
        const Block *block = blocks + b;
        const KindOps *ops = kind_ops(block->kind);
        if (!ops) return 9;
        if (!block->norm || !block->params) return 10;
        int status = ops->check(model, block->params);
        if (status) return status;
    }
    return 0;
}

static size_t fixed_floats(const Model *model, int rows) {
    return (size_t)rows * (3 * model->hidden + 2 * model->num_tables * model->rotary_dim);
}

/* The work of the block that needs the most: blocks run one after another and share it. */
static size_t largest_work(const Block *blocks, int num_blocks, const Step *step) {
    size_t work = 0;
    for (int b = 0; b < num_blocks; b++) {
        size_t floats = KINDS[blocks[b].kind].work_floats(blocks[b].params, step);
        work = floats > work ? floats : work;
    }
    return work;
}

/* Floats of scratch `decode_step` needs for `step`'s rows and threads: the shared rows, the
 * largest block's work, then the partial sums of the widest product. */
int64_t scratch_floats(const Model *model, const Block *blocks, int num_blocks,
                       const Step *step) {
    const Matrix *head = model->head;
    size_t widest = head && product_partials(head) ? (size_t)head->out : 0;
    widest = widest > (size_t)model->hidden ? widest : (size_t)model->hidden;
    for (int b = 0; b < num_blocks; b++) {
        size_t width = KINDS[blocks[b].kind].widest_output(blocks[b].params);
        widest = width > widest ? width : widest;
    }
    return fixed_floats(model, step->rows) + largest_work(blocks, num_blocks, step) +
           (size_t)step->threads * step->rows * widest;
}

/* Embedding rows times their scale, and every rotary table's cos and signed sin, for this
 * thread's rows. */
static void embed_rows(const Context *c) {
    const Model *model = c->model;
    const Step *step = c->step;
    int rows = step->rows, H = model->hidden, D = model->rotary_dim, begin, end;
    share(rows, omp_get_num_threads(), omp_get_thread_num(), &begin, &end);
    const Embedding *table = &model->embedding;
    for (int r = begin; r < end; r++) {
        int64_t id = step->ids[r];
        float scale = table->scale * (table->scales ? table->scales[id] : 1.0f);
        int64_t start = id * table->row_stride;
        if (table->panels) /* id's column of its panel (four bytes per quad row in quads) */
            start = id / PANEL_COLUMNS * table->row_stride +
                    id % PANEL_COLUMNS * (table->panels == 2 ? QUAD_ROWS : 1);
        for (int i = 0; i < H; i++) {
            int64_t at = table->panels == 2
                             ? start + i / QUAD_ROWS * table->column_stride + i % QUAD_ROWS
                             : start + i * table->column_stride;
            c->hidden[(size_t)r * H + i] = widen1(table->format, table->data, at) * scale;
        }
        for (int t = 0; t < model->num_tables; t++) {
            float *c_row = c->cos + ((size_t)t * rows + r) * D;
            float *s_row = c->sin + ((size_t)t * rows + r) * D;
            for (int j = 0; j < D / 2; j++) {
                float angle =
                    (float)step->positions[model->section[j] * step->positions_stride + r] *
                    model->inv_freq[t][j];
                float cos = cosf(angle), sin = sinf(angle);
                c_row[j] = c_row[j + D / 2] = cos;
                s_row[j] = -sin;
                s_row[j + D / 2] = sin;
            }
        }
    }
}

/* y [rows, out] = x [rows, in] @ matrix (+ add [rows, out]), x's rows `stride` floats apart, on
 * `threads` threads: one product outside a decode step (an LM head, a product of the torch
 * path). `partials` holds threads * rows * out floats. 0, or 1 when the matrix is not one
 * `linear` reads. */
int matmul(const Matrix *matrix, const float *x, int64_t stride, int rows, const float *add,
           float *y, float *partials, int threads) {
    if (!check_matrix(matrix, matrix->in, matrix->out) || rows < 1) return 1;
    Barrier barrier = {0};
#pragma omp parallel num_threads(threads)
    {
        enter_region(&barrier);
        product(x, (size_t)stride, rows, matrix, add, y, partials);
        enter_region(NULL);
    }
    return 0;
}

/* `out` [rows, hidden]: the final-normed hidden states of the step's tokens through the blocks
 * (checked by `check_model`), with `scratch_floats` floats of `scratch`; and where `logits` is
 * not NULL (and the model has a head), `logits` [rows, vocab]: `out` through the head, in the
 * same threaded region. 0, or 1 when the step's caches do not match the blocks. */
int decode_step(const Model *model, const Block *blocks, int num_blocks, const Step *step,
                float *scratch, float *out, float *logits) {
    if (step->block_size > MAX_BLOCK || (step->kv_format != F32 && step->kv_format != BF16))
        return 1;
    for (int b = 0; b < num_blocks; b++)
        if (!KINDS[blocks[b].kind].fits(blocks[b].params, step)) return 1;
    int rows = step->rows, H = model->hidden;
    size_t row_floats = (size_t)rows * H;
    size_t table_floats = (size_t)model->num_tables * rows * model->rotary_dim;
    float *work = scratch + fixed_floats(model, rows);
    const Context c = {
        .model = model,
        .step = step,
        .hidden = scratch,
        .normed = scratch + row_floats,
        .branch = scratch + 2 * row_floats,
        .cos = scratch + 3 * row_floats,
        .sin = scratch + 3 * row_floats + table_floats,
        .work = work,
        .partials = work + largest_work(blocks, num_blocks, step),
    };

    Barrier barrier = {0};
#pragma omp parallel num_threads(step->threads)
    {
        int thread = omp_get_thread_num(), threads = omp_get_num_threads(), begin, end;
        enter_region(&barrier);
        embed_rows(&c);
        region_barrier();
        for (int b = 0; b < num_blocks; b++) {
            share(rows, threads, thread, &begin, &end);
            for (int r = begin; r < end; r++)
                rms_norm(c.hidden + (size_t)r * H, blocks[b].norm, c.normed + (size_t)r * H, H,
                         model->eps);
            region_barrier();
            KINDS[blocks[b].kind].run(&c, blocks[b].params, blocks[b].out_norm);
        }
        share(rows, threads, thread, &begin, &end);
        for (int r = begin; r < end; r++)
            rms_norm(c.hidden + (size_t)r * H, model->final_norm, out + (size_t)r * H, H,
                     model->eps);
        if (logits && model->head) {
            region_barrier(); /* the head reads every row */
            product(out, H, rows, model->head, NULL, logits, c.partials);
        }
        enter_region(NULL);
    }
    return 0;
}
