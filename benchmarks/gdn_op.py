"""The Gated DeltaNet core alone (causal convolution, then the gated delta rule, reading and
writing a state slot): kiln's `kiln::gdn_core` against HF transformers' PyTorch reference
(`causal_conv1d_fn` / `causal_conv1d_update` and `torch_chunk_gated_delta_rule` /
`torch_recurrent_gated_delta_rule`, what Qwen3-Next runs without flash-linear-attention) on the
same inputs, in one run, interleaved, medians. Shapes: Qwen3-Next's GDN heads (16 key heads and
32 value heads of 128) by default; `--small` for a quick run.

With `--triton` (a CUDA GPU), the Triton core (`kiln::gdn_core_triton`) joins: its chunked
rule for prefills against its token-by-token form on the same inputs, and the PyTorch core and
HF's run on the GPU too.

    python benchmarks/gdn_op.py
    python benchmarks/gdn_op.py --small
    python benchmarks/gdn_op.py --triton --tokens 1 512 4096 16384"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import kiln.layers.gated_deltanet  # noqa: F401 - registers kiln::gdn_core

CHECK = "chunked vs token by token, max abs diff"


def _inputs(tokens: int, hk: int, hv: int, dk: int, dv: int, kernel: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    conv_dim = 2 * hk * dk + hv * dv
    mixed = torch.randn(tokens, conv_dim, generator=g)
    decay = -torch.rand(tokens, hv, generator=g)
    beta = torch.rand(tokens, hv, generator=g)
    weight = torch.randn(conv_dim, 1, kernel, generator=g) * 0.3
    return mixed, decay, beta, weight


def _kiln(mixed, decay, beta, weight, hk, dk, hv, dv, fresh: bool):
    tokens, device = mixed.shape[0], mixed.device
    conv = torch.zeros(1, weight.shape[0], weight.shape[-1] - 1, device=device)
    state = torch.zeros(1, hv, dk, dv, device=device)
    out = torch.empty(tokens, hv, dv, device=device)
    loc = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    lens = torch.tensor([tokens if fresh else tokens + 100], dtype=torch.int32, device=device)
    slots = torch.tensor([0], dtype=torch.int32, device=device)
    none = torch.tensor([-1], dtype=torch.int32, device=device)  # no checkpoint, no state rows
    saved_conv, saved_state = conv[:0], state[:0]  # no prefix-cache checkpoints
    return lambda: torch.ops.kiln.gdn_core(
        mixed, decay, beta, weight, conv, state, saved_conv, saved_state, out, loc, lens, slots,
        none, none, none, hk, dk,
    )  # fmt: skip


def _triton(mixed, decay, beta, weight, hk, dk, hv, dv, fresh: bool, up_to: int | None = None):
    """The Triton core from the same inputs; `up_to` raised past the tokens: token by token."""
    from kiln.layers import gdn_triton

    device, tokens = mixed.device, mixed.shape[0]
    conv = torch.zeros(1, weight.shape[0], weight.shape[-1] - 1, device=device)
    state = torch.zeros(1, hv, dk, dv, device=device)
    out = torch.empty(tokens, hv, dv, device=device)
    meta = [torch.tensor(v, dtype=torch.int32, device=device) for v in
            ([0, tokens], [tokens if fresh else tokens + 100], [0], [-1], [-1], [-1])]  # fmt: skip
    rule = {} if up_to is None else {"token_by_token_up_to": up_to}

    def run():
        gdn_triton.gdn_core_triton(mixed, decay, beta, weight, conv, state, conv[:0], state[:0],
                                   out, *meta, hk, dk, **rule)  # fmt: skip

    run.out = out  # the outputs of the last call, for the check of the two forms
    return run


def _hf(mixed, decay, beta, weight, hk, dk, hv, dv, fresh: bool):
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    tokens, per_key = mixed.shape[0], hv // hk
    conv_state = torch.zeros(1, weight.shape[0], weight.shape[-1] - 1, device=mixed.device)
    state = torch.zeros(1, hv, dk, dv, device=mixed.device)

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
    _sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync()
    rounds.append((time.perf_counter() - start) / repeats * 1e3)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _functions(inputs, hk, dk, hv, dv, fresh: bool, triton: bool) -> dict:
    fns = {"kiln": _kiln(*inputs, hk, dk, hv, dv, fresh), "hf": _hf(*inputs, hk, dk, hv, dv, fresh)}
    if triton:
        n = inputs[0].shape[0]
        fns["triton"] = _triton(*inputs, hk, dk, hv, dv, fresh)
        fns["triton token by token"] = _triton(*inputs, hk, dk, hv, dv, fresh, up_to=n)
    return fns


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="4 key / 8 value heads of 64")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 512, 2048])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--triton", action="store_true", help="on a CUDA GPU: the Triton core too")
    args = p.parse_args(argv)
    if args.triton and not torch.cuda.is_available():
        raise SystemExit("--triton times the Triton core on a CUDA GPU; none is visible")
    device = torch.device("cuda" if args.triton else "cpu")
    hk, hv, dk, dv = (4, 8, 64, 64) if args.small else (16, 32, 128, 128)
    rows = []
    with torch.inference_mode():
        for n in args.tokens:
            inputs = [t.to(device) for t in _inputs(n, hk, hv, dk, dv, 4, n)]
            fresh = n > 1  # a prefill chunk from an empty state; one token: a decode
            fns = _functions(inputs, hk, dk, hv, dv, fresh, args.triton)
            times = {name: [] for name in fns}
            repeats = max(2, 256 // n)
            for r in range(args.rounds):
                for name in sorted(fns, reverse=r % 2 == 1):
                    _median_ms(fns[name], repeats, times[name])
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append({"tokens": n, **{k: round(v, 3) for k, v in med.items()}})
            if args.triton:  # the chunked rule against the recurrent form, same inputs
                diff = fns["triton"].out - fns["triton token by token"].out
                rows[-1][CHECK] = float(diff.abs().max())
    names = [name for name in rows[0] if name not in ("tokens", CHECK)]
    print("| tokens | " + " | ".join(f"{name} ms" for name in names) + " | hf / kiln |")
    print("| --- " * (len(names) + 2) + "|")
    for r in rows:
        cells = " | ".join(str(r[name]) for name in names)
        print(f"| {r['tokens']} | {cells} | {r['hf'] / r['kiln']:.2f}x |")
    for r in rows:
        if CHECK in r:
            print(f"{r['tokens']} tokens: {CHECK} {r[CHECK]:.2e}")
    print(json.dumps({"heads": [hk, hv, dk, dv], "device": device.type, "rows": rows}))
    return rows


if __name__ == "__main__":
    main()
