// Context Cache selected-row FFN with scatter (rMuscle Eq. 3; vla_runtime.cache.context_cache).
//
// Only the rows chosen for recompute (the most-drifted visual tokens, plus the prompt tokens)
// go through the dense Gemma MLP; their outputs are scattered into `out`, which the caller has
// filled with the reference's FFN outputs, so the other rows keep the reference's values:
//     out[rows[i], :] = down(gelu_tanh(x[rows[i]] gate^T) * (x[rows[i]] up^T))
// The selected rows are read in place from x (no gathered copy) and written in place to out.
//
// Two launches (shapes chosen in vla_runtime/kernels/launch.py):
//   selected_row_ffn_act_<dt>   grid (mlp_dim, ceil(R / warps)), block 32 * warps
//       act[i, n] = h(x[rows[i]])_n                                           (fp32 scratch [R, H])
//   selected_row_ffn_down_<dt>  grid (ceil(W / threads), ceil(R / VLA_DOWN_ROWS)), block threads
//       out[rows[i], :] = act[i, :] @ down_t, rounded after every MLP block of B neurons, as
//       GemmaMLP's blocked loop (mm, then addmm_ per block) rounds its output
#include "ffn.cuh"

#define VLA_SELECTED_ROW_FFN(SUFFIX, T)                                                                       \
    extern "C" __global__ void selected_row_ffn_act_##SUFFIX(const T* x, const long long* rows_idx,            \
                                                             const T* gate_up, float* act, int n_rows,         \
                                                             int mlp_dim, int width, int block) {              \
        gated_activations<T>(x, rows_idx, gate_up, nullptr, nullptr, act, n_rows, mlp_dim, width, block);     \
    }                                                                                                         \
    extern "C" __global__ void selected_row_ffn_down_##SUFFIX(const float* act, const T* down_t,               \
                                                              const long long* rows_idx, T* out, int n_rows,   \
                                                              int mlp_dim, int width, int block) {             \
        down_projection<T>(act, n_rows, mlp_dim, down_t, nullptr, width, block, nullptr, out, rows_idx);      \
    }

VLA_SELECTED_ROW_FFN(f32, float)
VLA_SELECTED_ROW_FFN(bf16, bf16_t)
VLA_SELECTED_ROW_FFN(f16, f16_t)
