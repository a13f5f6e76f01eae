// The small-batch products' blocks (engines/cpu/products.cpp's 1-8 row kernel and the
// grouped experts of engines/cpu/experts.cpp): float32 and bfloat16 lanes and the block
// of R weight rows by M input rows.
#pragma once
#include "kernels.h"

namespace zpd {

// Small-batch products: y[M, N] = x[M, K] w[N, K]^T (+ bias[N]) for 1 <= M <= 8, w
// row-major. Each weight row is loaded once per vector of K and multiplied into all M
// rows (R x M independent accumulator chains), while the next R weight rows are
// prefetched; K's last elements are read through a mask. float32 by AVX-512 FMAs,
// bfloat16 by AVX512-BF16 dot products (32 pairs per instruction) with float32 sums.
#if defined(__AVX512F__)
struct Float32Lanes {
    using T = float;
    using Vec = __m512;
    static constexpr int64_t kStep = 16;
    static Vec load(const float *p) { return _mm512_loadu_ps(p); }
    static Vec load_first(const float *p, int64_t n) {
        return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
    }
    static __m512 madd(__m512 acc, Vec w, Vec x) { return _mm512_fmadd_ps(w, x, acc); }
};
#endif
#if defined(__AVX512BF16__)
struct BFloat16Lanes {
    using T = BF16;
    using Vec = __m512bh;
    static constexpr int64_t kStep = 32;
    static Vec load(const BF16 *p) { return (__m512bh)_mm512_loadu_si512(p); }
    static Vec load_first(const BF16 *p, int64_t n) {
        return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), p);
    }
    static __m512 madd(__m512 acc, Vec w, Vec x) { return _mm512_dpbf16_ps(acc, w, x); }
};
#endif

#if defined(__AVX512F__)
template <class L, int R, int M>
inline void product_block(const typename L::T *x, const typename L::T *w, const typename L::T *bias,
                          typename L::T *y, int64_t n, int64_t N, int64_t K) {
    __m512 acc[R][M];
    for (int i = 0; i < R; i++)
        for (int m = 0; m < M; m++) acc[i][m] = _mm512_setzero_ps();
    const typename L::T *base = w + n * K;
    const bool ahead = n + 2 * R <= N;
    int64_t k = 0;
    for (; k + L::kStep <= K; k += L::kStep) {
        typename L::Vec wv[R];
        for (int i = 0; i < R; i++) {
            if (ahead) _mm_prefetch(reinterpret_cast<const char *>(base + (R + i) * K + k), _MM_HINT_T0);
            wv[i] = L::load(base + i * K + k);
        }
        for (int m = 0; m < M; m++) {
            const typename L::Vec xv = L::load(x + m * K + k);
            for (int i = 0; i < R; i++) acc[i][m] = L::madd(acc[i][m], wv[i], xv);
        }
    }
    if (k < K) {
        for (int m = 0; m < M; m++) {
            const typename L::Vec xv = L::load_first(x + m * K + k, K - k);
            for (int i = 0; i < R; i++)
                acc[i][m] = L::madd(acc[i][m], L::load_first(base + i * K + k, K - k), xv);
        }
    }
    for (int i = 0; i < R; i++) {
        const float b = bias ? to_float(bias[n + i]) : 0.f;
        for (int m = 0; m < M; m++) store(y + m * N + n + i, _mm512_reduce_add_ps(acc[i][m]) + b);
    }
}
#endif

}  // namespace zpd
