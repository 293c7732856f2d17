/* The block kinds of hybrid decoders in the native decode step: a plain MLP, a mixture of
 * experts and Mamba2's one-token update. It uses `step.h`'s `Context`, `rms_norm`, `activate`
 * and `residual_projection`; each kind has the five functions of a row of `KINDS` in
 * `decode.c`.
 *
 *   MLP     y = act(x @ Wup (+ b)) @ Wdown (+ b), act relu² (or SiLU, tanh GELU)
 *   MOE     scores = sigmoid(x @ Wrouter); the experts are chosen by scores + a correction bias
 *           (the best `kept_groups` of `num_groups` groups, each rated by its two best, stay
 *           eligible) and weighted by the unbiased scores (normalised to sum 1 when
 *           `normalize`), times `scaling`; y = sum of weight * expert(x') (x' = x, or x's
 *           latent projection, the sum projected back), + shared expert(x); the experts are
 *           MLPs without biases, with the shared expert's activation. Each expert is
 *           read once for the rows routed to it; experts no row chose are not read at all.
 *   MAMBA2  z | xBC | dt = x @ Win (+ b); xBC through the depthwise causal conv after the
 *           row's last K - 1 inputs (SiLU); dt = softplus(dt + dt_bias), floored at
 *           `time_step_min` for prompt tokens; state = state * exp(dt A) + dt B x per head;
 *           y = state . C + D x; RMSNorm of y * silu(z) per group; y @ Wout (+ b)
 *
 * A Mamba2 block's conv state [conv_dim, K - 1] and SSM state [heads, head_dim, state_size] of
 * row r are slot `state_rows[r]` of the step's state tensors, read and written in place; a
 * fresh row starts from zeros whatever its slot held. Every sum is float32, in the order
 * the torch path of these block kinds sums.
 *
 * Barriers are few: on a shared 2-core machine a barrier waits for a thread the OS may have
 * set aside, and these kinds are many small products. A thread that wrote columns [b, e) of a
 * product's output (`linear_columns`) reads just those columns as the input band of the next
 * product (`linear_band`, when that one has as many inputs and is stored [in, out]), so chains
 * of products with elementwise steps between them need no barrier but the product's own (the
 * next product's partial sums then go elsewhere: a thread may still read the last ones); an
 * MoE's expert products all share their phases; a Mamba2 row's groups (their heads, B, C and
 * norm slice) are one unit of work from the conv to the gated norm.
 */

#pragma once

#include "step.h"

typedef struct {
    Matrix up;                   /* [in, mid] */
    Matrix down;                 /* [mid, out] */
    const float *up_bias;        /* [mid] or NULL */
    const float *down_bias;      /* [out] or NULL */
    int32_t activation;
} Mlp;

typedef struct {
    Matrix router;               /* [hidden, experts] float32 */
    const float *correction_bias; /* [experts]: added to the scores that choose */
    const Matrix *experts_up;    /* [experts] matrices, each [in, mid] */
    const Matrix *experts_down;  /* [experts] matrices, each [mid, in] */
    Mlp shared;                  /* the shared expert, on the block's input; its activation
                                  * is every expert's */
    Matrix latent_in, latent_out; /* [hidden, latent], [latent, hidden]; no data: none */
    const float *latent_in_bias, *latent_out_bias; /* or NULL */
    int32_t num_experts, top_k, num_groups, kept_groups, normalize;
    float scaling;
} Moe;

typedef struct {
    Matrix in_proj;              /* [hidden, inner + conv_dim + heads]: z, x|B|C, dt columns */
    Matrix out_proj;             /* [inner, hidden] */
    const float *in_proj_bias, *out_proj_bias; /* or NULL */
    const float *conv_weight;    /* [conv_dim, kernel] */
    const float *conv_bias;      /* [conv_dim] or NULL */
    const float *dt_bias, *A, *D; /* [heads] each; A negative */
    const float *gate_norm;      /* [inner] */
    int32_t num_heads, head_dim, state_size, num_groups, kernel;
    int32_t state;               /* which of the step's recurrent states */
    float time_step_min;         /* dt's floor for prompt tokens */
} Mamba2;

