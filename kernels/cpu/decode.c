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
 *   MLP, MOE, MAMBA2  see `kinds_hybrid.h`: relu² MLP, mixture of experts (only the
 *              experts a row routes to are read), Mamba2's one-token state update
 *   SOFTMAX_MOE  see `kinds_softmax_moe.h`: softmax-routed gated experts in place of an MLP
 *   GATED_DELTA  see `kinds_gated_delta.h`: a Gated DeltaNet's one-token delta-rule update
 *
 * The kernel reads only the description: which kind each block is, its weights and options.
 * A new kind is a struct beside `Attention`, its functions beside `attention`'s (check,
 * fits, work, widest output, run) and one row of `KINDS`. A weight is a `Matrix` in its
 * stored format, multiplied by through `linear` (`linear.h`; `formats.h` is where a format is
 * read); a new storage format is a case there. RMSNorm is x / sqrt(mean(x^2) + eps) * scale.
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

#include "step.h"
#include "kinds_dense.h"
#include "kinds_hybrid.h"
#include "kinds_softmax_moe.h"
#include "kinds_gated_delta.h"

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
