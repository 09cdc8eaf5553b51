// Shared device helpers of the vla_runtime kernels: element types, conversions, reductions.
//
// No CUDA header is included on purpose. 16-bit element types are plain storage structs
// converted with bit operations (bf16) or one PTX instruction (fp16), so that nvcc (the CI
// compile check) and NVRTC (CuPy at run time) compile exactly the same text, and no version
// coupling between CuPy's bundled cuda_fp16.h and the local cuda_bf16.h can break the build.
//
// The vla_runtime loader inlines this file into each kernel source before handing it to
// CuPy (`#include "..."` lines of local headers are replaced by their text), so CuPy's
// compile cache sees every change of a header.
#pragma once

struct bf16_t {
    unsigned short bits;
};

struct f16_t {
    unsigned short bits;
};

__device__ __forceinline__ float to_float(float v) { return v; }

__device__ __forceinline__ float to_float(bf16_t v) {
    return __uint_as_float(static_cast<unsigned int>(v.bits) << 16);
}

__device__ __forceinline__ float to_float(f16_t v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
}

template <typename T>
__device__ __forceinline__ T from_float(float v);

template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }

// Round to nearest even, NaN to the canonical quiet NaN: the rounding PyTorch applies when it
// stores a float as bfloat16, so that intermediates rounded here match the torch path's.
template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float v) {
    unsigned int u = __float_as_uint(v);
    bf16_t r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = 0x7fc0;
        return r;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    r.bits = static_cast<unsigned short>(u >> 16);
    return r;
}

template <>
__device__ __forceinline__ f16_t from_float<f16_t>(float v) {
    f16_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
    return r;
}

// A float rounded to the activation dtype and back: where the torch path stores an
// intermediate in the activation dtype, the kernels round at the same place.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
    return to_float(from_float<T>(v));
}

// Gemma's and SigLIP's tanh-approximated GELU, in fp32.
__device__ __forceinline__ float gelu_tanh(float x) {
    const float sqrt_2_over_pi = 0.7978845608028654f;
    const float kappa = 0.044715f;
    return 0.5f * x * (1.0f + tanhf(sqrt_2_over_pi * (x + kappa * x * x * x)));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
// `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int warps = blockDim.x / 32;
    v = warp_sum(v);
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    float total = lane < warps ? scratch[lane] : 0.0f;
    total = warp_sum(total);
    __syncthreads();  // scratch may be reused by the caller
    return total;
}