/* A product of several run at once (`products_band`, `products_columns`). */
typedef struct {
    const float *x;              /* [rows, w.in], rows `stride` apart */
    size_t stride;
    int rows;
    const Matrix *w;
    float *y;                    /* [rows, w.out] */
    float *partials;             /* threads * rows * w.out floats of its own */
} Product;

/* The first half of every product (see `linear_band`), then a barrier. A product of quad
 * panels (`quad_product`) is made whole here, after a barrier of its own (it reads x whole,
 * and each thread may have written only its share of it). */
static void products_band(const Product *jobs, int count) {
    int quads = 0;
    for (int j = 0; j < count; j++) {
        if (jobs[j].w->packed == QUADS) quads = 1;
        else linear_band(jobs[j].x, jobs[j].stride, jobs[j].rows, jobs[j].w, jobs[j].partials);
    }
    if (quads) {
        region_barrier();
        for (int j = 0; j < count; j++)
            if (jobs[j].w->packed == QUADS)
                quad_product(jobs[j].x, jobs[j].stride, jobs[j].rows, jobs[j].w, NULL, jobs[j].y,
                             0);
    }
    region_barrier();
}

/* The second half of every product (see `linear_columns`): no barrier. */
static void products_columns(const Product *jobs, int count) {
    for (int j = 0; j < count; j++)
        if (jobs[j].w->packed != QUADS)
            linear_columns(jobs[j].x, jobs[j].stride, jobs[j].rows, jobs[j].w, NULL, jobs[j].y,
                           jobs[j].partials);
}

/* act(y + bias) over this thread's `linear_share` of y's columns [rows, width]. */
static void activate_columns(float *y, int rows, int width, const float *bias, int activation) {
    int begin, end;
    linear_share(width, &begin, &end);
    for (int r = 0; r < rows; r++)
        for (int col = begin; col < end; col++) {
            float *at = y + (size_t)r * width + col;
            *at = activate(activation, bias ? *at + bias[col] : *at);
        }
}

/* hidden += [RMSNorm](branch): after this thread added `branch` [rows, hidden] on its own
 * columns (no out norm, then a barrier), or after a barrier, row by row through the norm. */
static void add_branch(const Context *c, const float *out_norm) {
    int rows = c->step->rows, H = c->model->hidden, begin, end;
    if (!out_norm) {
        linear_share(H, &begin, &end);
        for (int r = 0; r < rows; r++)
            for (int i = begin; i < end; i++) c->hidden[(size_t)r * H + i] += c->branch[(size_t)r * H + i];
        region_barrier();
        return;
    }
    region_barrier();
    share(rows, omp_get_num_threads(), omp_get_thread_num(), &begin, &end);
    for (int r = begin; r < end; r++) {
        float *branch = c->branch + (size_t)r * H, *hidden = c->hidden + (size_t)r * H;
        rms_norm(branch, out_norm, branch, H, c->model->eps);
        for (int i = 0; i < H; i++) hidden[i] += branch[i];
    }
}

/* MLP's work: the hidden activations [rows, mid], then the down product's partial sums. */
static size_t mlp_floats(const void *params, const Step *step) {
    const Mlp *m = params;
    return (size_t)step->rows * (m->up.out + (size_t)step->threads * m->down.out);
}

static void mlp(const Context *c, const void *params, const float *out_norm) {
    const Mlp *m = params;
    int rows = c->step->rows, H = c->model->hidden, I = m->up.out, begin, end;
    Product up = {c->normed, H, rows, &m->up, c->work, c->partials};
    Product down = {c->work, I, rows, &m->down, c->branch, c->work + (size_t)rows * I};
    products_band(&up, 1);
    products_columns(&up, 1);
    activate_columns(c->work, rows, I, m->up_bias, m->activation);
    if (m->down.out_in) region_barrier(); /* an [out, in] weight reads every column */
    products_band(&down, 1);
    products_columns(&down, 1);
    if (m->down_bias) {
        linear_share(H, &begin, &end);
        for (int r = 0; r < rows; r++)
            for (int i = begin; i < end; i++) c->branch[(size_t)r * H + i] += m->down_bias[i];
    }
    add_branch(c, out_norm);
}

