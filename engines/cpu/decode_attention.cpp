// Decode attention of the engine's CPU library (shared definitions: kernels.h),
// read straight from the paged KV pool. torch's path gathers every sequence's K and V
// out of the pool into a dense copy, then multiplies; here each (sequence, KV head) pair
// walks its own pool rows once for the scores and once for the weighted sum of V, in
// float32 whatever the storage dtype, and the pairs are shared among OpenMP threads
// (torch's own runtime: the library links the libgomp.so.1 torch has loaded). See
// engines/cpu/kernels.py for the arguments. Its softmax's exp loop calls glibc's vector
// expf.
#include "kernels.h"

using namespace zpd;

namespace {

constexpr int64_t kAhead = 4;          // positions to prefetch ahead

inline void prefetch(const void *p, int64_t bytes) {
    const char *c = static_cast<const char *>(p);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

template <typename T>
inline void load_row(const T *src, float *dst, int64_t D) {
#pragma omp simd
    for (int64_t d = 0; d < D; d++) dst[d] = to_float(src[d]);
}

// Query heads [h0 * G, h1 * G) of one sequence, over its n >= 1 positions: each
// position's K (then V) rows of KV heads h0..h1-1 are adjacent in the pool, read as one
// run, and the rows a few positions ahead are prefetched (pages lie anywhere in the pool).
// work: room for (h1 - h0) * G * (n + 2 * D) floats.
template <typename T>
void attend(const T *q, const T *k, const T *v, const int64_t *rows, int64_t n,
            int64_t kv_heads, int64_t h0, int64_t h1, int64_t G, int64_t D, float scale, T *out,
            float *work) {
    const int64_t H = (h1 - h0) * G, span = (h1 - h0) * D;     // query heads; elements per run
    float *scores = work, *qf = work + H * n, *acc = qf + H * D;
    alignas(64) float row[kMaxHeadDim];
    for (int64_t i = 0; i < H; i++) {
        load_row(q + i * D, qf + i * D, D);
        for (int64_t d = 0; d < D; d++) { qf[i * D + d] *= scale; acc[i * D + d] = 0.f; }
    }
    // f(s, h, row) for each position s and KV head h (of h0..h1-1), `row` that head's
    // K or V at s in float32; the pool rows kAhead positions on are prefetched
    auto each_row = [&](const T *pool, auto f) {
        for (int64_t s = 0; s < n; s++) {
            if (s + kAhead < n) prefetch(pool + (rows[s + kAhead] * kv_heads + h0) * D, span * sizeof(T));
            const T *run = pool + (rows[s] * kv_heads + h0) * D;
            for (int64_t h = 0; h < h1 - h0; h++) {
                load_row(run + h * D, row, D);
                f(s, h, row);
            }
        }
    };
    each_row(k, [&](int64_t s, int64_t h, const float *kr) {            // scores = q . k
        for (int64_t g = 0; g < G; g++) {
            const float *qi = qf + (h * G + g) * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; d++) dot += qi[d] * kr[d];
            scores[(h * G + g) * n + s] = dot;
        }
    });
    for (int64_t i = 0; i < H; i++) {                        // softmax of each head's scores
        float *p = scores + i * n, top = p[0], sum = 0.f;
#pragma omp simd reduction(max : top)
        for (int64_t s = 1; s < n; s++) top = p[s] > top ? p[s] : top;
#pragma omp simd
        for (int64_t s = 0; s < n; s++) p[s] = expf(p[s] - top);
#pragma omp simd reduction(+ : sum)
        for (int64_t s = 0; s < n; s++) sum += p[s];
        const float inv = 1.f / sum;                         // sum >= 1: the maximum's term is 1
#pragma omp simd
        for (int64_t s = 0; s < n; s++) p[s] *= inv;
    }
    each_row(v, [&](int64_t s, int64_t h, const float *vr) {            // out = softmax . v
        for (int64_t g = 0; g < G; g++) {
            const float w = scores[(h * G + g) * n + s];
            float *a = acc + (h * G + g) * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) a[d] += w * vr[d];
        }
    });
    for (int64_t i = 0; i < H; i++)
        for (int64_t d = 0; d < D; d++) store(out + i * D + d, acc[i * D + d]);
}

template <typename T>
int decode_attention(const T *q, const T *k, const T *v, int64_t pool_rows, const int64_t *rows,
                     const int64_t *lengths, int64_t batch, int64_t width, int64_t q_heads,
                     int64_t kv_heads, int64_t D, float scale, T *out, int threads) {
    if (batch < 0 || width < 1 || kv_heads < 1 || q_heads % kv_heads || D < 1 || D > kMaxHeadDim
        || threads < 1)
        return kBadShape;
    const int64_t G = q_heads / kv_heads;
    for (int64_t b = 0; b < batch; b++) {                    // every read inside the pool
        if (lengths[b] < 1 || lengths[b] > width) return kBadShape;
        for (int64_t s = 0; s < lengths[b]; s++) {
            const int64_t r = rows[b * width + s];
            if (r < 0 || r >= pool_rows) return kBadRow;
        }
    }
    // a work item is one sequence with all its heads (reading whole runs of the pool), or,
    // when sequences are too few to keep the threads busy, one sequence and one KV head
    const int64_t per_item = batch >= threads ? kv_heads : 1, items = batch * (kv_heads / per_item);
    int status = kOk;
#pragma omp parallel num_threads(threads)
    {
        const int64_t H = per_item * G;
        float *work = static_cast<float *>(std::malloc(sizeof(float) * H * (width + 2 * D)));
        if (!work) {
#pragma omp atomic write
            status = kNoMemory;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            if (!work) continue;
            const int64_t b = item / (kv_heads / per_item), h0 = item % (kv_heads / per_item) * per_item;
            const int64_t first = b * q_heads + h0 * G;
            attend(q + first * D, k, v, rows + b * width, lengths[b], kv_heads, h0, h0 + per_item,
                   G, D, scale, out + first * D, work);
        }
        std::free(work);
    }
    return status;
}

}  // namespace

extern "C" {


int zpd_decode_attention_float32(const float *q, const float *k, const float *v,
                                 int64_t pool_rows, const int64_t *rows, const int64_t *lengths,
                                 int64_t batch, int64_t width, int64_t q_heads, int64_t kv_heads,
                                 int64_t head_dim, float scale, float *out, int threads) {
    return decode_attention(q, k, v, pool_rows, rows, lengths, batch, width, q_heads, kv_heads,
                            head_dim, scale, out, threads);
}

int zpd_decode_attention_bfloat16(const BF16 *q, const BF16 *k, const BF16 *v,
                                  int64_t pool_rows, const int64_t *rows, const int64_t *lengths,
                                  int64_t batch, int64_t width, int64_t q_heads, int64_t kv_heads,
                                  int64_t head_dim, float scale, BF16 *out, int threads) {
    return decode_attention(q, k, v, pool_rows, rows, lengths, batch, width, q_heads, kv_heads,
                            head_dim, scale, out, threads);
}

}  // extern "C"
