// A mixture's routed experts in one call per layer (engines/cpu/experts.py): the (token,
// expert) pairs counting-sorted by expert, each chosen expert's MLP on its tokens in
// chunks of up to 8 rows by the small-batch products' blocks (small_products.h: each
// weight row read once per chunk, straight from the stacked row-major weights, no copy),
// and each token's outputs summed by its routing weights. Experts no token chose are not
// read. Threads share (chunk, 32 outputs) tiles, chunks of one expert side by side, so a
// thread streams whole experts' rows.
//
// Rounding follows torch's grouped reference (engines/torch_backend.py `experts`) up to
// the sum: the products in T, SiLU(gate) rounded to T times up rounded to T, the down
// product in T; the k weighted outputs of a token are summed in float32 and rounded once
// (the reference rounds after each product and addition).
#include <algorithm>
#include <vector>

#include "kernels.h"
#include "small_products.h"

using namespace zpd;

namespace {

#if defined(__AVX512F__)
constexpr int64_t kChunkRows = 8;    // rows the small-batch blocks take
constexpr int64_t kTile = 32;        // outputs of one work item

struct Chunk {
    int64_t expert, start, rows;     // rows start..start + rows of the sorted pairs
};

template <typename T>
inline float as_stored(float x) {    // x as stored in T, back in float32
    T t;
    store(&t, x);
    return to_float(t);
}

// y[m, n0..n1) = x[m] w[n0..n1)^T for M rows of x (row stride K) into y (row stride N).
template <class L, int M>
void tile(const typename L::T *x, const typename L::T *w, typename L::T *y, int64_t n0, int64_t n1,
          int64_t N, int64_t K) {
    constexpr int R = M <= 2 ? 8 : 16 / M > 1 ? 16 / M : 1;      // R * M <= 16 accumulators
    int64_t n = n0;
    for (; n + R <= n1; n += R) product_block<L, R, M>(x, w, nullptr, y, n, N, K);
    for (; n < n1; n++) product_block<L, 1, M>(x, w, nullptr, y, n, N, K);
}

template <class L>
void tile_rows(int64_t M, const typename L::T *x, const typename L::T *w, typename L::T *y, int64_t n0,
               int64_t n1, int64_t N, int64_t K) {
    switch (M) {
        case 1: tile<L, 1>(x, w, y, n0, n1, N, K); break;
        case 2: tile<L, 2>(x, w, y, n0, n1, N, K); break;
        case 3: tile<L, 3>(x, w, y, n0, n1, N, K); break;
        case 4: tile<L, 4>(x, w, y, n0, n1, N, K); break;
        case 5: tile<L, 5>(x, w, y, n0, n1, N, K); break;
        case 6: tile<L, 6>(x, w, y, n0, n1, N, K); break;
        case 7: tile<L, 7>(x, w, y, n0, n1, N, K); break;
        default: tile<L, 8>(x, w, y, n0, n1, N, K); break;
    }
}

// out[t] = sum_j weights[t, j] * mlp_{ids[t, j]}(x[t]), x [tokens, H]; gate_up [E, 2I, H]
// (gate rows, then up rows), down [E, H, I].
template <class L>
int experts(const typename L::T *x, const int64_t *ids, const float *weights, const typename L::T *gate_up,
            const typename L::T *down, typename L::T *out, int64_t tokens, int64_t k, int64_t E, int64_t H,
            int64_t I, int threads) {
    using T = typename L::T;
    if (tokens < 0 || k < 1 || E < 1 || H < 1 || I < 1 || threads < 1) return kBadShape;
    const int64_t P = tokens * k;
    std::vector<int64_t> next(E + 1, 0), order(P), pos(P);
    for (int64_t p = 0; p < P; p++) {
        if (ids[p] < 0 || ids[p] >= E) return kBadRow;
        next[ids[p] + 1]++;
    }
    for (int64_t e = 0; e < E; e++) next[e + 1] += next[e];       // each expert's first sorted row
    std::vector<Chunk> chunks;
    for (int64_t e = 0; e < E; e++)
        for (int64_t s = next[e]; s < next[e + 1]; s += kChunkRows)
            chunks.push_back({e, s, std::min(kChunkRows, next[e + 1] - s)});
    for (int64_t p = 0; p < P; p++) {                                // stable: pairs in token order
        const int64_t at = next[ids[p]]++;
        order[at] = p;
        pos[p] = at;
    }
    T *buf = static_cast<T *>(std::malloc(sizeof(T) * std::max<int64_t>(1, P * (2 * H + 3 * I))));
    if (buf == nullptr) return kNoMemory;
    T *xs = buf, *gu = xs + P * H, *h = gu + P * 2 * I, *ys = h + P * I;
    const int64_t C = chunks.size(), up_tiles = (2 * I + kTile - 1) / kTile, down_tiles = (H + kTile - 1) / kTile;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) std::memcpy(xs + p * H, x + order[p] / k * H, sizeof(T) * H);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < C * up_tiles; item++) {
            const Chunk &c = chunks[item / up_tiles];
            const int64_t n0 = item % up_tiles * kTile;
            tile_rows<L>(c.rows, xs + c.start * H, gate_up + c.expert * 2 * I * H, gu + c.start * 2 * I, n0,
                         std::min(2 * I, n0 + kTile), 2 * I, H);
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) {
            const T *g = gu + p * 2 * I, *u = g + I;
#pragma omp simd
            for (int64_t i = 0; i < I; i++) {
                const float v = to_float(g[i]);
                store(h + p * I + i, as_stored<T>(v / (1.f + expf(-v))) * to_float(u[i]));
            }
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < C * down_tiles; item++) {
            const Chunk &c = chunks[item / down_tiles];
            const int64_t n0 = item % down_tiles * kTile;
            tile_rows<L>(c.rows, h + c.start * I, down + c.expert * H * I, ys + c.start * H, n0,
                         std::min(H, n0 + kTile), H, I);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; t++) {
            T *o = out + t * H;
            for (int64_t d = 0; d < H; d++) {
                float sum = 0.f;
                for (int64_t j = 0; j < k; j++) sum += weights[t * k + j] * to_float(ys[pos[t * k + j] * H + d]);
                store(o + d, sum);
            }
        }
    }
    std::free(buf);
    return kOk;
}
#endif

}  // namespace

