"""The Gated DeltaNet core alone (causal convolution, then the gated delta rule, reading and
writing a state slot): kiln's `kiln::gdn_core` against HF transformers' PyTorch reference
(`causal_conv1d_fn` / `causal_conv1d_update` and `torch_chunk_gated_delta_rule` /
`torch_recurrent_gated_delta_rule`, what Qwen3-Next runs without flash-linear-attention) on the
same inputs, in one run, interleaved, medians. Shapes: Qwen3-Next's GDN heads (16 key heads and
32 value heads of 128) by default; `--small` for a quick run.

    python benchmarks/gdn_op.py
    python benchmarks/gdn_op.py --small"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import kiln.layers.gated_deltanet  # noqa: F401 - registers kiln::gdn_core


def _inputs(tokens: int, hk: int, hv: int, dk: int, dv: int, kernel: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    conv_dim = 2 * hk * dk + hv * dv
    mixed = torch.randn(tokens, conv_dim, generator=g)
    decay = -torch.rand(tokens, hv, generator=g)
    beta = torch.rand(tokens, hv, generator=g)
    weight = torch.randn(conv_dim, 1, kernel, generator=g) * 0.3
    return mixed, decay, beta, weight


def _kiln(mixed, decay, beta, weight, hk, dk, hv, dv, fresh: bool):
    tokens = mixed.shape[0]
    conv = torch.zeros(1, weight.shape[0], weight.shape[-1] - 1)
    state = torch.zeros(1, hv, dk, dv)
    out = torch.empty(tokens, hv, dv)
    loc = torch.tensor([0, tokens], dtype=torch.int32)
    lens = torch.tensor([tokens if fresh else tokens + 100], dtype=torch.int32)
    slots = torch.tensor([0], dtype=torch.int32)
    no_checkpoint = torch.tensor([-1], dtype=torch.int32)
    saved_conv, saved_state = conv[:0], state[:0]  # no prefix-cache checkpoints
    return lambda: torch.ops.kiln.gdn_core(
        mixed, decay, beta, weight, conv, state, saved_conv, saved_state, out, loc, lens, slots,
        no_checkpoint, no_checkpoint, hk, dk,
    )  # fmt: skip


def _hf(mixed, decay, beta, weight, hk, dk, hv, dv, fresh: bool):
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    tokens, per_key = mixed.shape[0], hv // hk
    conv_state = torch.zeros(1, weight.shape[0], weight.shape[-1] - 1)
    state = torch.zeros(1, hv, dk, dv)

    def run():
        x = mixed.t()[None]
        if tokens == 1 and not fresh:
            y = hf.causal_conv1d_update(x, conv_state.clone(), weight[:, 0], None, "silu")
        else:
            y = hf.causal_conv1d_fn(x, weight[:, 0], None, activation="silu")
        q, k, v = y[0].t().split([hk * dk, hk * dk, hv * dv], -1)
        q = q.reshape(1, tokens, hk, dk).repeat_interleave(per_key, 2)
        k = k.reshape(1, tokens, hk, dk).repeat_interleave(per_key, 2)
        rule = (
            hf.torch_recurrent_gated_delta_rule if tokens == 1 else hf.torch_chunk_gated_delta_rule
        )
        v_heads = v.reshape(1, tokens, hv, dv)
        return rule(q, k, v_heads, g=decay[None], beta=beta[None], initial_state=state,
                    output_final_state=True, use_qk_l2norm_in_kernel=True)  # fmt: skip

    return run


def _median_ms(fn, repeats: int, rounds: list[float]) -> None:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    rounds.append((time.perf_counter() - start) / repeats * 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="4 key / 8 value heads of 64")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 512, 2048])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    hk, hv, dk, dv = (4, 8, 64, 64) if args.small else (16, 32, 128, 128)
    rows = []
    with torch.inference_mode():
        for n in args.tokens:
            inputs = _inputs(n, hk, hv, dk, dv, 4, n)
            fresh = n > 1  # a prefill chunk from an empty state; one token: a decode
            fns = {"kiln": _kiln(*inputs, hk, dk, hv, dv, fresh),
                   "hf": _hf(*inputs, hk, dk, hv, dv, fresh)}  # fmt: skip
            times = {name: [] for name in fns}
            repeats = max(2, 256 // n)
            for r in range(args.rounds):
                for name in sorted(fns, reverse=r % 2 == 1):
                    _median_ms(fns[name], repeats, times[name])
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append({"tokens": n, **{k: round(v, 3) for k, v in med.items()}})
    print("| tokens | kiln ms | hf ms | hf / kiln |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['tokens']} | {r['kiln']} | {r['hf']} | {r['hf'] / r['kiln']:.2f}x |")
    print(json.dumps({"heads": [hk, hv, dk, dv], "rows": rows}))


if __name__ == "__main__":
    main()
