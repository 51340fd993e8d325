"""Fused recurrent step kernels for CuPy: one kernel per timestep and layer for the LSTM's (and the tanh
RNN's) elementwise work, forward and backward, beside that step's one GEMM.

The unfused CuPy path launches 12 elementwise calls a step forward and 17 backward (~25 us of host
time each); these do the same float32 operations in the same order as :mod:`rnnlm.core.cells`'
unfused path, compiled without fused multiply-add contraction (``--fmad=false``), so their results
are bit-identical to it (``tests/test_gpu_step.py`` checks that on a GPU).

Layout (:class:`rnnlm.core.cells.Workspace`, step-major): ``z[t]`` (G H, B) row-major, gate k of unit
j, stream b at ``(k H + j) B + b``; ``c[t]``, ``tc[t]``, ``hs[t]``, ``dhs[t]`` (H, B). One thread per (j, b).
"""
from __future__ import annotations

import numpy as np

from . import backend

SOURCE = r"""
extern "C" {

// z = (z + wh) + bias  (cells._step_input: z += Whh h; z += bias), then, LSTM gate order (i, f, o, g):
// i, f, o = tanh(z / 2) / 2 + 1/2 as four float32 steps (s *= 0.5; tanh; s *= 0.5; s += 0.5), g = tanh(z);
// c = f cp + i g (two products, then their sum); tc = tanh(c); h = o tc. z keeps the activated gates.
__global__ void rnnlm_lstm_fwd_step(float* __restrict__ z, const float* __restrict__ wh,
                                    const float* __restrict__ bias, const float* __restrict__ cp,
                                    float* __restrict__ c, float* __restrict__ tc, float* __restrict__ h,
                                    const int H, const int B)
{
    const int n = blockDim.x * blockIdx.x + threadIdx.x;
    const int HB = H * B;
    if (n >= HB) return;
    const int at = n;                       // unit j = n / B, stream b = n % B: (j, b) of every gate block
    float a[4];
    for (int k = 0; k < 4; ++k) {
        const int q = k * HB + at;
        float v = z[q] + wh[q];
        v = v + bias[q];
        if (k < 3) {
            v = v * 0.5f;
            v = tanhf(v);
            v = v * 0.5f;
            v = v + 0.5f;
        } else {
            v = tanhf(v);
        }
        a[k] = v;
        z[q] = v;
    }
    float ct = a[1] * cp[n];
    const float ig = a[0] * a[3];
    ct = ct + ig;
    const float t = tanhf(ct);
    c[n] = ct;
    tc[n] = t;
    h[n] = a[2] * t;
}

// cells.lstm_backward's elementwise work of step t (before dh_next = Whh^T dz and the reset masks):
// dh = dhs + dh_next; do = dh tc; dc += (o - h tc) dh; di = dc g; dg = dc i; df = dc cp; dc = dc f;
// d{i,f,o} *= (1 - s) s; dg *= 1 - g g.
__global__ void rnnlm_lstm_bwd_step(const float* __restrict__ dhs, const float* __restrict__ dh_next,
                                    const float* __restrict__ z, const float* __restrict__ tc,
                                    const float* __restrict__ h, const float* __restrict__ cp,
                                    float* __restrict__ dc, float* __restrict__ dz,
                                    const int H, const int B)
{
    const int n = blockDim.x * blockIdx.x + threadIdx.x;
    const int HB = H * B;
    if (n >= HB) return;
    const int at = n;                       // unit j = n / B, stream b = n % B: (j, b) of every gate block
    const float i = z[at], f = z[HB + at], o = z[2 * HB + at], g = z[3 * HB + at];
    const float dh = dhs[n] + dh_next[n];
    const float t = tc[n];
    float d_o = dh * t;
    float tmp = h[n] * t;
    tmp = o - tmp;
    tmp = tmp * dh;
    float dcv = dc[n] + tmp;
    float di = dcv * g;
    float dg = dcv * i;
    float df = dcv * cp[n];
    dc[n] = dcv * f;
    float s;
    s = 1.0f - i; s = s * i; di = di * s;
    s = 1.0f - f; s = s * f; df = df * s;
    s = 1.0f - o; s = s * o; d_o = d_o * s;
    float gg = g * g;
    gg = 1.0f - gg;
    dg = dg * gg;
    dz[at] = di;
    dz[HB + at] = df;
    dz[2 * HB + at] = d_o;
    dz[3 * HB + at] = dg;
}

// tanh RNN: z = (z + wh) + bias; h = tanh(z) (z keeps the pre-activation, as cells.rnn_forward leaves it)
__global__ void rnnlm_rnn_fwd_step(float* __restrict__ z, const float* __restrict__ wh,
                                   const float* __restrict__ bias, float* __restrict__ h, const int N)
{
    const int n = blockDim.x * blockIdx.x + threadIdx.x;
    if (n >= N) return;
    float v = z[n] + wh[n];
    v = v + bias[n];
    z[n] = v;
    h[n] = tanhf(v);
}

// dh = dhs + dh_next; dz = (1 - h h) dh, as three float32 steps (h h; 1 - that; times dh)
__global__ void rnnlm_rnn_bwd_step(const float* __restrict__ dhs, const float* __restrict__ dh_next,
                                   const float* __restrict__ h, float* __restrict__ dz, const int N)
{
    const int n = blockDim.x * blockIdx.x + threadIdx.x;
    if (n >= N) return;
    const float dh = dhs[n] + dh_next[n];
    float v = h[n] * h[n];
    v = 1.0f - v;
    dz[n] = v * dh;
}

}
"""

