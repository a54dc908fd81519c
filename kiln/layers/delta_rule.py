"""The gated delta rule of Gated DeltaNet layers (Qwen3-Next, Qwen3.5), in float32 PyTorch: the
CPU path and the reference of any kernel.

Per head, a state S [key dim, value dim] is decayed and corrected by every token t:

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)
    o_t = S_t^T q_t

`recurrent` applies it token by token (decode). `chunked` applies it to blocks of C tokens with
matrix products (prefill): with gamma the cumulative log decay inside a block, the corrections
u of a block solve one unit lower-triangular system,

    (I + A) u = beta * (v - exp(gamma) K S_0),  A_ij = beta_i exp(gamma_i - gamma_j) k_i.k_j, j < i

and the block's outputs and end state follow from u and the state S_0 it started from. Both take
q and k already L2-normalised, q already scaled; heads are the leading dimension."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def recurrent(q, k, v, g, beta, state, states_after=None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [H, L, Dk]; v: [H, L, Dv]; g, beta: [H, L]; state: [H, Dk, Dv]. Returns the outputs
    [H, L, Dv] and the state after the last token, all float32. `states_after`, a list, gets
    the state after each token too."""
    out = v.new_empty(v.shape)
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        correction = (v[:, t] - torch.einsum("hk,hkv->hv", k[:, t], state)) * beta[:, t, None]
        state = state + k[:, t, :, None] * correction[:, None, :]
        out[:, t] = torch.einsum("hk,hkv->hv", q[:, t], state)
        if states_after is not None:
            states_after.append(state)
    return out, state


def chunked(q, k, v, g, beta, state, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `recurrent`, C = `chunk` tokens per matrix product."""
    length = q.shape[1]
    pad = -length % chunk
    if pad:  # padding tokens: no decay (g = 0) and no write (beta = 0)
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    heads, n = q.shape[0], q.shape[1] // chunk
    q, k, v = (x.reshape(heads, n, chunk, -1) for x in (q, k, v))
    gamma = g.reshape(heads, n, chunk).cumsum(-1)
    beta = beta.reshape(heads, n, chunk, 1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay from token j to token i of a block, zero above the diagonal (exp of -inf)
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    strictly_lower = (beta * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    system = strictly_lower + torch.eye(chunk, device=q.device)
    solve = lambda rhs: torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # noqa: E731
    u_free = solve(beta * v)  # the corrections when S_0 = 0 ...
    u_per_state = solve(beta * gamma.exp()[..., None] * k)  # ... minus this times S_0
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    out = v.new_empty(v.shape)
    for i in range(n):
        u = u_free[:, i] - u_per_state[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + scores[:, i] @ u
        state = state * gamma[:, i, -1].exp()[:, None, None] + k_to_end[:, i].transpose(-1, -2) @ u
    return out.reshape(heads, n * chunk, -1)[:, :length], state


def causal_conv(x, weight, state) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of x [L, C] with kernels weight [C, W], continuing from the
    last W - 1 inputs `state` [C, W - 1]; then SiLU. Returns the output [L, C] and the new state."""
    width = weight.shape[1]
    extended = torch.cat([state, x.t()], dim=1)  # [C, W - 1 + L]
    out = F.conv1d(extended[None], weight[:, None, :], groups=weight.shape[0])[0]
    return F.silu(out.t()), extended[:, extended.shape[1] - (width - 1) :]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
