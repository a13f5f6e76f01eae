// Causal attention of one bfloat16 prompt to itself where the CPU has AVX512-BF16 but
// no AMX (shared definitions: kernels.h; the caller is prefill_attention.cpp's
// bfloat16 entry). The float32 kernel's blocks (a KV head's G query heads by 64
// positions, keys in blocks of 64, the online softmax in AVX-512), with both products
// as dot products of bfloat16 pairs into float32 sums (VDPBF16PS): S = Q K^T pairs
// inputs along D, K packed once per call per KV head and block as [D / 2][64][2];
// O += P V pairs keys, V packed as [32][D][2], P rounded to bfloat16 first, as torch's
// flash attention and the AMX kernel do; the scale (times log2 e: the softmax takes
// base-2 scores) is applied to S, so Q stays as given.
#include "kernels.h"

namespace zpd {

#if defined(__AVX512BF16__)
namespace {

constexpr int64_t kQBlock = 64, kKBlock = 64, kRows = 6;

inline uint32_t pair_of(BF16 a, BF16 b) { return uint32_t(a.bits) | uint32_t(b.bits) << 16; }

inline BF16 rounded(float x) { BF16 b; store(&b, x); return b; }

// keys [D / 2][kKBlock][2] and values [kKBlock / 2][D][2] of keys 64 b.. of KV head h
// (zeros past n), as 32-bit pairs
void pack_block(const BF16 *k, const BF16 *v, int64_t k_stride, int64_t v_stride, int64_t n,
                int64_t D, int64_t h, int64_t b, uint32_t *keys, uint32_t *values) {
    const BF16 zero{0};
    auto at = [&](const BF16 *base, int64_t stride, int64_t key, int64_t d) {
        return key < n ? base[key * stride + h * D + d] : zero;
    };
    const int64_t k0 = b * kKBlock;
    for (int64_t dp = 0; dp < D / 2; dp++)
        for (int64_t j = 0; j < kKBlock; j++)
            keys[dp * kKBlock + j] = pair_of(at(k, k_stride, k0 + j, 2 * dp), at(k, k_stride, k0 + j, 2 * dp + 1));
    for (int64_t jp = 0; jp < kKBlock / 2; jp++)
        for (int64_t d = 0; d < D; d++)
            values[jp * D + d] = pair_of(at(v, v_stride, k0 + 2 * jp, d), at(v, v_stride, k0 + 2 * jp + 1, d));
}

inline __m512bh pairs(const uint32_t *p) { return (__m512bh)_mm512_load_si512(p); }
inline __m512bh broadcast(uint32_t pair) { return (__m512bh)_mm512_set1_epi32(int(pair)); }

template <int DV>                           // D = 16 DV
void dot_item(const BF16 *q, const uint32_t *keys, const uint32_t *values, int64_t hq, int64_t hkv,
              int64_t h, int64_t p0, int64_t p1, float scale, BF16 *out, float *work) {
    constexpr int64_t D = 16 * DV, kPV = 24 / DV, kPairs = D / 2;
    const int64_t G = hq / hkv, rows = (p1 - p0) * G, padded = (rows + kRows - 1) / kRows * kRows;
    const int64_t most = kQBlock * G + kRows;
    float *O = work, *S = O + most * D, *m = S + most * kKBlock, *l = m + most;
    uint32_t *Q = reinterpret_cast<uint32_t *>(l + most), *P = Q + most * kPairs;
    for (int64_t r = 0; r < padded; r++) {
        const BF16 *src = q + ((p0 + r / G) * hq + h * G + r % G) * D;
        for (int64_t dp = 0; dp < kPairs; dp++) Q[r * kPairs + dp] = r < rows ? pair_of(src[2 * dp], src[2 * dp + 1]) : 0;
        for (int64_t d = 0; d < D; d++) O[r * D + d] = 0.f;
        m[r] = kMasked;
        l[r] = 0.f;
    }
    const __m512 scaled = _mm512_set1_ps(scale * kLog2e);   // scores in log2 units
    for (int64_t k0 = 0, b = 0; k0 < p1; k0 += kKBlock, b++) {
        const int64_t nk = p1 - k0 < kKBlock ? p1 - k0 : kKBlock;
        const uint32_t *KP = keys + b * kPairs * kKBlock, *VP = values + b * (kKBlock / 2) * D;
        for (int64_t r = 0; r < padded; r += kRows) {      // S = scale log2(e) Q K^T, masked
            __m512 acc[kRows][kKBlock / 16];
            for (int i = 0; i < kRows; i++)
                for (int c = 0; c < kKBlock / 16; c++) acc[i][c] = _mm512_setzero_ps();
            for (int64_t dp = 0; dp < kPairs; dp++) {
                __m512bh kt[kKBlock / 16];
                for (int c = 0; c < kKBlock / 16; c++) kt[c] = pairs(KP + dp * kKBlock + 16 * c);
                for (int i = 0; i < kRows; i++) {
                    const __m512bh qv = broadcast(Q[(r + i) * kPairs + dp]);
                    for (int c = 0; c < kKBlock / 16; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], qv, kt[c]);
                }
            }
            for (int i = 0; i < kRows; i++) {
                float *srow = S + (r + i) * kKBlock;
                for (int c = 0; c < kKBlock / 16; c++) _mm512_store_ps(srow + 16 * c, _mm512_mul_ps(acc[i][c], scaled));
                const int64_t seen = r + i < rows ? p0 + (r + i) / G - k0 : -1;   // keys 0..seen
                for (int64_t j = seen + 1 > 0 ? seen + 1 : 0; j < kKBlock; j++) srow[j] = kMasked;
                for (int64_t j = nk; j < kKBlock; j++) srow[j] = kMasked;
            }
        }
        for (int64_t r = 0; r < padded; r += kPV) {        // softmax update, O += P V
            float rescale[kPV];
            for (int i = 0; i < kPV; i++) {
                float *srow = S + (r + i) * kKBlock;
                rescale[i] = softmax_update<kKBlock>(srow, m[r + i], l[r + i]);
                for (int64_t jp = 0; jp < kKBlock / 2; jp++)
                    P[i * (kKBlock / 2) + jp] = pair_of(rounded(srow[2 * jp]), rounded(srow[2 * jp + 1]));
            }
            __m512 acc[kPV][DV];
            for (int i = 0; i < kPV; i++)
                for (int c = 0; c < DV; c++)
                    acc[i][c] = _mm512_mul_ps(_mm512_load_ps(O + (r + i) * D + 16 * c), _mm512_set1_ps(rescale[i]));
            for (int64_t jp = 0; jp < (nk + 1) / 2; jp++) {
                __m512bh vj[DV];
                for (int c = 0; c < DV; c++) vj[c] = pairs(VP + jp * D + 16 * c);
                for (int i = 0; i < kPV; i++) {
                    const __m512bh p = broadcast(P[i * (kKBlock / 2) + jp]);
                    for (int c = 0; c < DV; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], p, vj[c]);
                }
            }
            for (int i = 0; i < kPV; i++)
                for (int c = 0; c < DV; c++) _mm512_store_ps(O + (r + i) * D + 16 * c, acc[i][c]);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        BF16 *dst = out + ((p0 + r / G) * hq + h * G + r % G) * D;
        const float inv = 1.f / l[r];                      // l >= 1: the maximum's term is 1
        for (int64_t d = 0; d < D; d++) store(dst + d, O[r * D + d] * inv);
    }
}

}  // namespace

