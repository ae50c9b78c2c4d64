/* Paged attention of short query rows on CPU, fp32 or bf16: each row's query heads attend over
 * its sequence's pages, read in place from the head-major KV pool (kv_layout.py), in one pass.
 * A row is one query token: a decode token, or one token of a short chunk (grammar-forced
 * tokens appended to a decoding request), which sees the keys up to its own position only.
 *
 * Why native code: torch has no paged attention on CPU. Its path gathers every row's pages
 * into a contiguous copy, then runs two batched GEMMs over it, so the KV (about 46 KB a token
 * for SmolLM2-135M in fp32, the bulk of a decode step's memory traffic) is read twice and
 * written once, at about a quarter of the machine's read bandwidth (benchmarks/attention_bound.py).
 * Here each key and value row is read once, while the GQA group's queries stay in registers.
 * The tokens of one chunk read the same pages one after the other, from cache.
 *
 * Work items are (row, KV head) pairs, spread over as many OpenMP threads as torch uses (the
 * shared object links the libgomp torch has loaded: one thread pool for both). Within an item
 * the pages are taken in order with an online softmax per page (as flash attention does per
 * tile). While key j of a page is scored, key j and value j of the next page are prefetched:
 * prefetching a whole page at once stalled on the cores' limit of outstanding misses (perf:
 * 70% of the kernel's cycles on the prefetch instructions); spread over the keys, a step of
 * 30 layers x 64 rows x 256 keys takes 39 instead of 47 ms in fp32, 28 instead of 33 in bf16
 * (two pages ahead was no better). Sums and
 * the softmax are fp32 in both dtypes; bf16 values are widened on load and the output rounded
 * to nearest even, as torch rounds.
 *
 * Built and loaded by native_decode.py with the system C compiler; without one, the torch
 * path runs instead.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_PAGE 128

typedef uint16_t bf16;

static inline float f32_load(const float *p) { return *p; }
static inline void f32_store(float *p, float x) { *p = x; }
static inline float bf16_load(const bf16 *p) {
    const uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline void bf16_store(bf16 *p, float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even (no NaNs reach here) */
    *p = (bf16)(u >> 16);
}