OPTIONS = ("--fmad=false", "--std=c++17")
NAMES = ("rnnlm_lstm_fwd_step", "rnnlm_lstm_bwd_step", "rnnlm_rnn_fwd_step", "rnnlm_rnn_bwd_step")
_THREADS = 256
_module = {}


def _fn(cupy, name):
    dev = cupy.cuda.Device().id
    if dev not in _module:
        _module[dev] = cupy.RawModule(code=SOURCE, options=OPTIONS)
    return _module[dev].get_function(name)


def _launch(name, n, args):
    _fn(backend.xp_of(args[0]), name)(((n + _THREADS - 1) // _THREADS,), (_THREADS,), args)


def _check(*arrays):
    for a in arrays:
        if a.dtype != np.float32 or not a.flags.c_contiguous:
            raise ValueError("fused kernels take contiguous float32 arrays")


def lstm_forward_step(z, wh, bias, cp, c, tc, h):
    """z (4H, B) in: the step's input projection; out: its activated gates. wh = Whh h_prev (4H, B),
    bias (4H, B), cp (H, B) the incoming cell (masked at a reset); writes c, tc, h (H, B)."""
    _check(z, wh, bias, cp, c, tc, h)
    H, B = cp.shape
    _launch("rnnlm_lstm_fwd_step", H * B, (z, wh, bias, cp, c, tc, h, np.int32(H), np.int32(B)))


def lstm_backward_step(dhs, dh_next, z, tc, h, cp, dc, dz):
    """dz (4H, B) = the step's pre-activation gradients; dc (H, B) in: dL/dc_t, out: dL/dc_{t-1} before
    any reset mask."""
    _check(dhs, dh_next, z, tc, h, cp, dc, dz)
    H, B = cp.shape
    _launch("rnnlm_lstm_bwd_step", H * B, (dhs, dh_next, z, tc, h, cp, dc, dz, np.int32(H), np.int32(B)))


def rnn_forward_step(z, wh, bias, h):
    _check(z, wh, bias, h)
    _launch("rnnlm_rnn_fwd_step", h.size, (z, wh, bias, h, np.int32(h.size)))


def rnn_backward_step(dhs, dh_next, h, dz):
    _check(dhs, dh_next, h, dz)
    _launch("rnnlm_rnn_bwd_step", h.size, (dhs, dh_next, h, dz, np.int32(h.size)))
