/* Decode steps of a Qwen2 or Gemma 3 decoder stack on CPU, in one OpenMP parallel region.
 *
 * A step of a few single-token rows is bound by reading the weights, but run op by op it also
 * pays a fixed cost per op (dispatch, allocation, waking the thread pool) about forty times per
 * layer, and the first ops after the weights have streamed through the caches run cold. Here
 * the threads stay in one parallel region from the token ids to the final norm and meet at
 * barriers between phases:
 *
 *   embedding rows (times a scale), rotary tables (angle j from position row section[j])
 *   per layer: RMSNorm -> qkv = x @ Wqkv (+ b) -> per-head RMSNorm of q, k (optional)
 *     -> rotary(q, k), k/v into the paged cache -> attention (optional sliding window, soft
 *     cap) -> x += [RMSNorm](attn @ Wo) -> RMSNorm -> gate|up = x @ Wgu
 *     -> act(gate) * up (SiLU or tanh GELU) -> x += [RMSNorm](act @ Wdown)
 *   final RMSNorm
 *
 * Qwen2 has the bias, no q/k norms and no norms on the two residual branches; Gemma 3 has the
 * norms (their scales stored as 1 + weight already), GELU, local layers with a window and its
 * own rotary table per layer type. RMSNorm is x / sqrt(mean(x^2) + eps) * scale.
 *
 * A weight `[in, out]` is read either as a contiguous [in, out] (each thread streams its own
 * contiguous band of input rows into a private partial sum; the partials are then added by
 * column) or as a contiguous [out, in] (each thread owns a band of output rows: dot products).
 * Rotation is rotate_half's: x * cos + (x[d + D/2], the first half negated) * sin. The KV cache
 * is [2, num_blocks, block_size, num_kv_heads, head_dim]; row r is the single new token of
 * request r, at position seq_lens[r] - 1, and attends to the keys before it (within the window).
 * Everything is float32.
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define MAX_BLOCK 256
#define MAX_TABLES 2

typedef struct {
    const float *input_norm;     /* [hidden] */
    const float *qkv_weight;     /* [hidden, qkv_width] or its [out, in] transpose */
    const float *qkv_bias;       /* [qkv_width] or NULL */
    const float *qk_norm;        /* [heads + kv_heads, head_dim] or NULL */
    const float *o_weight;       /* [heads * head_dim, hidden] */
    const float *attention_out_norm; /* [hidden] or NULL: the attention branch added as is */
    const float *mlp_norm;       /* [hidden] */
    const float *gate_up_weight; /* [hidden, 2 * intermediate]: gate columns, then up */
    const float *down_weight;    /* [intermediate, hidden] */
    const float *mlp_out_norm;   /* [hidden] or NULL */
    float *kv_cache;             /* [2, num_blocks, block_size, kv_heads, head_dim] */
    int32_t qkv_out_in, o_out_in, gate_up_out_in, down_out_in; /* 1: stored [out, in] */
    int32_t window;              /* keys within this many positions, 0: all */
    int32_t table;               /* which rotary table */
} Layer;

typedef struct {
    const float *embedding;      /* [vocab, hidden] with the strides below (a tied head's view) */
    const float *final_norm;     /* [hidden] */
    const float *inv_freq[MAX_TABLES]; /* [head_dim / 2] each */
    const int32_t *section;      /* [head_dim / 2]: the position row of each rotary frequency */
    int64_t embedding_row_stride, embedding_column_stride;
    float embedding_scale;
    float soft_cap;              /* attention scores: cap * tanh(score / cap); 0: none */
    int32_t num_tables;
    int32_t gelu;                /* 1: tanh GELU, 0: SiLU */
} Model;

typedef struct {
    int32_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int32_t num_blocks, block_size, block_table_stride;
    int64_t positions_stride; /* elements between the position rows (t, h, w) */
    float eps, scale;
} Shape;

/* Rows [begin, end) of `count` split evenly over `parts`: part `index`'s share. */
static void share(int count, int parts, int index, int *begin, int *end) {
    int base = count / parts, extra = count % parts;
    *begin = index * base + (index < extra ? index : extra);
    *end = *begin + base + (index < extra ? 1 : 0);
}