int dot_causal_attention(const BF16 *q, const BF16 *k, const BF16 *v, int64_t k_stride,
                         int64_t v_stride, int64_t n, int64_t hq, int64_t hkv, int64_t D,
                         float scale, BF16 *out, int threads) {
    if (n < 1 || hkv < 1 || hq % hkv || threads < 1) return kBadShape;
    if (D != 64 && D != 128) return kUnsupported;
    const int64_t G = hq / hkv, blocks = (n + kQBlock - 1) / kQBlock, items = blocks * hkv;
    const int64_t kblocks = (n + kKBlock - 1) / kKBlock, most = kQBlock * G + kRows;
    const int64_t per_block = D * kKBlock / 2;               // pairs of one block's K (and of its V)
    const size_t work_bytes = (sizeof(float) * (most * D + most * kKBlock + 2 * most)
                               + sizeof(uint32_t) * (most * D / 2 + 24 * kKBlock) + 63) / 64 * 64;
    uint32_t *packed = static_cast<uint32_t *>(std::aligned_alloc(64, sizeof(uint32_t) * hkv * kblocks * 2 * per_block));
    if (!packed) return kNoMemory;
    uint32_t *keys = packed, *values = packed + hkv * kblocks * per_block;
    int status = kOk;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t hb = 0; hb < hkv * kblocks; hb++)
            pack_block(k, v, k_stride, v_stride, n, D, hb / kblocks, hb % kblocks,
                       keys + hb * per_block, values + hb * per_block);
        float *work = static_cast<float *>(std::aligned_alloc(64, work_bytes));
        if (!work) {
#pragma omp atomic write
            status = kNoMemory;
        }
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < items; item++) {      // later positions (more keys) first
            if (!work) continue;
            const int64_t b = blocks - 1 - item / hkv, h = item % hkv;
            const int64_t p0 = b * kQBlock, p1 = p0 + kQBlock < n ? p0 + kQBlock : n;
            const int64_t head = h * kblocks * per_block;
            if (D == 64) dot_item<4>(q, keys + head, values + head, hq, hkv, h, p0, p1, scale, out, work);
            else dot_item<8>(q, keys + head, values + head, hq, hkv, h, p0, p1, scale, out, work);
        }
        std::free(work);
    }
    std::free(packed);
    return status;
}
#else
int dot_causal_attention(const BF16 *q, const BF16 *k, const BF16 *v, int64_t k_stride,
                         int64_t v_stride, int64_t n, int64_t hq, int64_t hkv, int64_t D,
                         float scale, BF16 *out, int threads) {
    (void)q, (void)k, (void)v, (void)k_stride, (void)v_stride, (void)n, (void)hq, (void)hkv, (void)D;
    (void)scale, (void)out, (void)threads;
    return kUnsupported;         // this CPU (or compiler) lacks AVX512-BF16
}
#endif

}  // namespace zpd
