// What the CPU kernels' sources share (engines/cpu/decode_attention.cpp,
// prefill_attention.cpp, prefill_attention_bf16.cpp, products.cpp,
// panel_products.cpp, layer_ops.cpp, built into one library by
// engines/cpu/kernels.py): the status codes the Python side reads, bfloat16 storage, the
// exp of the attention kernels' softmax, the AMX tile state and the weight packings' loop.
//
// Compiled with -ffast-math (at compile time only, so the library does not switch the
// process's denormals off): reductions are reordered and vectorised. No infinity or NaN
// is relied on: a masked score is -1e30, a row's maximum starts at its first score, and
// every row holds at least one position.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define ZPD_AMX 1
#endif

namespace zpd {

constexpr int64_t kMaxHeadDim = 256;

enum Status { kOk = 0, kBadShape = -1, kNoMemory = -2, kBadRow = -3, kUnsupported = -4 };

struct BF16 { uint16_t bits; };

inline float to_float(float x) { return x; }
inline float to_float(BF16 x) {
    uint32_t u = uint32_t(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline void store(float *dst, float x) { *dst = x; }
inline void store(BF16 *dst, float x) {             // round to nearest even; NaN stays NaN
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { dst->bits = uint16_t((u >> 16) | 0x40); return; }
    dst->bits = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
constexpr float kMasked = -1e30f;           // finite: -ffast-math assumes no infinities
constexpr float kLog2e = 1.44269504f;

// 2^x for x <= 0 (-1e30 included: 0), as 2^n 2^f with n = round(x), |f| <= 1/2, 2^f by
// its Taylor series in f ln 2 to the 6th power (relative error ~1e-7), where glibc's
// vector expf over a stored row cost a quarter of the float32 kernel's time.
inline __m512 exp2_ps(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.69314718f));
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

// The online softmax's update of one row of a block's kKeys scores, in log2 units (the
// scale's product by log2 e applied): the row becomes 2^(s - m') in place, m' the row's
// new running maximum, and its running sum l gains them; returns 2^(m - m'), the factor
// for what the row's output has summed so far.
template <int64_t kKeys>
inline float softmax_update(float *srow, float &m, float &l) {
    __m512 s[kKeys / 16], most = _mm512_set1_ps(m), sums = _mm512_setzero_ps();
    for (int c = 0; c < kKeys / 16; c++) {
        s[c] = _mm512_load_ps(srow + 16 * c);
        most = _mm512_max_ps(most, s[c]);
    }
    const float top = _mm512_reduce_max_ps(most);
    const __m512 t = _mm512_set1_ps(top);
    for (int c = 0; c < kKeys / 16; c++) {
        const __m512 e = exp2_ps(_mm512_sub_ps(s[c], t));
        _mm512_store_ps(srow + 16 * c, e);
        sums = _mm512_add_ps(sums, e);
    }
    const float rescale = exp2f(m - top);     // glibc's: exp2_ps on one lane took longer
    l = l * rescale + _mm512_reduce_add_ps(sums);
    m = top;
    return rescale;
}
#endif

// Causal attention of one bfloat16 prompt by AVX512-BF16 dot products, where there is
// no AMX (engines/cpu/prefill_attention_bf16.cpp; the arguments of the float32 kernel)
int dot_causal_attention(const BF16 *q, const BF16 *k, const BF16 *v, int64_t k_stride,
                         int64_t v_stride, int64_t n, int64_t hq, int64_t hkv, int64_t D,
                         float scale, BF16 *out, int threads);

#if defined(ZPD_AMX)
struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

inline bool amx_permitted() {             // Linux hands out AMX state only to a process that asks
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                   18 /* XFEATURE_XTILEDATA */) == 0;
    return ok;
}

// GCC does not see ldtilecfg read the whole 64 bytes: without the barrier it dropped
// the stores of a config filled in a loop (tilezero then faulted on unconfigured tiles)
inline void load_tile_config(const TileConfig &c) {
    asm volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}
#endif

// The packings of engines/cpu/products.py (`AmxLinear.layout`, `PanelLinear.layout` say
// the same in torch), from a row-major w [N, K], written in order, blocks shared among
// threads: torch's strided copy took 5x (AMX) and 2.5x (panels) as long, and a weight
// update repacks every weight on the next step.
template <typename T, int64_t kOut, int64_t kIn>
inline void pack_blocks(const T *w, T *out, int64_t N, int64_t K, int threads,
                        void (*block)(const T *, T *, int64_t, int64_t, int64_t, int64_t)) {
    const int64_t blocks = (N + kOut - 1) / kOut;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) block(w, out + b * kOut * K, N, K, b * kOut, kIn);
}

#if defined(__AVX512BF16__)
// 16 bfloat16 values under `mask` to and from float32 lanes (bias and outputs of the
// bfloat16 panels and AMX products)
inline __m512 widen_bf16(__m256i halves) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}
inline __m512 load_bf16(const BF16 *p, __mmask16 mask) { return widen_bf16(_mm256_maskz_loadu_epi16(mask, p)); }
inline void store_bf16(BF16 *p, __mmask16 mask, __m512 v) {
    _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

}  // namespace zpd