static void rms_norm(const float *x, const float *weight, float *out, int n, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < n; i++) sum += x[i] * x[i];
    float inv = 1.0f / sqrtf(sum / (float)n + eps);
#pragma omp simd
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * weight[i];
}

/* partial[r][c] = sum over input rows i in [i0, i1) of x[r][i] * w[i][c], w contiguous
 * [in, out]: the thread streams its band of w once for all rows, four input rows at a time, in
 * column tiles small enough that the four rows' tile stays in L1 while every row uses it. */
#define TILE 512
static void band_product(const float *x, size_t stride, int rows, const float *w, int out,
                         int i0, int i1, float *partial) {
    for (int r = 0; r < rows; r++) memset(partial + (size_t)r * out, 0, sizeof(float) * out);
    int i = i0;
    for (; i + 4 <= i1; i += 4) {
        for (int c0 = 0; c0 < out; c0 += TILE) {
            int c1 = c0 + TILE < out ? c0 + TILE : out;
            const float *w0 = w + (size_t)i * out, *w1 = w0 + out, *w2 = w1 + out;
            const float *w3 = w2 + out;
            for (int r = 0; r < rows; r++) {
                const float *xr = x + r * stride + i;
                float x0 = xr[0], x1 = xr[1], x2 = xr[2], x3 = xr[3];
                float *acc = partial + (size_t)r * out;
#pragma omp simd
                for (int c = c0; c < c1; c++)
                    acc[c] += x0 * w0[c] + x1 * w1[c] + x2 * w2[c] + x3 * w3[c];
            }
        }
    }
    for (; i < i1; i++) {
        const float *w0 = w + (size_t)i * out;
        for (int r = 0; r < rows; r++) {
            float x0 = x[r * stride + i];
            float *acc = partial + (size_t)r * out;
#pragma omp simd
            for (int c = 0; c < out; c++) acc[c] += x0 * w0[c];
        }
    }
}

typedef float vec8 __attribute__((vector_size(32)));