extern "C" {

int zpd_experts_float32(const float *x, const int64_t *ids, const float *weights, const float *gate_up,
                        const float *down, float *out, int64_t tokens, int64_t k, int64_t E, int64_t H,
                        int64_t I, int threads) {
#if defined(__AVX512F__)
    return experts<Float32Lanes>(x, ids, weights, gate_up, down, out, tokens, k, E, H, I, threads);
#else
    (void)x, (void)ids, (void)weights, (void)gate_up, (void)down, (void)out, (void)tokens, (void)k;
    (void)E, (void)H, (void)I, (void)threads;
    return kUnsupported;         // this CPU (or compiler) lacks AVX-512
#endif
}

int zpd_experts_bfloat16(const BF16 *x, const int64_t *ids, const float *weights, const BF16 *gate_up,
                         const BF16 *down, BF16 *out, int64_t tokens, int64_t k, int64_t E, int64_t H,
                         int64_t I, int threads) {
#if defined(__AVX512BF16__)
    return experts<BFloat16Lanes>(x, ids, weights, gate_up, down, out, tokens, k, E, H, I, threads);
#else
    (void)x, (void)ids, (void)weights, (void)gate_up, (void)down, (void)out, (void)tokens, (void)k;
    (void)E, (void)H, (void)I, (void)threads;
    return kUnsupported;         // this CPU (or compiler) lacks AVX512-BF16
#endif
}

}  // extern "C"
