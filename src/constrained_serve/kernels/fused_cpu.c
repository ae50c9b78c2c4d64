/* The Llama layer's elementwise work on CPU, one pass each, fp32 or bf16: RMSNorm; rotary
 * embedding of q and k with k and v written straight into their KV pool slots; SiLU(gate) * up.
 * And greedy sampling's argmax over each row of fp32 logits.
 *
 * Why native code: in torch each is a chain of small ops (the rotary alone is about ten: two
 * slices, a negation, a cat and three multiplies or adds for q, the same for k, then two
 * index_copy_ calls to store k and v), each with its own allocation, dispatch and pass over
 * memory. At decode sizes (64 rows of SmolLM2-135M) that chain costs 0.24 ms a layer in fp32
 * and 0.32 ms in bf16, 7-10 ms a step, against a few microseconds of arithmetic.
 *
 * The arithmetic is torch's, op for op: this file is compiled without -ffast-math and with
 * -ffp-contract=off, so no multiply-add is fused and each step rounds as torch's does. bf16
 * rounds (to nearest even) after every op, as torch's bf16 ops do and as Hugging Face's
 * modeling code computes: the rotary is bit-identical to torch's in both dtypes. RMSNorm and
 * SiLU can differ from torch in the last bit: the sum of squares is added in another order,
 * and exp comes from glibc's vector math library instead of torch's SLEEF.
 *
 * Work is split over rows with OpenMP (torch's thread count) when there is enough of it.
 * Built and loaded by native_fused.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Let the compiler call glibc's vector exp (libmvec) from the SiLU loop; math.h declares it
 * so under -ffast-math only, which this file does not use. */
#if defined(__GLIBC__) && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((simd("notinbranch"))) float expf(float);
#endif

#define MAX_DIM 1024 /* head_dim limit of the rotary (a row of q is staged on the stack) */
/* Elements: below this, one thread. Above, OpenMP's fork (a few microseconds) pays: a decode
 * step's rotary (64 rows of SmolLM2-135M, 61k elements) takes 12 instead of 37 us on two. */
#define PARALLEL_MIN 16384

typedef uint16_t bf16;

static inline float f32_load(const float *p) { return *p; }
static inline void f32_store(float *p, float x) { *p = x; }
static inline float f32_round(float x) { return x; }
static inline float bf16_load(const bf16 *p) {
    const uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline bf16 bf16_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    /* Nearest even. No NaN check (it kept the loops from vectorizing): a NaN that arithmetic
     * makes here is the default one or carries a bf16 input's payload, and stays a NaN. */
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}
static inline void bf16_store(bf16 *p, float x) { *p = bf16_bits(x); }
/* x rounded to bf16 and widened back: what a bf16 tensor holds after an op. */
static inline float bf16_round(float x) {
    const uint32_t u = (uint32_t)bf16_bits(x) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* out[r] = x[r] * rsqrt(mean(x[r]^2) + eps), then times w.
 * fp32: as F.rms_norm (the product with w in fp32).
 * bf16: as Hugging Face's LlamaRMSNorm: normalised in fp32, rounded to bf16, then multiplied
 * by the bf16 weight (rounded again). */
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE, ROUND)                                                           \
    int NAME(const T *x, int64_t x_stride, const T *w, T *out, int64_t out_stride, int64_t rows, int64_t dim,  \
             float eps, int num_threads) {                                                                     \
        if (dim < 1) return -1;                                                                                \
        _Pragma("omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_MIN)")                  \
        for (int64_t r = 0; r < rows; ++r) {                                                                   \
            const T *xr = x + r * x_stride;                                                                    \
            T *o = out + r * out_stride;                                                                       \
            float ss = 0.0f;                                                                                   \
            _Pragma("omp simd reduction(+ : ss)") for (int64_t i = 0; i < dim; ++i) {                          \
                const float v = LOAD(xr + i);                                                                  \
                ss += v * v;                                                                                   \
            }                                                                                                  \
            const float inv = 1.0f / sqrtf(ss / (float)dim + eps);                                             \
            for (int64_t i = 0; i < dim; ++i) STORE(o + i, ROUND(LOAD(xr + i) * inv) * LOAD(w + i));           \
        }                                                                                                      \
        return 0;                                                                                              \
    }

/* Rotary embedding (rotate-half convention, as HF Llama/Qwen) of q in place and of k into the
 * pool, and v copied into the pool.
 * qkv:     [tokens, (hq + 2 hkv) * dim], qkv_stride elements a token: q, then k, then v
 * cos/sin: [tokens, dim], cs_stride elements a token (the step's rows of the tables)
 * slots:   [tokens] the slot (page * page_size + offset) of each token's K/V
 * k_pool/v_pool: [hkv, num_slots, dim] contiguous (head-major storage, kv_layout.py)
 * Per element: a = x[i] * cos[i], b = rotate_half(x)[i] * sin[i], a + b, each rounded.
 * Returns 0; -1 (nothing written) for a slot outside the pool or dim past MAX_DIM or odd. */
#define ROTATE_ROW(T, LOAD, STORE, ROUND, SRC, DST, C, S)                                                       \
    do {                                                                                                       \
        float tmp[MAX_DIM];                                                                                    \
        for (int64_t i = 0; i < half; ++i) {                                                                   \
            const float x1 = LOAD((SRC) + i), x2 = LOAD((SRC) + i + half);                                     \
            const float a1 = ROUND(x1 * LOAD((C) + i)), b1 = ROUND(-x2 * LOAD((S) + i));                       \
            const float a2 = ROUND(x2 * LOAD((C) + i + half)), b2 = ROUND(x1 * LOAD((S) + i + half));          \
            tmp[i] = a1 + b1;                                                                                  \
            tmp[i + half] = a2 + b2;                                                                           \
        }                                                                                                      \
        for (int64_t i = 0; i < dim; ++i) STORE((DST) + i, tmp[i]);                                            \
    } while (0)