static inline vec8 load8(const float *p) {
    vec8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum8(vec8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

typedef int32_t ivec8 __attribute__((vector_size(32)));
#define SPLAT(c) ((vec8){c, c, c, c, c, c, c, c})

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

/* y[r][c] = dot(w[c], x[r]) (+ add[r][c]) for output rows c in [c0, c1), w contiguous [out, in].
 * Whole blocks of 4 rows run 2 output rows x 4 rows of 8-float accumulators along `in`
 * together, so each loaded vector of w feeds 4 rows and each of x feeds 2 outputs; the rows
 * and the output row left over take plain dot products. */
static void row_products(const float *x, size_t stride, int rows, int in, const float *w,
                         int out, int c0, int c1, const float *add, float *y) {
    int blocked_rows = rows - rows % 4, pairs_end = c0 + (c1 - c0) / 2 * 2, whole = in - in % 8;
    if (blocked_rows)
        for (int c = c0; c < pairs_end; c += 2)
            for (int r0 = 0; r0 < blocked_rows; r0 += 4) {
                const float *w0 = w + (size_t)c * in, *w1 = w0 + in, *x0 = x + r0 * stride;
                vec8 acc[2][4] = {{{0}}};
                for (int i = 0; i < whole; i += 8) {
                    vec8 u = load8(w0 + i), v = load8(w1 + i);
                    for (int k = 0; k < 4; k++) {
                        vec8 xv = load8(x0 + k * stride + i);
                        acc[0][k] += u * xv, acc[1][k] += v * xv;
                    }
                }
                for (int k = 0; k < 4; k++)
                    for (int j = 0; j < 2; j++) {
                        const float *wj = j ? w1 : w0, *xk = x0 + k * stride;
                        float sum = hsum8(acc[j][k]);
                        for (int i = whole; i < in; i++) sum += wj[i] * xk[i];
                        size_t at = (size_t)(r0 + k) * out + c + j;
                        y[at] = add ? add[at] + sum : sum;
                    }
            }
    for (int c = c0; c < c1; c++) {
        const float *wc = w + (size_t)c * in;
        for (int r = c < pairs_end ? blocked_rows : 0; r < rows; r++) {
            const float *xr = x + r * stride;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < in; i++) sum += wc[i] * xr[i];
            y[(size_t)r * out + c] = add ? add[(size_t)r * out + c] + sum : sum;
        }
    }
}

/* y = x @ w (+ add), x [rows, in] with rows `stride` apart, y [rows, out], w in either layout.
 * Every thread of the region calls it; it ends with a barrier. `partials` holds
 * threads * rows * out floats. */
static void linear(const float *x, size_t stride, int rows, int in, const float *w, int out_in,
                   int out, const float *add, float *y, float *partials) {
    int thread = omp_get_thread_num(), threads = omp_get_num_threads(), begin, end;
    if (out_in) {
        share(out, threads, thread, &begin, &end);
        row_products(x, stride, rows, in, w, out, begin, end, add, y);
#pragma omp barrier
        return;
    }
    share(in, threads, thread, &begin, &end);
    size_t size = (size_t)rows * out;
    band_product(x, stride, rows, w, out, begin, end, partials + (size_t)thread * size);
#pragma omp barrier
    share(out, threads, thread, &begin, &end);
    for (int r = 0; r < rows; r++) {
        for (int c = begin; c < end; c++) {
            size_t at = (size_t)r * out + c;
            float sum = add ? add[at] : 0.0f;
            for (int t = 0; t < threads; t++) sum += partials[(size_t)t * size + at];
            y[at] = sum;
        }
    }
#pragma omp barrier
}

/* x [head_dim] rotated in place: x * cos + rotate_half(x) * signed sin. */
static void rotate(float *x, const float *cos, const float *sin, int dim) {
    float rotated[dim];
    int half = dim / 2;
    for (int d = 0; d < dim; d++) rotated[d] = x[d] * cos[d] + x[(d + half) % dim] * sin[d];
    memcpy(x, rotated, sizeof(float) * dim);
}

/* The `group` query heads `q` [group, head_dim] that share one KV head, over the request's
 * paged keys [first, last): each key and value is read once for the whole group. Online
 * softmax block by block; `part` gets, per query head, its running max, its sum of
 * exponentials and its unnormalised output [head_dim] (max -inf and sum 0 for no keys). */
static void attend_group(const float *q, int group, const float *keys, const float *values,
                         const int32_t *block_table, int first, int last, int kv_head,
                         float soft_cap, const Shape *s, float *part) {
    int dim = s->head_dim, bs = s->block_size;
    size_t slot_stride = (size_t)s->num_kv_heads * dim;
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
            const float *k = keys + base + j * slot_stride;
            for (int g = 0; g < group; g++) {
                const float *qg = q + (size_t)g * dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < dim; d++) dot += qg[d] * k[d];
                float score = dot * s->scale;
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
        const float *block_values = values + base;
        for (int g = 0; g < group; g++)
            for (int d = 0; d + 8 <= dim; d += 8) {
                vec8 sum = load8(acc[g] + d);
                for (int j = skip; j < count; j++)
                    sum += scores[g][j] * load8(block_values + j * slot_stride + d);
                memcpy(acc[g] + d, &sum, sizeof sum);
            }
        for (int g = 0; g < group; g++) /* dims past the last whole vector */
            for (int d = dim - dim % 8; d < dim; d++)
                for (int j = skip; j < count; j++)
                    acc[g][d] += scores[g][j] * block_values[j * slot_stride + d];
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

/* hidden[r] += RMSNorm(branch[r]) * scale, or += branch[r] without a scale, for this
 * thread's rows. */
static void add_branch(float *hidden, float *branch, const float *scale, int rows, int H,
                       float eps, int thread, int threads) {
    int begin, end;
    share(rows, threads, thread, &begin, &end);
    for (int r = begin; r < end; r++) {
        float *x = branch + (size_t)r * H, *y = hidden + (size_t)r * H;
        if (scale) rms_norm(x, scale, x, H, eps);
        for (int i = 0; i < H; i++) y[i] += x[i];
    }
}

static float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

/* `out` [rows, hidden]: the final-normed hidden states of the rows' tokens `ids` at
 * `positions` [position rows, rows]. scratch: rows * (3 * hidden + 2 * tables * head_dim
 * + qkv_width + heads * head_dim + 2 * intermediate + heads * threads * (head_dim + 2))
 * floats, then threads * rows * max(qkv_width, hidden, 2 * intermediate) for partial sums. */
int decode_step(const Model *model, const Layer *layers, int num_layers, const Shape *s,
                int rows, int num_threads, const int64_t *ids, const int64_t *positions,
                const int32_t *block_tables, const int32_t *seq_lens,
                const int64_t *slot_mapping, float *scratch, float *out) {
    if (s->block_size > MAX_BLOCK || s->head_dim % 2) return 1;
    if (model->num_tables < 1 || model->num_tables > MAX_TABLES) return 2;
    int H = s->hidden, D = s->head_dim, Hq = s->num_heads, Hkv = s->num_kv_heads;
    int I = s->intermediate, qkv_width = (Hq + 2 * Hkv) * D, group = Hq / Hkv;
    int tables = model->num_tables;
    float *hidden = scratch;
    float *normed = hidden + (size_t)rows * H;
    float *branch = normed + (size_t)rows * H;
    float *cos = branch + (size_t)rows * H; /* [tables, rows, D] */
    float *sin = cos + (size_t)tables * rows * D;
    float *qkv = sin + (size_t)tables * rows * D;
    float *attn = qkv + (size_t)rows * qkv_width;
    float *gate_up = attn + (size_t)rows * Hq * D;
    float *parts = gate_up + (size_t)rows * 2 * I; /* rows * heads * splits * (D + 2) */
    /* key slices per (row, KV head): enough units to keep every thread busy */
    int splits = (num_threads + rows * Hkv - 1) / (rows * Hkv);
    float *partials = parts + (size_t)rows * Hq * splits * (D + 2);
    size_t cache_half = (size_t)s->num_blocks * s->block_size * Hkv * D;

#pragma omp parallel num_threads(num_threads)
    {
        int thread = omp_get_thread_num(), threads = omp_get_num_threads(), begin, end;
        share(rows, threads, thread, &begin, &end);
        for (int r = begin; r < end; r++) {
            const float *row = model->embedding + ids[r] * model->embedding_row_stride;
            for (int i = 0; i < H; i++)
                hidden[(size_t)r * H + i] =
                    row[i * model->embedding_column_stride] * model->embedding_scale;
            for (int t = 0; t < tables; t++) {
                float *c_row = cos + ((size_t)t * rows + r) * D;
                float *s_row = sin + ((size_t)t * rows + r) * D;
                for (int j = 0; j < D / 2; j++) {
                    float angle = (float)positions[model->section[j] * s->positions_stride + r] *
                                  model->inv_freq[t][j];
                    float c = cosf(angle), n = sinf(angle);
                    c_row[j] = c_row[j + D / 2] = c;
                    s_row[j] = -n;
                    s_row[j + D / 2] = n;
                }
            }
        }
#pragma omp barrier
        for (int l = 0; l < num_layers; l++) {
            const Layer *layer = layers + l;
            float *keys = layer->kv_cache, *values = layer->kv_cache + cache_half;
            const float *layer_cos = cos + (size_t)layer->table * rows * D;
            const float *layer_sin = sin + (size_t)layer->table * rows * D;

            share(rows, threads, thread, &begin, &end);
            for (int r = begin; r < end; r++)
                rms_norm(hidden + (size_t)r * H, layer->input_norm, normed + (size_t)r * H, H,
                         s->eps);
#pragma omp barrier
            linear(normed, H, rows, H, layer->qkv_weight, layer->qkv_out_in, qkv_width,
                   NULL, qkv, partials);
            /* bias, q/k norms, rotary of q and k heads, k and v into their slots */
            share(rows * (Hq + Hkv), threads, thread, &begin, &end);
            for (int unit = begin; unit < end; unit++) {
                int r = unit / (Hq + Hkv), head = unit % (Hq + Hkv);
                float *row = qkv + (size_t)r * qkv_width;
                float *x = row + (size_t)head * D;
                if (layer->qkv_bias)
                    for (int d = 0; d < D; d++) x[d] += layer->qkv_bias[(size_t)head * D + d];
                if (layer->qk_norm) rms_norm(x, layer->qk_norm + (size_t)head * D, x, D, s->eps);
                rotate(x, layer_cos + (size_t)r * D, layer_sin + (size_t)r * D, D);
                if (head >= Hq) {
                    int kv_head = head - Hq;
                    float *v = row + (size_t)(Hq + Hkv + kv_head) * D;
                    if (layer->qkv_bias)
                        for (int d = 0; d < D; d++)
                            v[d] += layer->qkv_bias[(size_t)(Hq + Hkv + kv_head) * D + d];
                    size_t at = ((size_t)slot_mapping[r] * Hkv + kv_head) * D;
                    memcpy(keys + at, x, sizeof(float) * D);
                    memcpy(values + at, v, sizeof(float) * D);
                }
            }
#pragma omp barrier
            /* attention: one unit per (row, KV head, slice of its keys); then the slices of
             * each query head are merged */
            share(rows * Hkv * splits, threads, thread, &begin, &end);
            for (int unit = begin; unit < end; unit++) {
                int r = unit / (Hkv * splits), kv_head = unit / splits % Hkv;
                int slice = unit % splits, seq_len = seq_lens[r];
                int first = layer->window > 0 && seq_len > layer->window
                                ? seq_len - layer->window : 0;
                int length = seq_len - first;
                attend_group(qkv + (size_t)r * qkv_width + (size_t)kv_head * group * D, group,
                             keys, values, block_tables + (size_t)r * s->block_table_stride,
                             first + (int)((int64_t)length * slice / splits),
                             first + (int)((int64_t)length * (slice + 1) / splits), kv_head,
                             model->soft_cap, s, parts + (size_t)unit * group * (D + 2));
            }
#pragma omp barrier
            share(rows * Hq, threads, thread, &begin, &end);
            for (int unit = begin; unit < end; unit++) {
                int r = unit / Hq, head = unit % Hq, kv_head = head / group, g = head % group;
                const float *first_part =
                    parts + ((size_t)(r * Hkv + kv_head) * splits * group + g) * (D + 2);
                merge_parts(first_part, splits, (size_t)group * (D + 2), D,
                            attn + ((size_t)r * Hq + head) * D);
            }
#pragma omp barrier
            if (layer->attention_out_norm) {
                linear(attn, (size_t)Hq * D, rows, Hq * D, layer->o_weight, layer->o_out_in, H,
                       NULL, branch, partials);
                add_branch(hidden, branch, layer->attention_out_norm, rows, H, s->eps, thread,
                           threads);
            } else {
                linear(attn, (size_t)Hq * D, rows, Hq * D, layer->o_weight, layer->o_out_in, H,
                       hidden, hidden, partials);
            }
            share(rows, threads, thread, &begin, &end);
            for (int r = begin; r < end; r++)
                rms_norm(hidden + (size_t)r * H, layer->mlp_norm, normed + (size_t)r * H, H,
                         s->eps);
#pragma omp barrier
            linear(normed, H, rows, H, layer->gate_up_weight, layer->gate_up_out_in, 2 * I, NULL,
                   gate_up, partials);
            /* act(gate) * up into the gate half of each row */
            share(rows * I, threads, thread, &begin, &end);
            for (int unit = begin; unit < end; unit++) {
                float *row = gate_up + (size_t)(unit / I) * 2 * I;
                int c = unit % I;
                float g = row[c];
                row[c] = (model->gelu ? gelu_tanh(g) : g / (1.0f + expf(-g))) * row[I + c];
            }
#pragma omp barrier
            if (layer->mlp_out_norm) {
                linear(gate_up, (size_t)2 * I, rows, I, layer->down_weight, layer->down_out_in, H,
                       NULL, branch, partials);
                add_branch(hidden, branch, layer->mlp_out_norm, rows, H, s->eps, thread, threads);
            } else {
                linear(gate_up, (size_t)2 * I, rows, I, layer->down_weight, layer->down_out_in, H,
                       hidden, hidden, partials);
            }
#pragma omp barrier
        }
        share(rows, threads, thread, &begin, &end);
        for (int r = begin; r < end; r++)
            rms_norm(hidden + (size_t)r * H, model->final_norm, out + (size_t)r * H, H, s->eps);
    }
    return 0;
}
