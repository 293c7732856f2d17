/* The block kinds of hybrid decoders in the native decode step: a plain MLP, a mixture of
 * experts and Mamba2's one-token update. Included by `cpu_decode.c` (it uses its `Context`,
 * `rms_norm`, `activate` and `residual_projection`); each kind has the five functions of a row
 * of `KINDS` there.
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
 * the torch path sums (`engine.models.nemotron_*`).
 */

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

/* act(x + bias) in place over `rows` rows of `width`, split over the threads; a barrier. */
static void activate_rows(float *x, int rows, int width, const float *bias, int activation) {
    int begin, end;
    share(rows * width, omp_get_num_threads(), omp_get_thread_num(), &begin, &end);
    for (int unit = begin; unit < end; unit++) {
        int col = unit % width;
        x[unit] = activate(activation, bias ? x[unit] + bias[col] : x[unit]);
    }
#pragma omp barrier
}

/* MLP's work: the hidden activations [rows, mid]. */
static size_t mlp_floats(const void *params, const Step *step) {
    return (size_t)step->rows * ((const Mlp *)params)->up.out;
}

static void mlp(const Context *c, const void *params, const float *out_norm) {
    const Mlp *m = params;
    int rows = c->step->rows, I = m->up.out;
    linear(c->normed, c->model->hidden, rows, &m->up, NULL, c->work, c->partials);
    activate_rows(c->work, rows, I, m->up_bias, m->activation);
    residual_projection(c, c->work, I, &m->down, out_norm, m->down_bias);
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
static int moe_width(const Moe *m, int hidden) { return m->latent_in.data ? m->latent_in.out : hidden; }

static int moe_mid(const Moe *m) { return m->experts_up[0].out; }

/* MoE's work, in this order: scores [rows, experts], chosen experts and their weights
 * [rows, top_k] each, the latent input [rows, width], per (row, expert) pair grouped by
 * expert its input [width], hidden [mid] and output [width], the shared expert's hidden
 * [rows, shared mid] and output [rows, hidden], the routed sum [rows, width] and (latent) its
 * projection [rows, hidden]. */
static size_t moe_floats(const void *params, const Step *step) {
    const Moe *m = params;
    size_t rows = step->rows, pairs = rows * m->top_k, H = m->shared.down.out;
    size_t W = moe_width(m, (int)H);
    return rows * m->num_experts + 2 * pairs + rows * W + pairs * (2 * W + moe_mid(m)) +
           rows * (m->shared.up.out + H) + rows * W + rows * H;
}

/* The row's `top_k` experts (`ids`) and their weights, from its sigmoid scores (in place). */
static void route_row(const Moe *m, float *scores, int32_t *ids, float *weights) {
    int E = m->num_experts, per_group = E / m->num_groups;
    float choice[E];
    for (int e = 0; e < E; e++) {
        scores[e] = 1.0f / (1.0f + expf(-scores[e]));
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
    uint8_t taken[E];
    memset(taken, 0, sizeof taken);
    float total = 0.0f;
    for (int k = 0; k < m->top_k; k++) {
        int top = -1;
        for (int e = 0; e < E; e++)
            if (!taken[e] && (top < 0 || choice[e] > choice[top])) top = e;
        taken[top] = 1;
        ids[k] = top, weights[k] = scores[top];
        total += weights[k];
    }
    for (int k = 0; k < m->top_k; k++)
        weights[k] = (m->normalize ? weights[k] / (total + 1e-20f) : weights[k]) * m->scaling;
}

/* Where each (row, expert) pair p = r * top_k + k goes when the pairs are grouped by expert
 * (ascending; pairs of one expert in order): `slot[p]`, and each expert's first slot
 * `start[e]` (`start[E]`: the pair count). Every thread computes the same. */
static void group_pairs(const int32_t *ids, int pairs, int E, int *slot, int *start) {
    for (int e = 0; e <= E; e++) start[e] = 0;
    for (int p = 0; p < pairs; p++) start[ids[p] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    int next[E];
    memcpy(next, start, sizeof next);
    for (int p = 0; p < pairs; p++) slot[p] = next[ids[p]]++;
}

/* x [rows, in] @ matrix (+ bias) -> y [rows, out], rows split over the threads for the bias. */
static void biased_linear(const Context *c, const float *x, int rows, const Matrix *w,
                          const float *bias, float *y) {
    linear(x, w->in, rows, w, NULL, y, c->partials);
    if (bias) activate_rows(y, rows, w->out, bias, NO_ACTIVATION);
}

static void moe(const Context *c, const void *params, const float *out_norm) {
    const Moe *m = params;
    const Step *step = c->step;
    int rows = step->rows, H = c->model->hidden, E = m->num_experts, K = m->top_k;
    int pairs = rows * K, W = moe_width(m, H), M = moe_mid(m), S = m->shared.up.out;
    int thread = omp_get_thread_num(), threads = omp_get_num_threads(), begin, end;
    float *scores = c->work;
    int32_t *ids = (int32_t *)(scores + (size_t)rows * E);
    float *weights = (float *)(ids + pairs), *latent = weights + pairs;
    float *routed_in = latent + (size_t)rows * W, *routed_mid = routed_in + (size_t)pairs * W;
    float *routed_out = routed_mid + (size_t)pairs * M, *shared_mid = routed_out + (size_t)pairs * W;
    float *shared_out = shared_mid + (size_t)rows * S, *routed = shared_out + (size_t)rows * H;
    float *projected = routed + (size_t)rows * W;

    linear(c->normed, H, rows, &m->router, NULL, scores, c->partials);
    share(rows, threads, thread, &begin, &end);
    for (int r = begin; r < end; r++)
        route_row(m, scores + (size_t)r * E, ids + (size_t)r * K, weights + (size_t)r * K);
    const float *x = c->normed;
    if (m->latent_in.data) {
        biased_linear(c, c->normed, rows, &m->latent_in, m->latent_in_bias, latent);
        x = latent;
    } else {
#pragma omp barrier
    }
    int slot[pairs], start[E + 1];
    group_pairs(ids, pairs, E, slot, start);
    share(pairs, threads, thread, &begin, &end);
    for (int p = begin; p < end; p++)
        memcpy(routed_in + (size_t)slot[p] * W, x + (size_t)(p / K) * W, sizeof(float) * W);
#pragma omp barrier
    for (int e = 0; e < E; e++)
        if (start[e + 1] > start[e])
            linear(routed_in + (size_t)start[e] * W, W, start[e + 1] - start[e],
                   m->experts_up + e, NULL, routed_mid + (size_t)start[e] * M, c->partials);
    linear(c->normed, H, rows, &m->shared.up, NULL, shared_mid, c->partials);
    activate_rows(routed_mid, pairs, M, NULL, m->shared.activation);
    activate_rows(shared_mid, rows, S, m->shared.up_bias, m->shared.activation);
    for (int e = 0; e < E; e++)
        if (start[e + 1] > start[e])
            linear(routed_mid + (size_t)start[e] * M, M, start[e + 1] - start[e],
                   m->experts_down + e, NULL, routed_out + (size_t)start[e] * W, c->partials);
    biased_linear(c, shared_mid, rows, &m->shared.down, m->shared.down_bias, shared_out);
    /* each row's weighted experts, in expert order (the torch path's order of sums) */
    share(rows, threads, thread, &begin, &end);
    for (int r = begin; r < end; r++) {
        float *sum = routed + (size_t)r * W;
        memset(sum, 0, sizeof(float) * W);
        for (int e = 0; e < E; e++)
            for (int k = 0; k < K; k++) {
                int p = r * K + k;
                if (ids[p] != e) continue;
                const float *out = routed_out + (size_t)slot[p] * W;
                for (int i = 0; i < W; i++) sum[i] += out[i] * weights[p];
            }
    }
    const float *routed_h = routed;
    if (m->latent_out.data) {
#pragma omp barrier
        biased_linear(c, routed, rows, &m->latent_out, m->latent_out_bias, projected);
        routed_h = projected;
    }
    for (int r = begin; r < end; r++) {
        float *hidden = c->hidden + (size_t)r * H;
        const float *add = routed_h + (size_t)r * H, *shared = shared_out + (size_t)r * H;
        if (out_norm) {
            float branch[H];
            for (int i = 0; i < H; i++) branch[i] = add[i] + shared[i];
            rms_norm(branch, out_norm, branch, H, c->model->eps);
            for (int i = 0; i < H; i++) hidden[i] += branch[i];
        } else {
            for (int i = 0; i < H; i++) hidden[i] = hidden[i] + add[i] + shared[i];
        }
    }
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
    for (int e = 0; e < E; e++)
        if (!check_matrix(m->experts_up + e, W, M) || !check_matrix(m->experts_down + e, M, W))
            return 43;
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

/* The causal conv of this thread's (row, channel) units, each row's conv state advanced. */
static void mamba2_conv(const Context *c, const Mamba2 *m, const float *proj, float *conv_out) {
    const Step *step = c->step;
    int inner = mamba2_inner(m), C = mamba2_conv_dim(m), K = m->kernel, width = m->in_proj.out;
    float *states = step->states[2 * m->state];
    int begin, end;
    share(step->rows * C, omp_get_num_threads(), omp_get_thread_num(), &begin, &end);
    for (int unit = begin; unit < end; unit++) {
        int r = unit / C, ch = unit % C;
        float input = proj[(size_t)r * width + inner + ch];
        if (m->in_proj_bias) input += m->in_proj_bias[inner + ch];
        float *state = states + ((size_t)step->state_rows[r] * C + ch) * (K - 1);
        if (step->fresh[r]) memset(state, 0, sizeof(float) * (K - 1));
        const float *w = m->conv_weight + (size_t)ch * K;
        float sum = 0.0f;
        for (int k = 0; k < K - 1; k++) sum += state[k] * w[k];
        sum += input * w[K - 1];
        if (m->conv_bias) sum += m->conv_bias[ch];
        conv_out[(size_t)r * C + ch] = silu(sum);
        memmove(state, state + 1, sizeof(float) * (K - 2));
        state[K - 2] = input;
    }
#pragma omp barrier
}

/* The SSM update of this thread's (row, head) units: state advanced in place, y written. */
static void mamba2_scan(const Context *c, const Mamba2 *m, const float *proj,
                        const float *conv_out, float *y) {
    const Step *step = c->step;
    int H = m->num_heads, P = m->head_dim, N = m->state_size, G = m->num_groups;
    int inner = mamba2_inner(m), C = mamba2_conv_dim(m), width = m->in_proj.out;
    float *states = step->states[2 * m->state + 1];
    int begin, end;
    share(step->rows * H, omp_get_num_threads(), omp_get_thread_num(), &begin, &end);
    for (int unit = begin; unit < end; unit++) {
        int r = unit / H, h = unit % H, g = h / (H / G);
        float raw = proj[(size_t)r * width + inner + C + h];
        if (m->in_proj_bias) raw += m->in_proj_bias[inner + C + h];
        float dt = softplus(raw + m->dt_bias[h]);
        if (step->prompt[r] && dt < m->time_step_min) dt = m->time_step_min;
        float decay = expf(dt * m->A[h]), skip = m->D[h];
        const float *row = conv_out + (size_t)r * C, *x = row + (size_t)h * P;
        const float *B = row + inner + (size_t)g * N, *Cg = row + inner + (size_t)(G + g) * N;
        float *state = states + ((size_t)step->state_rows[r] * H + h) * P * N;
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
#pragma omp barrier
}

/* y * silu(z), RMS-normalised over each group's slice, times the gate norm, in place. */
static void mamba2_gated_norm(const Context *c, const Mamba2 *m, const float *proj, float *y) {
    int inner = mamba2_inner(m), G = m->num_groups, size = inner / G, width = m->in_proj.out;
    int begin, end;
    share(c->step->rows * G, omp_get_num_threads(), omp_get_thread_num(), &begin, &end);
    for (int unit = begin; unit < end; unit++) {
        int r = unit / G, first = unit % G * size;
        float *slice = y + (size_t)r * inner + first, sum = 0.0f;
        for (int i = 0; i < size; i++) {
            float z = proj[(size_t)r * width + first + i];
            if (m->in_proj_bias) z += m->in_proj_bias[first + i];
            slice[i] *= silu(z);
            sum += slice[i] * slice[i];
        }
        float inv = 1.0f / sqrtf(sum / (float)size + c->model->eps);
        for (int i = 0; i < size; i++) slice[i] = m->gate_norm[first + i] * (slice[i] * inv);
    }
#pragma omp barrier
}

static void mamba2(const Context *c, const void *params, const float *out_norm) {
    const Mamba2 *m = params;
    int rows = c->step->rows;
    float *proj = c->work, *conv_out = proj + (size_t)rows * m->in_proj.out;
    float *y = conv_out + (size_t)rows * mamba2_conv_dim(m);
    linear(c->normed, c->model->hidden, rows, &m->in_proj, NULL, proj, c->partials);
    mamba2_conv(c, m, proj, conv_out);
    mamba2_scan(c, m, proj, conv_out, y);
    mamba2_gated_norm(c, m, proj, y);
    residual_projection(c, y, mamba2_inner(m), &m->out_proj, out_norm, m->out_proj_bias);
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

/* A state for the block, and every row's state slot within the tensors. */
static int mamba2_fits(const void *params, const Step *step) {
    if (((const Mamba2 *)params)->state >= step->num_states) return 0;
    for (int r = 0; r < step->rows; r++)
        if (step->state_rows[r] < 0 || step->state_rows[r] >= step->state_slots) return 0;
    return 1;
}
