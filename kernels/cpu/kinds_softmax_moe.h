/* The softmax-routed mixture of gated experts in the native decode step, a decoder layer's MLP
 * in place of a dense one. It shares `kinds_hybrid.h`'s expert machinery (`top_experts`,
 * `group_pairs`, `expert_products`; `gate_rows` is the dense gated MLP's); it has the five
 * functions of a row of `KINDS`.
 *
 *   SOFTMAX_MOE  p = softmax(x @ Wrouter) over all experts (float32); the `top_k` largest
 *                are taken (ties to the lower id) and their p renormalised to sum 1;
 *                y = sum of weight * expert(x), each expert (act(x @ Wgate) * (x @ Wup)) @
 *                Wdown with gate|up fused side by side; optionally + sigmoid(x @ Wshared_gate)
 *                * shared(x), a gated MLP every row takes. Each expert is read once for the
 *                rows routed to it; experts no row chose are not read at all.
 *
 * Sums are float32, each row's experts added in ascending id as the torch path adds them, the
 * gated shared expert then added to that sum. Barriers: the router product's own, the two
 * expert phases' own (the shared expert's products and its gate's run in them), and one on each
 * side of the gating (a pair's gate and up columns may have been written by different threads).
 */

#pragma once

#include "kinds_dense.h"
#include "kinds_hybrid.h"

typedef struct {
    Matrix router;                 /* [hidden, experts] float32 */
    const Matrix *experts_gate_up; /* [experts] matrices, each [hidden, 2 mid]: gate, then up */
    const Matrix *experts_down;    /* [experts] matrices, each [mid, hidden] */
    GatedMlp shared;               /* the shared expert; no gate|up data: none */
    Matrix shared_gate;            /* [hidden, 1]: the logit of the shared expert's scale */
    int32_t num_experts, top_k, activation;
} SoftmaxMoe;

static int softmax_moe_mid(const SoftmaxMoe *m) { return m->experts_down[0].in; }

/* The shared expert's mid width (0: no shared expert). */
static int softmax_moe_shared_mid(const SoftmaxMoe *m) {
    return m->shared.gate_up.data ? m->shared.down.in : 0;
}

/* The work, in this order: router logits [rows, experts], then per (row, expert) pair grouped
 * by expert its input [hidden], its gate|up [2 mid] and its output [hidden], then per row the
 * shared expert's gate|up [2 shared mid], output [hidden] and gate logit [1] (none without
 * one), then the partial sums of the gate|up products (the shared gate's last) and of the
 * down products. */
static size_t softmax_moe_floats(const void *params, const Step *step) {
    const SoftmaxMoe *m = params;
    size_t rows = step->rows, pairs = rows * m->top_k, H = m->router.in, M = softmax_moe_mid(m);
    size_t S = softmax_moe_shared_mid(m), shared = S ? rows * (2 * S + H + 1) : 0;
    return rows * m->num_experts + pairs * (2 * H + 2 * M) + shared +
           step->threads * (pairs * (2 * M + H) + shared);
}

/* act(gate) * up into the gate half of each routed pair's gate|up [pairs, 2 mid] and each
 * row's shared gate|up [rows, 2 shared mid], this thread's share of both, then a barrier: one
 * for the two. */
static void gate_experts(const SoftmaxMoe *m, float *routed, int pairs, float *shared,
                         int rows) {
    int M = softmax_moe_mid(m), S = softmax_moe_shared_mid(m), routed_units = pairs * M;
    int begin, end;
    share(routed_units + rows * S, omp_get_num_threads(), omp_get_thread_num(), &begin, &end);
    for (int unit = begin; unit < end; unit++) {
        int is_shared = unit >= routed_units, I = is_shared ? S : M;
        int at = is_shared ? unit - routed_units : unit, col = at % I;
        float *row = (is_shared ? shared : routed) + (size_t)(at / I) * 2 * I;
        row[col] = activate(is_shared ? m->shared.activation : m->activation, row[col]) *
                   row[I + col];
    }
    region_barrier();
}

/* A row's `top_k` experts (`ids`, largest first) and their weights from its router `logits`. */
static void softmax_route_row(const SoftmaxMoe *m, const float *logits, int32_t *ids,
                              float *weights) {
    int E = m->num_experts;
    float p[E], top = -INFINITY, total = 0.0f, chosen = 0.0f;
    for (int e = 0; e < E; e++) top = logits[e] > top ? logits[e] : top;
    for (int e = 0; e < E; e++) total += p[e] = expf(logits[e] - top);
    for (int e = 0; e < E; e++) p[e] /= total;
    top_experts(p, E, m->top_k, ids);
    for (int k = 0; k < m->top_k; k++) chosen += weights[k] = p[ids[k]];
    for (int k = 0; k < m->top_k; k++) weights[k] /= chosen;
}