static int mlp_widest(const void *params) {
    const Mlp *m = params;
    return larger(m->up.out, m->down.out);
}

static int check_mlp(const Mlp *m, int in, int out) {
    int known = m->activation == SILU || m->activation == GELU_TANH || m->activation == RELU2;
    return known && check_matrix(&m->up, in, m->up.out) && check_matrix(&m->down, m->up.out, out);
}

static int mlp_check(const Model *model, const void *params) {
    return check_mlp(params, model->hidden, model->hidden) ? 0 : 30;
}

/* The routed experts' input width: the latent's, or the hidden size. */
static int moe_width(const Moe *m, int hidden) {
    return m->latent_in.data ? m->latent_in.out : hidden;
}

static int moe_mid(const Moe *m) { return m->experts_up[0].out; }

/* MoE's work, in this order: router scores [rows, experts], the latent input [rows, width],
 * per (row, expert) pair grouped by expert its input [width], hidden [mid] and output [width],
 * the shared expert's hidden [rows, shared mid] and output [rows, hidden], the routed sum
 * [rows, width] and its latent projection [rows, hidden], then the partial sums of the first
 * and of the second expert products (each phase's together). */
static size_t moe_floats(const void *params, const Step *step) {
    const Moe *m = params;
    size_t rows = step->rows, pairs = rows * m->top_k, H = m->shared.down.out;
    size_t W = moe_width(m, (int)H), M = moe_mid(m), S = m->shared.up.out;
    size_t partials = step->threads * (pairs * M + rows * S + pairs * W + rows * H);
    return rows * m->num_experts + rows * W + pairs * (2 * W + M) + rows * (S + H) +
           rows * (W + H) + partials;
}

/* The `k` experts of the largest `choice` [E] (ties to the lower id), largest first. */
static void top_experts(const float *choice, int E, int k, int32_t *ids) {
    uint8_t taken[E];
    memset(taken, 0, sizeof taken);
    for (int j = 0; j < k; j++) {
        int top = -1;
        for (int e = 0; e < E; e++)
            if (!taken[e] && (top < 0 || choice[e] > choice[top])) top = e;
        taken[top] = 1;
        ids[j] = top;
    }
}

/* A row's `top_k` experts (`ids`) and their weights, from its router output `logits`. */
static void route_row(const Moe *m, const float *logits, int32_t *ids, float *weights) {
    int E = m->num_experts, per_group = E / m->num_groups;
    float scores[E], choice[E];
    for (int e = 0; e < E; e++) {
        scores[e] = 1.0f / (1.0f + expf(-logits[e]));
        choice[e] = scores[e] + m->correction_bias[e];
    }
    if (m->num_groups > 1) { /* keep the best groups, rated by their two best choices */
        float rating[m->num_groups];
        for (int g = 0; g < m->num_groups; g++) {
            float best = -INFINITY, second = -INFINITY;
            for (int e = g * per_group; e < (g + 1) * per_group; e++) {
                if (choice[e] > best) second = best, best = choice[e];
                else if (choice[e] > second) second = choice[e];
            }
            rating[g] = best + second;
        }
        uint8_t kept[m->num_groups];
        memset(kept, 0, sizeof kept);
        for (int k = 0; k < m->kept_groups; k++) {
            int top = -1;
            for (int g = 0; g < m->num_groups; g++)
                if (!kept[g] && (top < 0 || rating[g] > rating[top])) top = g;
            kept[top] = 1;
        }
        for (int e = 0; e < E; e++)
            if (!kept[e / per_group]) choice[e] = -INFINITY;
    }
    top_experts(choice, E, m->top_k, ids);
    float total = 0.0f;
    for (int k = 0; k < m->top_k; k++) total += weights[k] = scores[ids[k]];
    for (int k = 0; k < m->top_k; k++)
        weights[k] = (m->normalize ? weights[k] / (total + 1e-20f) : weights[k]) * m->scaling;
}

