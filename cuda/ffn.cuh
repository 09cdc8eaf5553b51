// Building blocks of the Gemma MLP kernels (masked_ffn.cu, selected_row_ffn.cu).
//
// Weight layout (vla_runtime.models.gemma.GemmaMLP): `gate_up` is [mlp_dim / B, 2B, W], block c
// holding the gate rows then the up rows of neurons [c*B, (c+1)*B); `down_t` is [mlp_dim, W],
// row n being neuron n's output row. So any neuron's three weight rows are contiguous and a
// kernel given a neuron index reads them in place: nothing is gathered into a copy.
//
// Both stages keep fp32 accumulators and round to the activation dtype exactly where the torch
// path stores an intermediate (projection outputs, GELU output, product, subtraction, the
// down projection's output after each block), so the two agree up to summation order.
#pragma once

#include "vla_common.cuh"

// Activation of one neuron for one row, in lane 0 of the calling warp (all 32 lanes call it):
// round(round(gelu(round(x.gate_n))) * round(x.up_n)).
template <typename T>
__device__ __forceinline__ float gated_unit(const T* x_row, const T* gate_up, long long neuron, int width,
                                            int block) {
    const int lane = threadIdx.x % 32;
    const long long c = neuron / block;
    const long long j = neuron % block;
    const T* gate = gate_up + (c * 2 * block + j) * width;
    const T* up = gate + static_cast<long long>(block) * width;
    float g = 0.0f;
    float u = 0.0f;
    for (int i = lane; i < width; i += 32) {
        const float xv = to_float(x_row[i]);
        g += xv * to_float(gate[i]);
        u += xv * to_float(up[i]);
    }
    g = warp_sum(g);
    u = warp_sum(u);
    const float act = round_to<T>(gelu_tanh(round_to<T>(g)));
    return round_to<T>(act * round_to<T>(u));
}

// Stage 1, launched as grid (neurons, ceil(rows / warps per block)), one warp per (row, neuron):
// act[r, k] = gated_unit(x[row r], neuron k) (- sub[r, k]).
// `x_rows` (nullable) maps r to a row of x; `neurons` (nullable) maps k to a neuron index.
template <typename T>
__device__ __forceinline__ void gated_activations(const T* x, const long long* x_rows, const T* gate_up,
                                                  const long long* neurons, const T* sub, float* act, int rows,
                                                  int units, int width, int block) {
    const int warps = blockDim.x / 32;
    const int k = blockIdx.x;
    const int r = blockIdx.y * warps + threadIdx.x / 32;
    if (k >= units || r >= rows) {
        return;  // whole warps leave together: warp_sum below stays convergent
    }
    const long long row = x_rows ? x_rows[r] : r;
    const long long neuron = neurons ? neurons[k] : k;
    float h = gated_unit<T>(x + row * width, gate_up, neuron, width, block);
    if (threadIdx.x % 32 == 0) {
        const long long at = static_cast<long long>(r) * units + k;
        if (sub) {
            h = round_to<T>(h - to_float(sub[at]));
        }
        act[at] = h;
    }
}

// Rows of output each thread of the down projection accumulates (register tile).
#define VLA_DOWN_ROWS 4

// Stage 2, launched as grid (ceil(W / threads), ceil(rows / VLA_DOWN_ROWS)), one thread per
// output column and VLA_DOWN_ROWS rows:
// out[out_row(r), w] = base[r, w] + sum_k act[r, k] * down_t[neuron(k), w],
// with the running output rounded to T after every `chunk` neurons (the torch path's blocked
// `addmm_` into an output of the activation dtype). `base`, `neurons`, `out_rows` are nullable.
template <typename T>
__device__ __forceinline__ void down_projection(const float* act, int rows, int units, const T* down_t,
                                                const long long* neurons, int width, int chunk, const T* base,
                                                T* out, const long long* out_rows) {
    const int w = blockIdx.x * blockDim.x + threadIdx.x;
    const int r0 = blockIdx.y * VLA_DOWN_ROWS;
    if (w >= width || r0 >= rows) {
        return;
    }
    const int nr = min(VLA_DOWN_ROWS, rows - r0);
    float res[VLA_DOWN_ROWS];
    float acc[VLA_DOWN_ROWS];
#pragma unroll
    for (int i = 0; i < VLA_DOWN_ROWS; ++i) {
        res[i] = (base && i < nr) ? to_float(base[static_cast<long long>(r0 + i) * width + w]) : 0.0f;
    }
    for (int k0 = 0; k0 < units; k0 += chunk) {
        const int k1 = min(k0 + chunk, units);
#pragma unroll
        for (int i = 0; i < VLA_DOWN_ROWS; ++i) {
            acc[i] = 0.0f;
        }
        for (int k = k0; k < k1; ++k) {
            const long long neuron = neurons ? neurons[k] : k;
            const float d = to_float(down_t[neuron * width + w]);
#pragma unroll
            for (int i = 0; i < VLA_DOWN_ROWS; ++i) {
                if (i < nr) {
                    acc[i] += act[static_cast<long long>(r0 + i) * units + k] * d;
                }
            }
        }
#pragma unroll
        for (int i = 0; i < VLA_DOWN_ROWS; ++i) {
            res[i] = round_to<T>(res[i] + acc[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < VLA_DOWN_ROWS; ++i) {
        if (i < nr) {
            const long long row = out_rows ? out_rows[r0 + i] : r0 + i;
            out[row * width + w] = from_float<T>(res[i]);
        }
    }
}
