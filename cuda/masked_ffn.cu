// Action Cache masked FFN update (rMuscle Eq. 4; vla_runtime.cache.action_cache).
//
// At a non-anchor denoising step only the K neurons of the group's mask M run:
//     y = y_anchor + (h_t[M] - h_anchor[M]) @ down_t[M],   h = gelu_tanh(x gate^T) * (x up^T)
// The kernels take the index vector M (int64) and read each selected neuron's gate, up and
// down rows in place from the model's blocked weights: no compact copy of the weights is
// gathered, per step or per group. `h_anchor` and `y_anchor` may be null: the result is then
// the plain contribution of the selected neurons, sum over n in M of h_n * down_t[n].
//
// Two launches (shapes chosen in vla_runtime/kernels/launch.py):
//   masked_ffn_act_<dt>   grid (K, ceil(T / warps)), block 32 * warps
//       act[t, k] = h_t[M[k]] (- h_anchor[t, k])                      (fp32 scratch [T, K])
//   masked_ffn_down_<dt>  grid (ceil(W / threads), ceil(T / VLA_DOWN_ROWS)), block threads
//       out[t, :] = y_anchor[t, :] + act[t, :] @ down_t[M]            (one rounding, like addmm)
#include "ffn.cuh"

#define VLA_MASKED_FFN(SUFFIX, T)                                                                         \
    extern "C" __global__ void masked_ffn_act_##SUFFIX(const T* x, const T* gate_up, const long long* neurons, \
                                                       const T* h_anchor, float* act, int rows, int k_sel,     \
                                                       int width, int block) {                                \
        gated_activations<T>(x, nullptr, gate_up, neurons, h_anchor, act, rows, k_sel, width, block);        \
    }                                                                                                         \
    extern "C" __global__ void masked_ffn_down_##SUFFIX(const float* act, const T* down_t,                     \
                                                        const long long* neurons, const T* y_anchor, T* out,   \
                                                        int rows, int k_sel, int width) {                      \
        down_projection<T>(act, rows, k_sel, down_t, neurons, width, k_sel > 0 ? k_sel : 1, y_anchor, out,    \
                           nullptr);                                                                          \
    }

VLA_MASKED_FFN(f32, float)
VLA_MASKED_FFN(bf16, bf16_t)
VLA_MASKED_FFN(f16, f16_t)
