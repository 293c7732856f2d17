/* The Gated DeltaNet kind of the native decode step (a hybrid's linear-attention layers).
 * It uses `step.h`'s `Context`, `rms_norm` and `residual_projection` and `kinds_hybrid.h`'s
 * `silu`, `softplus`, `causal_conv` and `state_fits`; the five functions of its row of `KINDS`.
 *
 *   GATED_DELTA  q|k|v, z, b, a = x @ Win; q|k|v through the depthwise causal conv after the
 *                row's last K - 1 inputs (SiLU, no bias); q and k L2-normalised per key head
 *                (x / sqrt(sum x^2 + 1e-6)), q times k_dim^-1/2; per value head h (sharing key
 *                head h / (Hv / Hk)): g = A[h] softplus(a + dt_bias[h]), beta = sigmoid(b);
 *                S = exp(g) S; S += k (beta (v - k^T S))^T; y = S^T q; y RMS-normalised over
 *                the head, times the norm's weight and silu(z); y @ Wout
 *
 * A block's conv state [conv_dim, K - 1] and delta-rule state [v_heads, k_dim, v_dim] of row r
 * are slot `state_rows[r]` of the step's state tensors, read and written in place; a fresh row
 * starts from zeros whatever its slot held. One unit of work is a (row, key head): the conv of
 * its q, k and its value heads' v, then each of those value heads' update, output and norm.
 */

#pragma once

#include "kinds_hybrid.h"

#define L2_NORM_EPS 1e-6f

typedef struct {
    Matrix in_proj;              /* [hidden, conv_dim + value_dim + 2 v_heads]: q|k|v, z, b, a */
    Matrix out_proj;             /* [value_dim, hidden] */
    const float *conv_weight;    /* [conv_dim, kernel] */
    const float *dt_bias, *A;    /* [v_heads] each; A negative */
    const float *gate_norm;      /* [v_dim] */
    int32_t num_k_heads, num_v_heads, k_dim, v_dim, kernel;
    int32_t state;               /* which of the step's recurrent states */
} GatedDelta;

static int delta_key_width(const GatedDelta *m) { return m->num_k_heads * m->k_dim; }
static int delta_value_width(const GatedDelta *m) { return m->num_v_heads * m->v_dim; }
static int delta_conv_dim(const GatedDelta *m) {
    return 2 * delta_key_width(m) + delta_value_width(m);
}

/* Its work: the projection [rows, in_proj width], the conv output [rows, conv_dim] and y
 * [rows, value_dim]. */
static size_t gated_delta_floats(const void *params, const Step *step) {
    const GatedDelta *m = params;
    return (size_t)step->rows * (m->in_proj.out + delta_conv_dim(m) + delta_value_width(m));
}

/* `x` [n] times 1 / sqrt(sum x^2 + eps) times `scale`, in place. */
static void l2_normalize(float *x, int n, float scale) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) sum += x[i] * x[i];
    float factor = scale / sqrtf(sum + L2_NORM_EPS);
    for (int i = 0; i < n; i++) x[i] *= factor;
}

