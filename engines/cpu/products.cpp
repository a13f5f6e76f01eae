// Matrix products of the engine's CPU library (shared definitions: kernels.h):
// - products of up to 8 rows by a row-major weight, float32 (AVX-512) or bfloat16
//   (AVX512-BF16);
// - bfloat16 products of any number of rows by a weight packed for AMX tiles, with its
//   packing (the panel products: panel_products.cpp).
#include "kernels.h"
#include "small_products.h"

using namespace zpd;

namespace {

#if defined(__AVX512F__)
template <class L, int M>
void product(const typename L::T *x, const typename L::T *w, const typename L::T *bias,
             typename L::T *y, int64_t N, int64_t K, int threads) {
    constexpr int R = M <= 2 ? 8 : 16 / M > 1 ? 16 / M : 1;      // R * M <= 16 accumulators
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n += R) {
        if (n + R <= N) {
            product_block<L, R, M>(x, w, bias, y, n, N, K);
        } else {
            for (int64_t i = n; i < N; i++) product_block<L, 1, M>(x, w, bias, y, i, N, K);
        }
    }
}

template <class L>
int linear(const typename L::T *x, const typename L::T *w, const typename L::T *bias,
           typename L::T *y, int64_t M, int64_t N, int64_t K, int threads) {
    if (M < 1 || M > 8 || N < 0 || K < 1 || threads < 1) return kBadShape;
    switch (M) {
        case 1: product<L, 1>(x, w, bias, y, N, K, threads); break;
        case 2: product<L, 2>(x, w, bias, y, N, K, threads); break;
        case 3: product<L, 3>(x, w, bias, y, N, K, threads); break;
        case 4: product<L, 4>(x, w, bias, y, N, K, threads); break;
        case 5: product<L, 5>(x, w, bias, y, N, K, threads); break;
        case 6: product<L, 6>(x, w, bias, y, N, K, threads); break;
        case 7: product<L, 7>(x, w, bias, y, N, K, threads); break;
        default: product<L, 8>(x, w, bias, y, N, K, threads); break;
    }
    return kOk;
}
#endif

// AMX: [N / 32][K / 32][2][16][16][2], element [b, s, h, r, n, j] = w[32 b + 16 h + n][32 s + 2 r + j]
void amx_pack_block(const BF16 *w, BF16 *out, int64_t N, int64_t K, int64_t n0, int64_t) {
    uint32_t *pairs = reinterpret_cast<uint32_t *>(out);     // [j] pairs move as one word
    for (int64_t s = 0; s < K / 32; s++)
        for (int64_t h = 0; h < 2; h++)
            for (int64_t r = 0; r < 16; r++)
                for (int64_t n = 0; n < 16; n++) {
                    const int64_t row = n0 + 16 * h + n;
                    uint32_t pair = 0;
                    if (row < N) std::memcpy(&pair, w + row * K + 32 * s + 2 * r, 4);
                    *pairs++ = pair;
                }
}

// bfloat16 products on AMX tiles: y[M, N] = x[M, K] w[N, K]^T (+ bias[N]), K a multiple of
// 32, w packed by engines/cpu/products.py (`AmxLinear.pack`) as [N / 32][K / 32][2][16][16][2]:
// for each 32 outputs and 32 inputs two 1 KB B tiles (outputs 0-15 and 16-31), each row
// of a tile the pair of inputs 2r, 2r + 1 for its 16 outputs, the layout TDPBF16PS reads.
// N is padded to 32 with zero rows. Threads share the blocks of 32 outputs; each block
// streams its packed weight once (prefetched kPackAhead steps ahead), multiplied into up
// to 32 rows of x at a time: tiles 0-3 hold float32 sums for rows 0-15 / 16-31 by outputs
// 0-15 / 16-31, tiles 4-5 those rows of x, 6-7 the weight's two tiles. Each call
// configures the tiles of the threads it runs on and releases them at the end, so
// oneDNN's AMX kernels, which configure their own on every call, are not disturbed.
#if defined(ZPD_AMX)
constexpr int64_t kPackAhead = 4;

void configure_tiles(int r0, int r1) {     // r0 rows in the first 16, r1 in the second
    TileConfig c;
    std::memset(&c, 0, sizeof c);
    c.palette = 1;
    auto set = [&](int tile, int rows) { c.rows[tile] = uint8_t(rows); c.colsb[tile] = 64; };
    set(0, r0), set(1, r0), set(4, r0), set(6, 16), set(7, 16);
    if (r1) set(2, r1), set(3, r1), set(5, r1);
    load_tile_config(c);
}

