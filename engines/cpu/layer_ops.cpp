// The layers' element-wise steps of the engine's CPU library (shared definitions:
// kernels.h), each in one pass: RMSNorm (after a residual addition), SiLU(gate) * up,
// rotary embedding with the write of K and V into the pool; and each row's first
// maximum (greedy sampling), as torch.argmax picks it.
#include "kernels.h"

using namespace zpd;

namespace {

// The layers' element-wise steps, float32 or bfloat16, rounding to the storage dtype
// where torch's own ops do (after each op), so they give torch's results to within
// float32 reordering. Rows are shared among threads when there are enough of them.
template <typename T>
inline float rounded(float x) {            // x as stored in T, back in float32
    T t;
    store(&t, x);
    return to_float(t);
}

constexpr int64_t kRowsPerThread = 16;

// out = weight * T(s * rsqrt(mean(s^2) + eps)), s = x (+ residual, stored in T into `sum`)
template <typename T>
void rms_norm(const T *x, const T *residual, const T *weight, float eps, T *out, T *sum,
              int64_t rows, int64_t dim, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= kRowsPerThread * 2)
    for (int64_t r = 0; r < rows; r++) {
        const T *xr = x + r * dim;
        float ss = 0.f;
        if (residual) {
            T *sr = sum + r * dim;
            for (int64_t d = 0; d < dim; d++) {
                store(sr + d, to_float(xr[d]) + to_float(residual[r * dim + d]));
                const float v = to_float(sr[d]);
                ss += v * v;
            }
            xr = sr;                                   // the rounded sum is what is normed
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t d = 0; d < dim; d++) ss += to_float(xr[d]) * to_float(xr[d]);
        }
        const float inv = 1.f / std::sqrt(ss / float(dim) + eps);
        T *o = out + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) store(o + d, to_float(weight[d]) * rounded<T>(to_float(xr[d]) * inv));
    }
}

// out[r, i] = T(silu(gate)) * up, gate_up = [rows, 2 * inter] (gate first)
template <typename T>
void silu_mul(const T *gate_up, T *out, int64_t rows, int64_t inter, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= kRowsPerThread * 2)
    for (int64_t r = 0; r < rows; r++) {
        const T *g = gate_up + r * 2 * inter, *u = g + inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            const float x = to_float(g[i]);
            store(out + r * inter + i, rounded<T>(x / (1.f + expf(-x))) * to_float(u[i]));
        }
    }
}

// Rotary embedding of queries and keys from the fused projection qkv [rows, (hq + 2 hkv) D]
// (half-split convention, x * cos + roll(x) * sin with the sign in sin's table, each
// product rounded to T as torch's ops round them); rotated queries to q [rows, hq, D],
// rotated keys and the values to pool rows write_rows[r] of k_pool and v_pool (and the
// rotated keys to k_out [rows, hkv, D] too where it is given: a prefill attends to them).
template <typename T>
int rope_write(const T *qkv, const T *cos, const T *sin, const int64_t *write_rows, int64_t pool_rows,
               int64_t rows, int64_t hq, int64_t hkv, int64_t D, T *q, T *k_pool, T *v_pool,
               T *k_out, int threads) {
    if (D % 2 || D > kMaxHeadDim) return kBadShape;
    for (int64_t r = 0; r < rows; r++)
        if (write_rows[r] < 0 || write_rows[r] >= pool_rows) return kBadRow;
    const int64_t width = (hq + 2 * hkv) * D, half = D / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= kRowsPerThread * 2)
    for (int64_t r = 0; r < rows; r++) {
        const T *src = qkv + r * width, *c = cos + r * D, *s = sin + r * D;
        for (int64_t h = 0; h < hq + hkv; h++) {
            const T *x = src + h * D;
            T *dst = h < hq ? q + (r * hq + h) * D : k_pool + (write_rows[r] * hkv + h - hq) * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) {
                const float rolled = to_float(x[d < half ? d + half : d - half]);
                store(dst + d, rounded<T>(to_float(x[d]) * to_float(c[d]))
                                   + rounded<T>(rolled * to_float(s[d])));
            }
            if (h >= hq && k_out) std::memcpy(k_out + (r * hkv + h - hq) * D, dst, sizeof(T) * D);
        }
        std::memcpy(v_pool + write_rows[r] * hkv * D, src + (hq + hkv) * D, sizeof(T) * hkv * D);
    }
    return kOk;
}

// out[r] = index of the first maximum of row r of x [rows, n], a NaN counting as the
// maximum (torch.argmax's answer). The NaN test looks at the bits, which -ffast-math
// cannot assume away; the maximum and then its first position are found by vector
// passes (a block of 64 at a time, scanned only where it holds the maximum).
inline bool is_nan(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return (u & 0x7fffffffu) > 0x7f800000u;
}

template <typename T>
int64_t row_argmax(const T *x, int64_t n) {
    int nan = 0;
    float top = to_float(x[0]);
#pragma omp simd reduction(| : nan) reduction(max : top)
    for (int64_t i = 0; i < n; i++) {
        const float v = to_float(x[i]);
        nan |= int(is_nan(v));
        top = v > top ? v : top;
    }
    if (nan) {
        for (int64_t i = 0; i < n; i++)
            if (is_nan(to_float(x[i]))) return i;
    }
    constexpr int64_t kBlock = 64;
    for (int64_t b = 0; b < n; b += kBlock) {
        const int64_t end = b + kBlock < n ? b + kBlock : n;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = b; i < end; i++) hit |= int(to_float(x[i]) == top);
        if (hit) {
            for (int64_t i = b; i < end; i++)
                if (to_float(x[i]) == top) return i;
        }
    }
    return 0;                                        // not reached: the maximum is in the row
}

template <typename T>
void argmax_rows(const T *x, int64_t rows, int64_t n, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * n, n);
}

}  // namespace

extern "C" {

#define ZPD_ELEMENTWISE(name, T)                                                                  \
    void zpd_rms_norm_##name(const T *x, const T *residual, const T *weight, float eps, T *out,  \
                             T *sum, int64_t rows, int64_t dim, int threads) {                   \
        rms_norm(x, residual, weight, eps, out, sum, rows, dim, threads);                        \
    }                                                                                             \
    void zpd_silu_mul_##name(const T *gate_up, T *out, int64_t rows, int64_t inter, int threads) { \
        silu_mul(gate_up, out, rows, inter, threads);                                            \
    }                                                                                             \
    void zpd_argmax_##name(const T *x, int64_t rows, int64_t n, int64_t *out, int threads) {     \
        argmax_rows(x, rows, n, out, threads);                                                   \
    }                                                                                             \
    int zpd_rope_write_##name(const T *qkv, const T *cos, const T *sin, const int64_t *write_rows,  \
                              int64_t pool_rows, int64_t rows, int64_t hq, int64_t hkv, int64_t D,  \
                              T *q, T *k_pool, T *v_pool, T *k_out, int threads) {                \
        return rope_write(qkv, cos, sin, write_rows, pool_rows, rows, hq, hkv, D, q, k_pool, v_pool, \
                          k_out, threads);                                                        \
    }
ZPD_ELEMENTWISE(float32, float)
ZPD_ELEMENTWISE(bfloat16, BF16)

}  // extern "C"