static void softmax_moe(const Context *c, const void *params, const float *out_norm) {
    const SoftmaxMoe *m = params;
    const Step *step = c->step;
    int rows = step->rows, H = c->model->hidden, E = m->num_experts, K = m->top_k;
    int pairs = rows * K, M = softmax_moe_mid(m), S = softmax_moe_shared_mid(m);
    int threads = step->threads, begin, end;
    float *logits = c->work, *routed_in = logits + (size_t)rows * E;
    float *gate_up = routed_in + (size_t)pairs * H, *routed_out = gate_up + (size_t)pairs * 2 * M;
    float *shared_gate_up = routed_out + (size_t)pairs * H;
    float *shared_out = shared_gate_up + (size_t)rows * 2 * S;
    float *shared_logits = shared_out + (size_t)(S ? rows * H : 0);
    float *up_partials = shared_logits + (S ? rows : 0);
    float *gate_partials = up_partials + (size_t)threads * (pairs * 2 * M + rows * 2 * S);
    float *down_partials = gate_partials + (size_t)(S ? threads * rows : 0);

    linear(c->normed, H, rows, &m->router, NULL, logits, c->partials);
    /* every thread routes every row: the same choices everywhere, and no barrier */
    int32_t ids[pairs];
    float weights[pairs];
    for (int r = 0; r < rows; r++)
        softmax_route_row(m, logits + (size_t)r * E, ids + r * K, weights + r * K);
    int slot[pairs], start[E + 1];
    group_pairs(ids, pairs, E, slot, start);
    /* this thread's input band of the gate|up products, gathered by expert */
    linear_share(H, &begin, &end);
    for (int p = 0; p < pairs; p++)
        memcpy(routed_in + (size_t)slot[p] * H + begin, c->normed + (size_t)(p / K) * H + begin,
               sizeof(float) * (end - begin));
    Product jobs[E + 2];
    Product shared_up = {c->normed, H, rows, &m->shared.gate_up, shared_gate_up, NULL};
    int count = expert_products(E, m->experts_gate_up, start, routed_in, H, gate_up, 2 * M,
                                S ? &shared_up : NULL, up_partials, threads, jobs);
    if (S) /* the shared expert's gate logit, in the same phase */
        jobs[count++] = (Product){c->normed, H, rows, &m->shared_gate, shared_logits,
                                  gate_partials};
    products_band(jobs, count);
    products_columns(jobs, count);
    region_barrier(); /* a pair's gate and up columns may be other threads' */
    gate_experts(m, gate_up, pairs, shared_gate_up, rows);
    Product shared_down = {shared_gate_up, 2 * (size_t)S, rows, &m->shared.down, shared_out, NULL};
    count = expert_products(E, m->experts_down, start, gate_up, 2 * (size_t)M, routed_out, H,
                            S ? &shared_down : NULL, down_partials, threads, jobs);
    products_band(jobs, count);
    products_columns(jobs, count);
    /* each row's weighted experts on this thread's columns, in ascending expert id, then its
     * gated shared expert, added to the residual (or to the branch its out norm takes) */
    linear_share(H, &begin, &end);
    for (int r = 0; r < rows; r++)
        for (int i = begin; i < end; i++) {
            float sum = 0.0f;
            for (int e = 0; e < E; e++)
                for (int k = 0; k < K; k++) {
                    int p = r * K + k;
                    if (ids[p] == e) sum += routed_out[(size_t)slot[p] * H + i] * weights[p];
                }
            size_t at = (size_t)r * H + i;
            if (S) sum += shared_out[at] / (1.0f + expf(-shared_logits[r]));
            if (out_norm) c->branch[at] = sum;
            else c->hidden[at] = c->hidden[at] + sum;
        }
    if (out_norm) add_branch(c, out_norm);
    else region_barrier();
}

static int softmax_moe_widest(const void *params) {
    const SoftmaxMoe *m = params;
    int widest = larger(m->num_experts, larger(2 * softmax_moe_mid(m), m->router.in));
    return larger(widest, 2 * softmax_moe_shared_mid(m));
}

static int softmax_moe_check(const Model *model, const void *params) {
    const SoftmaxMoe *m = params;
    int H = model->hidden, E = m->num_experts;
    if (E < 1 || m->top_k < 1 || m->top_k > E) return 60;
    if (m->activation != SILU && m->activation != GELU_TANH) return 60;
    if (!check_matrix(&m->router, H, E)) return 61;
    int M = softmax_moe_mid(m), S = softmax_moe_shared_mid(m);
    if (S && (gated_mlp_check(model, &m->shared) || !check_matrix(&m->shared_gate, H, 1)))
        return 63;
    for (int e = 0; e < E; e++) { /* [in, out] only: a thread reads the columns it wrote */
        const Matrix *gate_up = m->experts_gate_up + e, *down = m->experts_down + e;
        if (!check_matrix(gate_up, H, 2 * M) || !check_matrix(down, M, H) || gate_up->out_in ||
            down->out_in)
            return 62;
    }
    return 0;
}