/* Where each (row, expert) pair p = r * top_k + k goes when the pairs are grouped by expert
 * (ascending; pairs of one expert in order): `slot[p]`, and each expert's first slot
 * `start[e]` (`start[E]`: the pair count). */
static void group_pairs(const int32_t *ids, int pairs, int E, int *slot, int *start) {
    for (int e = 0; e <= E; e++) start[e] = 0;
    for (int p = 0; p < pairs; p++) start[ids[p] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    int next[E];
    memcpy(next, start, sizeof next);
    for (int p = 0; p < pairs; p++) slot[p] = next[ids[p]]++;
}

/* The products of one phase: each of the `num_experts` routed experts' (`weights` of every
 * expert; `x` and `y` grouped by expert, rows `x_stride` and `out` floats apart, `y` `out`
 * wide) and the `shared` expert's (NULL: none), their partial sums one after another in
 * `partials`; returns how many. */
static int expert_products(int num_experts, const Matrix *weights, const int *start,
                           const float *x, size_t x_stride, float *y, int out,
                           const Product *shared, float *partials, int threads, Product *jobs) {
    int count = 0;
    for (int e = 0; e < num_experts; e++) {
        int rows = start[e + 1] - start[e];
        if (!rows) continue; /* an expert no row chose is not read */
        jobs[count++] = (Product){x + (size_t)start[e] * x_stride, x_stride, rows, weights + e,
                                  y + (size_t)start[e] * out, partials};
        partials += (size_t)threads * rows * out;
    }
    if (shared) {
        jobs[count] = *shared;
        jobs[count++].partials = partials;
    }
    return count;
}

static void moe(const Context *c, const void *params, const float *out_norm) {
    const Moe *m = params;
    const Step *step = c->step;
    int rows = step->rows, H = c->model->hidden, E = m->num_experts, K = m->top_k;
    int pairs = rows * K, W = moe_width(m, H), M = moe_mid(m), S = m->shared.up.out;
    int threads = step->threads, begin, end;
    float *scores = c->work, *latent = scores + (size_t)rows * E;
    float *routed_in = latent + (size_t)rows * W, *routed_mid = routed_in + (size_t)pairs * W;
    float *routed_out = routed_mid + (size_t)pairs * M, *shared_mid = routed_out + (size_t)pairs * W;
    float *shared_out = shared_mid + (size_t)rows * S, *routed = shared_out + (size_t)rows * H;
    float *projected = routed + (size_t)rows * W, *up_partials = projected + (size_t)rows * H;
    float *down_partials = up_partials + (size_t)threads * (pairs * M + rows * S);

    linear(c->normed, H, rows, &m->router, NULL, scores, c->partials);
    /* every thread routes every row: the same choices everywhere, and no barrier */
    int32_t ids[pairs];
    float weights[pairs];
    for (int r = 0; r < rows; r++) route_row(m, scores + (size_t)r * E, ids + r * K, weights + r * K);
    int slot[pairs], start[E + 1];
    group_pairs(ids, pairs, E, slot, start);
    const float *x = c->normed;
    if (m->latent_in.data) { /* this thread's columns of the latent input are its own */
        Product in = {c->normed, H, rows, &m->latent_in, latent, c->partials};
        products_band(&in, 1);
        products_columns(&in, 1);
        activate_columns(latent, rows, W, m->latent_in_bias, NO_ACTIVATION);
        x = latent;
    }
    /* this thread's input band of the experts' first products, gathered by expert */
    linear_share(W, &begin, &end);
    for (int p = 0; p < pairs; p++)
        memcpy(routed_in + (size_t)slot[p] * W + begin, x + (size_t)(p / K) * W + begin,
               sizeof(float) * (end - begin));
    Product jobs[E + 1];
    Product shared_up = {c->normed, H, rows, &m->shared.up, shared_mid, NULL};
    int count = expert_products(E, m->experts_up, start, routed_in, W, routed_mid, M, &shared_up,
                                up_partials, threads, jobs);
    products_band(jobs, count);
    products_columns(jobs, count);
    activate_columns(routed_mid, pairs, M, NULL, m->shared.activation);
    activate_columns(shared_mid, rows, S, m->shared.up_bias, m->shared.activation);
    if (m->shared.down.out_in) region_barrier(); /* an [out, in] weight reads every column */
    Product shared_down = {shared_mid, S, rows, &m->shared.down, shared_out, NULL};
    count = expert_products(E, m->experts_down, start, routed_mid, M, routed_out, W, &shared_down,
                            down_partials, threads, jobs);
    products_band(jobs, count);
    products_columns(jobs, count);
    /* each row's weighted experts on this thread's columns, in expert order (the torch
     * path's order of sums) */
    linear_share(W, &begin, &end);
    for (int r = 0; r < rows; r++) {
        float *sum = routed + (size_t)r * W;
        for (int i = begin; i < end; i++) sum[i] = 0.0f;
        for (int e = 0; e < E; e++)
            for (int k = 0; k < K; k++) {
                int p = r * K + k;
                if (ids[p] != e) continue;
                const float *out = routed_out + (size_t)slot[p] * W;
                for (int i = begin; i < end; i++) sum[i] += out[i] * weights[p];
            }
    }
    const float *routed_h = routed;
    if (m->latent_out.data) {
        if (m->latent_out.out_in) region_barrier(); /* an [out, in] weight reads every column */
        Product back = {routed, W, rows, &m->latent_out, projected, c->partials};
        products_band(&back, 1);
        products_columns(&back, 1);
        activate_columns(projected, rows, H, m->latent_out_bias, NO_ACTIVATION);
        routed_h = projected;
    }
    /* branch = routed + shared on this thread's columns, as the torch path adds them */
    const float *bias = m->shared.down_bias;
    linear_share(H, &begin, &end);
    for (int r = 0; r < rows; r++)
        for (int i = begin; i < end; i++) {
            size_t at = (size_t)r * H + i;
            float shared = bias ? shared_out[at] + bias[i] : shared_out[at];
            if (out_norm) c->branch[at] = routed_h[at] + shared;
            else c->hidden[at] = c->hidden[at] + routed_h[at] + shared;
        }
    if (out_norm) add_branch(c, out_norm);
    else region_barrier();
}

static int moe_widest(const void *params) {
    const Moe *m = params;
    int widest = larger(m->num_experts, larger(m->shared.up.out, m->shared.down.out));
    widest = larger(widest, larger(moe_mid(m), m->experts_down[0].out));
    return m->latent_in.data ? larger(widest, m->latent_in.out) : widest;
}

static int moe_check(const Model *model, const void *params) {
    const Moe *m = params;
    int H = model->hidden, E = m->num_experts;
    if (E < 1 || m->top_k < 1 || m->top_k > E || m->num_groups < 1 || E % m->num_groups)
        return 40;
    if (m->kept_groups < 1 || m->kept_groups > m->num_groups || !m->correction_bias) return 40;
    if (m->top_k > m->kept_groups * (E / m->num_groups)) return 40; /* no -inf choice taken */
    if (!check_matrix(&m->router, H, E) || !check_mlp(&m->shared, H, H)) return 41;
    int latent = m->latent_in.data != NULL, W = latent ? m->latent_in.out : H;
    if (latent != (m->latent_out.data != NULL)) return 42;
    if (latent && !(check_matrix(&m->latent_in, H, W) && check_matrix(&m->latent_out, W, H)))
        return 42;
    int M = m->experts_up[0].out;
    for (int e = 0; e < E; e++) { /* [in, out] only: a thread reads the columns it wrote */
        const Matrix *up = m->experts_up + e, *down = m->experts_down + e;
        if (!check_matrix(up, W, M) || !check_matrix(down, M, W) || up->out_in || down->out_in)
            return 43;
    }
    return 0;
}

static int mamba2_inner(const Mamba2 *m) { return m->num_heads * m->head_dim; }

static int mamba2_conv_dim(const Mamba2 *m) {
    return mamba2_inner(m) + 2 * m->num_groups * m->state_size;
}

/* Mamba2's work: the projection [rows, inner + conv_dim + heads], the conv output
 * [rows, conv_dim] and y [rows, inner]. */
static size_t mamba2_floats(const void *params, const Step *step) {
    const Mamba2 *m = params;
    return (size_t)step->rows * (m->in_proj.out + mamba2_conv_dim(m) + mamba2_inner(m));
}

static float silu(float x) { return x / (1.0f + expf(-x)); }

static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); } /* torch's threshold */