inline void prefetch_step(const BF16 *packed) {           // one step's two weight tiles
    const char *p = reinterpret_cast<const char *>(packed);
    for (int off = 0; off < 2048; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

// Rows m0..m0+mr-1 (mr <= 32) of outputs n0..n0+31 into `sums` [32][32].
void amx_block(const BF16 *x, const BF16 *packed, int64_t K, int64_t mr, float (*sums)[32]) {
    const int64_t steps = K / 32, stride = K * 2;
    _tile_zero(0);
    _tile_zero(1);
    if (mr > 16) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps; s++) {
            if (s + kPackAhead < steps) prefetch_step(packed + (s + kPackAhead) * 1024);
            _tile_loadd(4, x + s * 32, stride);
            _tile_loadd(5, x + 16 * K + s * 32, stride);
            _tile_loadd(6, packed + s * 1024, 64);
            _tile_loadd(7, packed + s * 1024 + 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(2, &sums[16][0], 128);
        _tile_stored(3, &sums[16][16], 128);
    } else {
        for (int64_t s = 0; s < steps; s++) {
            if (s + kPackAhead < steps) prefetch_step(packed + (s + kPackAhead) * 1024);
            _tile_loadd(4, x + s * 32, stride);
            _tile_loadd(6, packed + s * 1024, 64);
            _tile_loadd(7, packed + s * 1024 + 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
    _tile_stored(0, &sums[0][0], 128);
    _tile_stored(1, &sums[0][16], 128);
}

int amx_linear(const BF16 *x, const BF16 *packed, const BF16 *bias, BF16 *y, int64_t M, int64_t N,
               int64_t K, int threads) {
    if (M < 1 || N < 1 || K < 32 || K % 32 || threads < 1) return kBadShape;
    if (!amx_permitted()) return kUnsupported;
    const int64_t blocks = (N + 31) / 32;
#pragma omp parallel num_threads(threads)
    {
        alignas(64) float sums[32][32];
        int64_t configured = 0;                  // rows the tiles are set up for (0: none)
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < blocks; nb++) {
            const int64_t n0 = nb * 32, width = N - n0 < 32 ? N - n0 : 32;
            const __mmask16 lo = width >= 16 ? 0xffff : __mmask16((1u << width) - 1);
            const __mmask16 hi = width <= 16 ? 0 : __mmask16((1u << (width - 16)) - 1);
            const __m512 b0 = bias ? load_bf16(bias + n0, lo) : _mm512_setzero_ps();
            const __m512 b1 = bias ? load_bf16(bias + n0 + 16, hi) : _mm512_setzero_ps();
            for (int64_t m0 = 0; m0 < M; m0 += 32) {
                const int64_t mr = M - m0 < 32 ? M - m0 : 32;
                if (mr != configured) {
                    configure_tiles(int(mr < 16 ? mr : 16), int(mr > 16 ? mr - 16 : 0));
                    configured = mr;
                }
                amx_block(x + m0 * K, packed + nb * (K / 32) * 1024, K, mr, sums);
                for (int64_t m = 0; m < mr; m++) {
                    BF16 *out = y + (m0 + m) * N + n0;
                    store_bf16(out, lo, _mm512_add_ps(_mm512_load_ps(sums[m]), b0));
                    store_bf16(out + 16, hi, _mm512_add_ps(_mm512_load_ps(sums[m] + 16), b1));
                }
            }
        }
        if (configured) _tile_release();
    }
    return kOk;
}
#endif

}  // namespace

extern "C" {

int zpd_linear_float32(const float *x, const float *w, const float *bias, float *y, int64_t M,
                       int64_t N, int64_t K, int threads) {
#if defined(__AVX512F__)
    return linear<Float32Lanes>(x, w, bias, y, M, N, K, threads);
#else
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)threads;
    return kUnsupported;         // this CPU (or compiler) lacks AVX-512
#endif
}

int zpd_linear_bfloat16(const BF16 *x, const BF16 *w, const BF16 *bias, BF16 *y, int64_t M,
                        int64_t N, int64_t K, int threads) {
#if defined(__AVX512BF16__)
    return linear<BFloat16Lanes>(x, w, bias, y, M, N, K, threads);
#else
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)threads;
    return kUnsupported;         // this CPU (or compiler) lacks AVX512-BF16
#endif
}

int zpd_pack_amx_bfloat16(const BF16 *w, BF16 *out, int64_t N, int64_t K, int threads) {
    if (N < 1 || K < 32 || K % 32 || threads < 1) return kBadShape;
    pack_blocks<BF16, 32, 32>(w, out, N, K, threads, amx_pack_block);
    return kOk;
}

int zpd_linear_amx_bfloat16(const BF16 *x, const BF16 *packed, const BF16 *bias, BF16 *y,
                            int64_t M, int64_t N, int64_t K, int threads) {
#if defined(ZPD_AMX)
    return amx_linear(x, packed, bias, y, M, N, K, threads);
#else
    (void)x, (void)packed, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)threads;
    return kUnsupported;         // this CPU (or compiler) lacks AMX-BF16
#endif
}

}  // extern "C"