#define DEFINE_ROPE_STORE(NAME, T, LOAD, STORE, ROUND)                                                         \
    int NAME(T *qkv, int64_t qkv_stride, const T *cos, const T *sin, int64_t cs_stride, int64_t tokens,       \
             int64_t hq, int64_t hkv, int64_t dim, const int64_t *slots, int64_t num_slots, T *k_pool,       \
             T *v_pool, int num_threads) {                                                                     \
        if (dim > MAX_DIM || dim < 2 || dim % 2) return -1;                                                    \
        for (int64_t t = 0; t < tokens; ++t)                                                                   \
            if (slots[t] < 0 || slots[t] >= num_slots) return -1;                                              \
        const int64_t half = dim / 2, head_stride = num_slots * dim;                                           \
        _Pragma("omp parallel for num_threads(num_threads) if (tokens * (hq + 2 * hkv) * dim >= PARALLEL_MIN)") \
        for (int64_t t = 0; t < tokens; ++t) {                                                                 \
            T *row = qkv + t * qkv_stride;                                                                     \
            const T *c = cos + t * cs_stride, *s = sin + t * cs_stride;                                        \
            for (int64_t h = 0; h < hq; ++h) ROTATE_ROW(T, LOAD, STORE, ROUND, row + h * dim, row + h * dim, c, s); \
            const T *k = row + hq * dim, *v = k + hkv * dim;                                                   \
            for (int64_t h = 0; h < hkv; ++h) {                                                                \
                T *kd = k_pool + h * head_stride + slots[t] * dim;                                             \
                ROTATE_ROW(T, LOAD, STORE, ROUND, k + h * dim, kd, c, s);                                      \
                memcpy(v_pool + h * head_stride + slots[t] * dim, v + h * dim, dim * sizeof(T));               \
            }                                                                                                  \
        }                                                                                                      \
        return 0;                                                                                              \
    }

/* out[r] = silu(gate[r]) * up[r], gate_up: [rows, 2 * inter] (gate, then up), gu_stride
 * elements a row; silu(x) = x / (1 + exp(-x)), rounded before the product (bf16). */
#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE, ROUND)                                                           \
    int NAME(const T *gate_up, int64_t gu_stride, T *out, int64_t out_stride, int64_t rows, int64_t inter,     \
             int num_threads) {                                                                                \
        _Pragma("omp parallel for num_threads(num_threads) if (rows * inter >= PARALLEL_MIN)")                \
        for (int64_t r = 0; r < rows; ++r) {                                                                   \
            const T *g = gate_up + r * gu_stride, *u = g + inter;                                              \
            T *o = out + r * out_stride;                                                                       \
            _Pragma("omp simd") for (int64_t i = 0; i < inter; ++i) {                                          \
                const float x = LOAD(g + i);                                                                   \
                STORE(o + i, ROUND(x / (1.0f + expf(-x))) * LOAD(u + i));                                      \
            }                                                                                                  \
        }                                                                                                      \
        return 0;                                                                                              \
    }

/* out[r] = the index of the first maximum of row r of x ([rows, n], stride elements a row), as
 * torch.argmax: a NaN counts as the maximum (the first NaN wins). Greedy sampling's argmax
 * over the vocabulary: torch's max(dim) takes 0.9-2.2 ms for 64 x 49152 on two threads, a
 * vectorized pass for the maximum, then a search block by block, about 0.3 ms. */
#define ARGMAX_BLOCK 64
int argmax_rows_f32(const float *x, int64_t stride, int64_t rows, int64_t n, int64_t *out, int num_threads) {
    if (n < 1) return -1;
    _Pragma("omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_MIN)")
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * stride;
        float best = xr[0];
        int nan = 0;
        _Pragma("omp simd reduction(max : best) reduction(| : nan)") for (int64_t i = 0; i < n; ++i) {
            best = xr[i] > best ? xr[i] : best;
            nan |= xr[i] != xr[i];
        }
        int64_t found = 0;
        if (nan) { /* rare (a broken model): the first NaN, one by one */
            while (xr[found] == xr[found]) ++found;
        } else { /* the first block that holds the maximum, then the place in it */
            for (int64_t start = 0; start < n; start += ARGMAX_BLOCK) {
                const int64_t end = start + ARGMAX_BLOCK < n ? start + ARGMAX_BLOCK : n;
                int hit = 0;
                _Pragma("omp simd reduction(| : hit)") for (int64_t i = start; i < end; ++i) hit |= xr[i] == best;
                if (!hit) continue;
                for (found = start; xr[found] != best; ++found) {
                }
                break;
            }
        }
        out[r] = found;
    }
    return 0;
}

DEFINE_RMS_NORM(rms_norm_f32, float, f32_load, f32_store, f32_round)
DEFINE_RMS_NORM(rms_norm_bf16, bf16, bf16_load, bf16_store, bf16_round)
DEFINE_ROPE_STORE(rope_store_f32, float, f32_load, f32_store, f32_round)
DEFINE_ROPE_STORE(rope_store_bf16, bf16, bf16_load, bf16_store, bf16_round)
DEFINE_SILU_MUL(silu_mul_f32, float, f32_load, f32_store, f32_round)
DEFINE_SILU_MUL(silu_mul_bf16, bf16, bf16_load, bf16_store, bf16_round)