/* The depthwise causal conv of channels [first, first + count): each channel's input (plus
 * its `input_bias`, when given) after the K - 1 it keeps in `states` [channels, K - 1] (zeros
 * when `fresh`), times its `weight` [channels, K] taps (plus `bias`), SiLU, into `out`; its
 * state advanced. */
static void causal_conv(float *states, const float *input, const float *input_bias,
                        const float *weight, const float *bias, int K, int first, int count,
                        int fresh, float *out) {
    for (int ch = first; ch < first + count; ch++) {
        float value = input_bias ? input[ch] + input_bias[ch] : input[ch];
        float *state = states + (size_t)ch * (K - 1);
        if (fresh) memset(state, 0, sizeof(float) * (K - 1));
        const float *w = weight + (size_t)ch * K;
        float sum = 0.0f;
        for (int k = 0; k < K - 1; k++) sum += state[k] * w[k];
        sum += value * w[K - 1];
        if (bias) sum += bias[ch];
        out[ch] = silu(sum);
        memmove(state, state + 1, sizeof(float) * (K - 2));
        state[K - 2] = value;
    }
}

/* The causal conv of channels [first, first + count) of row r, its conv state advanced. */
static void mamba2_conv(const Context *c, const Mamba2 *m, int r, int first, int count,
                        const float *proj, float *conv_out) {
    const Step *step = c->step;
    int inner = mamba2_inner(m), C = mamba2_conv_dim(m), K = m->kernel;
    float *states = step->states[2 * m->state] + (size_t)step->state_rows[r] * C * (K - 1);
    causal_conv(states, proj + (size_t)r * m->in_proj.out + inner,
                m->in_proj_bias ? m->in_proj_bias + inner : NULL, m->conv_weight, m->conv_bias,
                K, first, count, step->fresh[r], conv_out + (size_t)r * C);
}

