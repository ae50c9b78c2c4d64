/* Paged decode attention on CPU, fp32: each decode row's query heads attend over its pages,
 * read in place from the head-major KV pool (kv_layout.py), in one pass.
 *
 * Why native code: torch has no paged attention on CPU. Its path gathers every row's pages
 * into a contiguous copy, then runs two batched GEMMs over it, so the KV (about 46 KB a token
 * for SmolLM2-135M, the bulk of a decode step's memory traffic) is read twice and written once,
 * at about a quarter of the machine's read bandwidth (benchmarks/attention_bound.py). Here each
 * key and value row is read once, while the GQA group's queries stay in registers.
 *
 * Work items are (decode row, KV head) pairs, spread over as many OpenMP threads as torch uses
 * (the shared object links the libgomp torch has loaded: one thread pool for both). Within
 * an item the pages are taken in order with an online softmax per page (as flash attention
 * does per tile), and the next page's keys and values are prefetched while this one is used.
 *
 * Built and loaded by native_decode.py with the system C compiler; without one, the torch
 * path runs instead.
 */
#include <math.h>
#include <stdint.h>

#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_PAGE 128

static void prefetch_page(const float *p, int64_t n_floats) {
    for (int64_t i = 0; i < n_floats; i += 16) __builtin_prefetch(p + i, 0, 3);
}

/* One work item: the GROUP query heads of KV head h of one decode row, over its pages.
 * GROUP and DIM are compile-time constants in the common instances below (so the query and
 * the accumulators stay in registers), run-time values in the generic one. */