/* The delta-rule update of value head h of row r, its output normalised and gated into y. */
static void delta_head(const Context *c, const GatedDelta *m, int r, int h, const float *proj,
                       const float *conv_out, float *y) {
    const Step *step = c->step;
    int Dk = m->k_dim, Dv = m->v_dim, Hv = m->num_v_heads, C = delta_conv_dim(m);
    int kh = h / (Hv / m->num_k_heads), values = delta_value_width(m);
    const float *row = conv_out + (size_t)r * C, *p = proj + (size_t)r * m->in_proj.out;
    const float *q = row + (size_t)kh * Dk, *k = row + delta_key_width(m) + (size_t)kh * Dk;
    const float *v = row + 2 * delta_key_width(m) + (size_t)h * Dv;
    float decay = expf(m->A[h] * softplus(p[C + values + Hv + h] + m->dt_bias[h]));
    float beta = 1.0f / (1.0f + expf(-p[C + values + h]));
    float *S = step->states[2 * m->state + 1] + ((size_t)step->state_rows[r] * Hv + h) * Dk * Dv;
    if (step->fresh[r]) memset(S, 0, sizeof(float) * Dk * Dv);
    float remembered[Dv], out[Dv];
    memset(remembered, 0, sizeof remembered);
    memset(out, 0, sizeof out);
    for (int i = 0; i < Dk; i++) { /* decay, and what S holds under k */
        float *s = S + (size_t)i * Dv, ki = k[i];
#pragma omp simd
        for (int j = 0; j < Dv; j++) {
            s[j] *= decay;
            remembered[j] += s[j] * ki;
        }
    }
    for (int j = 0; j < Dv; j++) remembered[j] = (v[j] - remembered[j]) * beta; /* the delta */
    for (int i = 0; i < Dk; i++) { /* write it under k, and read with q */
        float *s = S + (size_t)i * Dv, ki = k[i], qi = q[i];
#pragma omp simd
        for (int j = 0; j < Dv; j++) {
            s[j] += ki * remembered[j];
            out[j] += s[j] * qi;
        }
    }
    float sum = 0.0f;
    for (int j = 0; j < Dv; j++) sum += out[j] * out[j];
    float inv = 1.0f / sqrtf(sum / (float)Dv + c->model->eps);
    const float *gate = p + C + (size_t)h * Dv;
    float *target = y + (size_t)r * values + (size_t)h * Dv;
    for (int j = 0; j < Dv; j++) target[j] = m->gate_norm[j] * (out[j] * inv) * silu(gate[j]);
}

static void gated_delta(const Context *c, const void *params, const float *out_norm) {
    const GatedDelta *m = params;
    const Step *step = c->step;
    int rows = step->rows, Hk = m->num_k_heads, Dk = m->k_dim, begin, end;
    int ratio = m->num_v_heads / Hk, keys = delta_key_width(m), C = delta_conv_dim(m);
    float *proj = c->work, *conv_out = proj + (size_t)rows * m->in_proj.out;
    float *y = conv_out + (size_t)rows * C;
    linear(c->normed, c->model->hidden, rows, &m->in_proj, NULL, proj, c->partials);
    share(rows * Hk, omp_get_num_threads(), omp_get_thread_num(), &begin, &end);
    for (int unit = begin; unit < end; unit++) {
        int r = unit / Hk, kh = unit % Hk;
        float *states = step->states[2 * m->state] + (size_t)step->state_rows[r] * C * (m->kernel - 1);
        const float *input = proj + (size_t)r * m->in_proj.out;
        float *out = conv_out + (size_t)r * C;
        int fresh = step->fresh[r];
        causal_conv(states, input, NULL, m->conv_weight, NULL, m->kernel, kh * Dk, Dk, fresh, out);
        causal_conv(states, input, NULL, m->conv_weight, NULL, m->kernel, keys + kh * Dk, Dk,
                    fresh, out);
        causal_conv(states, input, NULL, m->conv_weight, NULL, m->kernel,
                    2 * keys + kh * ratio * m->v_dim, ratio * m->v_dim, fresh, out);
        l2_normalize(out + (size_t)kh * Dk, Dk, 1.0f / sqrtf((float)Dk));
        l2_normalize(out + keys + (size_t)kh * Dk, Dk, 1.0f);
        for (int h = kh * ratio; h < (kh + 1) * ratio; h++) delta_head(c, m, r, h, proj, conv_out, y);
    }
    region_barrier();
    residual_projection(c, y, delta_value_width(m), &m->out_proj, out_norm, NULL);
}

static int gated_delta_widest(const void *params) {
    const GatedDelta *m = params;
    return larger(m->in_proj.out, m->out_proj.out);
}

static int gated_delta_check(const Model *model, const void *params) {
    const GatedDelta *m = params;
    int H = model->hidden, values = delta_value_width(m);
    if (m->num_k_heads < 1 || m->num_v_heads % m->num_k_heads || m->k_dim < 1) return 60;
    if (m->v_dim < 1 || m->kernel < 2 || m->state < 0) return 60;
    if (!m->conv_weight || !m->dt_bias || !m->A || !m->gate_norm) return 61;
    int width = delta_conv_dim(m) + values + 2 * m->num_v_heads;
    if (!check_matrix(&m->in_proj, H, width) || !check_matrix(&m->out_proj, values, H)) return 62;
    return 0;
}

static int gated_delta_fits(const void *params, const Step *step) {
    return state_fits(((const GatedDelta *)params)->state, step);
}