static inline void prefetch_bytes(const char *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

/* One work item: the GROUP query heads of KV head h of one row, over its first len keys.
 * GROUP and DIM are compile-time constants in the common instances below (so the query and
 * the accumulators stay in registers), run-time values in the generic one. T is the element
 * type, LOAD/STORE widen and narrow it. */
#define ATTEND_ITEM(GROUP, DIM, T, LOAD, STORE)                                                                \
    do {                                                                                                       \
        float qv[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM];                                                 \
        float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][MAX_PAGE];                                              \
        for (int64_t g = 0; g < (GROUP); ++g) {                                                                \
            const T *src = qh + g * (DIM);                                                                     \
            for (int64_t d = 0; d < (DIM); ++d) {                                                              \
                qv[g][d] = LOAD(src + d) * scale; /* the scale folded into the query, once */                  \
                acc[g][d] = 0.0f;                                                                              \
            }                                                                                                  \
            m[g] = 0.0f; /* set by the first page */                                                           \
            l[g] = 0.0f;                                                                                       \
        }                                                                                                      \
        const int64_t pages = (len + page_size - 1) / page_size;                                               \
        for (int64_t p = 0; p < pages; ++p) {                                                                  \
            const int64_t start = p * page_size;                                                               \
            const int64_t n = len - start < page_size ? len - start : page_size;                               \
            const T *kp = kh + (int64_t)table[p] * page_elems;                                                 \
            const T *vp = vh + (int64_t)table[p] * page_elems;                                                 \
            const int64_t next = table[p + 1 < pages ? p + 1 : p]; /* the last page: itself, in cache */      \
            const char *kn = (const char *)(kh + next * page_elems), *vn = (const char *)(vh + next * page_elems); \
            /* Scores of this page's keys: each key row is loaded once for the whole group. */                 \
            for (int64_t j = 0; j < n; ++j) {                                                                  \
                const T *krow = kp + j * (DIM);                                                                \
                prefetch_bytes(kn + j * (DIM) * sizeof(T), (DIM) * sizeof(T));                                  \
                prefetch_bytes(vn + j * (DIM) * sizeof(T), (DIM) * sizeof(T));                                  \
                for (int64_t g = 0; g < (GROUP); ++g) {                                                        \
                    float dot = 0.0f;                                                                          \
                    _Pragma("omp simd reduction(+ : dot)") for (int64_t d = 0; d < (DIM); ++d) dot +=          \
                        qv[g][d] * LOAD(krow + d);                                                             \
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
                const T *vrow = vp + j * (DIM);                                                                \
                for (int64_t g = 0; g < (GROUP); ++g) {                                                        \
                    const float w = s[g][j];                                                                   \
                    _Pragma("omp simd") for (int64_t d = 0; d < (DIM); ++d) acc[g][d] += w * LOAD(vrow + d);   \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (int64_t g = 0; g < (GROUP); ++g) {                                                                \
            T *dst = oh + g * (DIM);                                                                           \
            const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;                                                \
            for (int64_t d = 0; d < (DIM); ++d) STORE(dst + d, acc[g][d] * inv);                               \
        }                                                                                                      \
    } while (0)

/* q:          [tokens, Hq, D], q_stride elements a token (Hq * D when contiguous)
 * k_pool/v_pool: [Hkv, pages * page_size, D] contiguous (head-major storage)
 * block_tables: [seqs, bt_stride] page ids (int32)
 * row_seq/row_tok/row_len: for each row, its sequence (block-table row), its query token, and
 *             the keys it sees (its position + 1; the whole context for a decode token)
 * out:        [tokens, Hq, D], out_stride elements a token
 * num_threads: torch.get_num_threads() (an OpenMP thread's own setting may differ from it)
 * Returns 0, or -1 when a size is past the limits above (nothing written). */
#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                                    \
    int NAME(const T *q, int64_t q_stride, const T *k_pool, const T *v_pool, int64_t num_pages,                \
             const int32_t *block_tables, int64_t bt_stride, const int64_t *row_seq, const int64_t *row_tok,   \
             const int64_t *row_len, int64_t num_rows, T *out, int64_t out_stride, int64_t hkv, int64_t group, \
             int64_t dim, int64_t page_size, float scale, int num_threads) {                                   \
        if (group > MAX_GROUP || dim > MAX_DIM || page_size > MAX_PAGE || group < 1 || dim < 1 || page_size < 1) \
            return -1;                                                                                         \
        const int64_t head_stride = num_pages * page_size * dim;                                               \
        const int64_t page_elems = page_size * dim;                                                            \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                              \
        for (int64_t item = 0; item < num_rows * hkv; ++item) {                                                \
            const int64_t r = item / hkv, h = item % hkv;                                                      \
            const int64_t len = row_len[r];                                                                    \
            const int32_t *table = block_tables + row_seq[r] * bt_stride;                                      \
            const T *kh = k_pool + h * head_stride, *vh = v_pool + h * head_stride;                            \
            const T *qh = q + row_tok[r] * q_stride + h * group * dim;                                         \
            T *oh = out + row_tok[r] * out_stride + h * group * dim;                                           \
            if (dim == 64 && group == 1) ATTEND_ITEM(1, 64, T, LOAD, STORE);                                   \
            else if (dim == 64 && group == 2) ATTEND_ITEM(2, 64, T, LOAD, STORE);                              \
            else if (dim == 64 && group == 3) ATTEND_ITEM(3, 64, T, LOAD, STORE);                              \
            else if (dim == 64 && group == 4) ATTEND_ITEM(4, 64, T, LOAD, STORE);                              \
            else if (dim == 128 && group == 1) ATTEND_ITEM(1, 128, T, LOAD, STORE);                            \
            else if (dim == 128 && group == 2) ATTEND_ITEM(2, 128, T, LOAD, STORE);                            \
            else if (dim == 128 && group == 4) ATTEND_ITEM(4, 128, T, LOAD, STORE);                            \
            else if (dim == 128 && group == 8) ATTEND_ITEM(8, 128, T, LOAD, STORE);                            \
            else ATTEND_ITEM(group, dim, T, LOAD, STORE);                                                      \
        }                                                                                                      \
        return 0;                                                                                              \
    }

DEFINE_KERNEL(paged_rows_f32, float, f32_load, f32_store)
DEFINE_KERNEL(paged_rows_bf16, bf16, bf16_load, bf16_store)