#define ATTEND_ITEM(GROUP, DIM)                                                                                \
    do {                                                                                                       \
        float qv[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM];                                                 \
        float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][MAX_PAGE];                                              \
        for (int64_t g = 0; g < (GROUP); ++g) {                                                                \
            const float *src = qh + g * (DIM);                                                                 \
            for (int64_t d = 0; d < (DIM); ++d) {                                                              \
                qv[g][d] = src[d] * scale; /* the scale folded into the query, once */                         \
                acc[g][d] = 0.0f;                                                                              \
            }                                                                                                  \
            m[g] = 0.0f; /* set by the first page */                                                           \
            l[g] = 0.0f;                                                                                       \
        }                                                                                                      \
        const int64_t pages = (len + page_size - 1) / page_size;                                               \
        for (int64_t p = 0; p < pages; ++p) {                                                                  \
            const int64_t start = p * page_size;                                                               \
            const int64_t n = len - start < page_size ? len - start : page_size;                               \
            const float *kp = kh + (int64_t)table[p] * page_floats;                                            \
            const float *vp = vh + (int64_t)table[p] * page_floats;                                            \
            if (p + 1 < pages) { /* the next page streams in while this one is used */                         \
                prefetch_page(kh + (int64_t)table[p + 1] * page_floats, page_floats);                          \
                prefetch_page(vh + (int64_t)table[p + 1] * page_floats, page_floats);                          \
            }                                                                                                  \
            /* Scores of this page's keys: each key row is loaded once for the whole group. */                 \
            for (int64_t j = 0; j < n; ++j) {                                                                  \
                const float *krow = kp + j * (DIM);                                                            \
                for (int64_t g = 0; g < (GROUP); ++g) {                                                        \
                    float dot = 0.0f;                                                                          \
                    _Pragma("omp simd reduction(+ : dot)") for (int64_t d = 0; d < (DIM); ++d) dot +=          \
                        qv[g][d] * krow[d];                                                                    \
                    s[g][j] = dot;                                                                             \
                }                                                                                              \
            }                                                                                                  \
            /* Online softmax: rescale what was accumulated when the running maximum grows. */                 \
            for (int64_t g = 0; g < (GROUP); ++g) {                                                            \
                /* No infinities (-ffast-math assumes none): the first page starts from its own scores. */     \
                float mx = p == 0 ? s[g][0] : m[g];                                                            \
                for (int64_t j = 0; j < n; ++j) mx = s[g][j] > mx ? s[g][j] : mx;                              \
                const float corr = p == 0 ? 0.0f : expf(m[g] - mx);                                            \
                l[g] *= corr;                                                                                  \
                for (int64_t d = 0; d < (DIM); ++d) acc[g][d] *= corr;                                         \
                m[g] = mx;                                                                                     \
                float sum = 0.0f;                                                                              \
                _Pragma("omp simd reduction(+ : sum)") for (int64_t j = 0; j < n; ++j) {                       \
                    const float e = expf(s[g][j] - mx);                                                        \
                    s[g][j] = e;                                                                               \
                    sum += e;                                                                                  \
                }                                                                                              \
                l[g] += sum;                                                                                   \
            }                                                                                                  \
            for (int64_t j = 0; j < n; ++j) {                                                                  \
                const float *vrow = vp + j * (DIM);                                                            \
                for (int64_t g = 0; g < (GROUP); ++g) {                                                        \
                    const float w = s[g][j];                                                                   \
                    _Pragma("omp simd") for (int64_t d = 0; d < (DIM); ++d) acc[g][d] += w * vrow[d];          \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (int64_t g = 0; g < (GROUP); ++g) {                                                                \
            float *dst = oh + g * (DIM);                                                                       \
            const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;                                                \
            for (int64_t d = 0; d < (DIM); ++d) dst[d] = acc[g][d] * inv;                                      \
        }                                                                                                      \
    } while (0)

/* q:          [tokens, Hq, D] rows of the decode tokens, q_stride floats a token (Hq * D when contiguous)
 * k_pool/v_pool: [Hkv, pages * page_size, D] contiguous (head-major storage)
 * block_tables: [seqs, bt_stride] page ids (int32)
 * row_seq/row_tok: for each decode row, its sequence (block-table row, seq_lens entry) and its token
 * seq_lens:   keys each sequence has, the new token's included (int32)
 * out:        [tokens, Hq, D], out_stride floats a token
 * num_threads: torch.get_num_threads() (an OpenMP thread's own setting may differ from it)
 * Returns 0, or -1 when a size is past the limits above (nothing written). */
int paged_decode_f32(const float *q, int64_t q_stride, const float *k_pool, const float *v_pool, int64_t num_pages,
                     const int32_t *block_tables, int64_t bt_stride, const int64_t *row_seq, const int64_t *row_tok,
                     const int32_t *seq_lens, int64_t num_rows, float *out, int64_t out_stride, int64_t hkv,
                     int64_t group, int64_t dim, int64_t page_size, float scale, int num_threads) {
    if (group > MAX_GROUP || dim > MAX_DIM || page_size > MAX_PAGE || group < 1 || dim < 1 || page_size < 1)
        return -1;
    const int64_t head_stride = num_pages * page_size * dim;
    const int64_t page_floats = page_size * dim;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < num_rows * hkv; ++item) {
        const int64_t r = item / hkv, h = item % hkv;
        const int64_t seq = row_seq[r], tok = row_tok[r];
        const int64_t len = seq_lens[seq];
        const int32_t *table = block_tables + seq * bt_stride;
        const float *kh = k_pool + h * head_stride, *vh = v_pool + h * head_stride;
        const float *qh = q + tok * q_stride + h * group * dim;
        float *oh = out + tok * out_stride + h * group * dim;
        if (dim == 64 && group == 1) ATTEND_ITEM(1, 64);
        else if (dim == 64 && group == 2) ATTEND_ITEM(2, 64);
        else if (dim == 64 && group == 3) ATTEND_ITEM(3, 64);
        else if (dim == 64 && group == 4) ATTEND_ITEM(4, 64);
        else if (dim == 128 && group == 1) ATTEND_ITEM(1, 128);
        else if (dim == 128 && group == 2) ATTEND_ITEM(2, 128);
        else if (dim == 128 && group == 4) ATTEND_ITEM(4, 128);
        else if (dim == 128 && group == 8) ATTEND_ITEM(8, 128);
        else ATTEND_ITEM(group, dim);
    }
    return 0;
}
