/* The dense decoder's block kinds: attention over the paged KV cache and the gated MLP; each
 * has the five functions of a row of `KINDS` in `decode.c`. */

#pragma once

#include "step.h"

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