/* The SSM update of head h of row r: its state advanced in place, its y written. */
static void mamba2_head(const Context *c, const Mamba2 *m, int r, int h, const float *proj,
                        const float *conv_out, float *y) {
    const Step *step = c->step;
    int H = m->num_heads, P = m->head_dim, N = m->state_size, G = m->num_groups;
    int inner = mamba2_inner(m), C = mamba2_conv_dim(m), g = h / (H / G);
    float raw = proj[(size_t)r * m->in_proj.out + inner + C + h];
    if (m->in_proj_bias) raw += m->in_proj_bias[inner + C + h];
    float dt = softplus(raw + m->dt_bias[h]);
    if (step->prompt[r] && dt < m->time_step_min) dt = m->time_step_min;
    float decay = expf(dt * m->A[h]), skip = m->D[h];
    const float *row = conv_out + (size_t)r * C, *x = row + (size_t)h * P;
    const float *B = row + inner + (size_t)g * N, *Cg = row + inner + (size_t)(G + g) * N;
    float *state = step->states[2 * m->state + 1] + ((size_t)step->state_rows[r] * H + h) * P * N;
    if (step->fresh[r]) memset(state, 0, sizeof(float) * P * N);
    float dtB[N];
    for (int n = 0; n < N; n++) dtB[n] = dt * B[n];
    for (int p = 0; p < P; p++) {
        float *s = state + (size_t)p * N, xp = x[p], acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int n = 0; n < N; n++) {
            s[n] = s[n] * decay + dtB[n] * xp;
            acc += s[n] * Cg[n];
        }
        y[(size_t)r * inner + h * P + p] = acc + skip * xp;
    }
}

