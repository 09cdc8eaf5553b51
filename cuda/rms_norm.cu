// RMSNorm and adaptive RMSNorm fused with the residual add (vla_runtime.models.layers.rms_norm,
// GemmaLayer / ExpertLayer in vla_runtime.models.gemma).
//
// One block per row of W features. In place on the residual stream, then the norm:
//     residual = residual + delta * gate        (gate: fp32 [W], null = 1; delta null = no add)
//     normed   = residual * rsqrt(mean(residual^2) + eps) * scale (+ shift)
// `scale` is the folded (1 + weight) or the adaRMS (1 + scale(t)), `shift` the adaRMS shift, both
// fp32 [W]. Statistics are accumulated in fp32 whatever the activation dtype (what keeps long
// bf16 runs from drifting). As in the torch path, the updated residual is rounded to the
// activation dtype before its statistics are taken, and the normed value is rounded once before
// the shift is added and once after.
//
//   fused_add_rms_norm_<dt>      grid (rows), block threads (a multiple of 32, <= 1024)
//   fused_add_ada_rms_norm_<dt>  same, with gate and shift
#include "vla_common.cuh"

template <typename T>
__device__ __forceinline__ void add_rms_norm_row(T* residual, const T* delta, const float* gate, const float* scale,
                                                 const float* shift, T* normed, int width, float eps) {
    __shared__ float scratch[32];
    const long long base = static_cast<long long>(blockIdx.x) * width;
    T* res = residual + base;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float v = to_float(res[i]);
        if (delta) {
            const float d = to_float(delta[base + i]);
            v = round_to<T>(v + (gate ? d * gate[i] : d));
            res[i] = from_float<T>(v);
        }
        sum_sq += v * v;
    }
    const float rstd = rsqrtf(block_sum(sum_sq, scratch) / static_cast<float>(width) + eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float y = round_to<T>(to_float(res[i]) * rstd * scale[i]);
        if (shift) {
            y = round_to<T>(y + shift[i]);
        }
        normed[base + i] = from_float<T>(y);
    }
}

#define VLA_RMS_NORM(SUFFIX, T)                                                                               \
    extern "C" __global__ void fused_add_rms_norm_##SUFFIX(T* residual, const T* delta, const float* scale,     \
                                                           T* normed, int width, float eps) {                  \
        add_rms_norm_row<T>(residual, delta, nullptr, scale, nullptr, normed, width, eps);                     \
    }                                                                                                         \
    extern "C" __global__ void fused_add_ada_rms_norm_##SUFFIX(T* residual, const T* delta, const float* gate,  \
                                                               const float* scale, const float* shift,         \
                                                               T* normed, int width, float eps) {              \
        add_rms_norm_row<T>(residual, delta, gate, scale, shift, normed, width, eps);                          \
    }

VLA_RMS_NORM(f32, float)
VLA_RMS_NORM(bf16, bf16_t)
VLA_RMS_NORM(f16, f16_t)