/* y * silu(z) of group g's slice of row r, RMS-normalised, times the gate norm, in place. */
static void mamba2_gated_norm(const Context *c, const Mamba2 *m, int r, int g, const float *proj,
                              float *y) {
    int inner = mamba2_inner(m), size = inner / m->num_groups, first = g * size;
    float *slice = y + (size_t)r * inner + first, sum = 0.0f;
    const float *gate = proj + (size_t)r * m->in_proj.out + first;
    for (int i = 0; i < size; i++) {
        float z = m->in_proj_bias ? gate[i] + m->in_proj_bias[first + i] : gate[i];
        slice[i] *= silu(z);
        sum += slice[i] * slice[i];
    }
    float inv = 1.0f / sqrtf(sum / (float)size + c->model->eps);
    for (int i = 0; i < size; i++) slice[i] = m->gate_norm[first + i] * (slice[i] * inv);
}

static void mamba2(const Context *c, const void *params, const float *out_norm) {
    const Mamba2 *m = params;
    int rows = c->step->rows, G = m->num_groups, heads = m->num_heads / G, begin, end;
    int inner = mamba2_inner(m), P = m->head_dim, N = m->state_size;
    float *proj = c->work, *conv_out = proj + (size_t)rows * m->in_proj.out;
    float *y = conv_out + (size_t)rows * mamba2_conv_dim(m);
    linear(c->normed, c->model->hidden, rows, &m->in_proj, NULL, proj, c->partials);
    /* one unit per (row, group): the conv of its heads' x and its B and C, the scan of its
     * heads, the norm of its slice (a group's heads are that slice) */
    share(rows * G, omp_get_num_threads(), omp_get_thread_num(), &begin, &end);
    for (int unit = begin; unit < end; unit++) {
        int r = unit / G, g = unit % G;
        mamba2_conv(c, m, r, g * heads * P, heads * P, proj, conv_out);
        mamba2_conv(c, m, r, inner + g * N, N, proj, conv_out);
        mamba2_conv(c, m, r, inner + (G + g) * N, N, proj, conv_out);
        for (int h = g * heads; h < (g + 1) * heads; h++) mamba2_head(c, m, r, h, proj, conv_out, y);
        mamba2_gated_norm(c, m, r, g, proj, y);
    }
    region_barrier();
    residual_projection(c, y, inner, &m->out_proj, out_norm, m->out_proj_bias);
}

static int mamba2_widest(const void *params) {
    const Mamba2 *m = params;
    return larger(m->in_proj.out, m->out_proj.out);
}

static int mamba2_check(const Model *model, const void *params) {
    const Mamba2 *m = params;
    int H = model->hidden, inner = mamba2_inner(m);
    if (m->num_heads < 1 || m->head_dim < 1 || m->state_size < 1 || m->kernel < 2) return 50;
    if (m->num_groups < 1 || m->num_heads % m->num_groups || m->state < 0) return 50;
    if (!m->conv_weight || !m->dt_bias || !m->A || !m->D || !m->gate_norm) return 51;
    int width = inner + mamba2_conv_dim(m) + m->num_heads;
    if (!check_matrix(&m->in_proj, H, width) || !check_matrix(&m->out_proj, inner, H)) return 52;
    return 0;
}

/* A state `state` among the step's, and every row's state slot within the tensors. */
static int state_fits(int state, const Step *step) {
    if (state >= step->num_states) return 0;
    for (int r = 0; r < step->rows; r++)
        if (step->state_rows[r] < 0 || step->state_rows[r] >= step->state_slots) return 0;
    return 1;
}

static int mamba2_fits(const void *params, const Step *step) {
    return state_fits(((const Mamba2 *)params)->state, step);
}
