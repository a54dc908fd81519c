"""The linear layer interface; models only ever construct `Linear`. A checkpoint part that
arrives quantized (`QuantizedTensor`: GGUF Q4/Q8/Q6_K, GPTQ, AutoRound) is kept packed when every
part of the layer is and a kernel runs it (kiln/layers/packed_parts.py: one packed matrix, or
runs of parts in different formats each packed), else dequantized into the dense weight.

After loading, `finalize` picks the layout the device runs fastest. On the CPU a bf16 weight
on a CPU with AVX512-BF16 is packed in pairs for kiln's own kernel
(kiln/layers/bf16_kernel.py): 1.2-2x oneDNN at decode steps' few rows, level at a prefill
chunk's (docs/performance.md, "A bf16 kernel for the linears"), and on AMX tiles where the CPU
has them, 1.05-1.5x oneDNN's AMX path; `--cpu-linears onednn` keeps oneDNN.
Other weights take oneDNN's prepacked layout (the one Inductor's weight freezing uses), faster
than BLAS at every batch size measured (docs/performance.md, "Why the CPU kernels are what they
are"). Without oneDNN the weight is stored transposed ([in, out]), which BLAS streams faster than
[out, in] for 1-2 rows."""

import torch
import torch.nn.functional as F
from torch import nn

from kiln.errors import ModelLoadError
from kiln.layers.bf16_kernel import pack_pairs, pairs_linear, pairs_runs, unpack_pairs
from kiln.layers.packed import PackedWeight, QuantizedTensor
from kiln.layers.packed_parts import pack_parts


class Linear(nn.Module):
    """y = x W^T + b. `weight` is [out_features, in_features] while loading, like nn.Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        # or "pairs" (kiln's bf16 kernel), "onednn" (prepacked), "transposed", or a packed
        # module's layout ("int4", "q6_k", "parts")
        self.layout = "dense"
        self.packed: PackedWeight | None = None
        self.quantized_parts: dict[int, QuantizedTensor] = {}  # first row -> part, until packed
        self.fallback_reason: str | None = None  # why quantized parts were dequantized

    def load_weight(
        self, name: str, weight: torch.Tensor | QuantizedTensor, rows: slice | None = None
    ) -> None:
        """Copy `weight` into rows `rows` of this layer (fused layers load their parts by rows);
        quantized parts are kept until they cover the layer, then packed."""
        target = self.weight if rows is None else self.weight[rows]
        if tuple(weight.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(weight.shape)}, expected {tuple(target.shape)}"
            )
        if isinstance(weight, QuantizedTensor):
            self.quantized_parts[0 if rows is None else rows.start] = weight
            # packed as soon as the parts cover the layer: the load never holds every
            # layer's codes at once (the weight is on the model's device)
            if sum(p.shape[0] for p in self.quantized_parts.values()) == self.out_features:
                self._pack(self.weight.device)
            return
        target.copy_(weight)

    def load_bias(self, name: str, bias: torch.Tensor, rows: slice | None = None) -> None:
        if self.bias is None:
            raise ModelLoadError(f"tensor {name!r} is a bias but this layer was built without one")
        target = self.bias if rows is None else self.bias[rows]
        if tuple(bias.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(bias.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(bias)

    def finalize(self, device: torch.device) -> None:
        """Called once after every weight is loaded."""
        if self.quantized_parts:  # parts that never covered the layer: dequantized
            self._pack(device)
        if device.type != "cpu" or self.layout != "dense":
            return
        if pairs_runs(self.weight) and (self.bias is None or self.bias.dtype == torch.bfloat16):
            self.weight = nn.Parameter(pack_pairs(self.weight), requires_grad=False)
            self.layout = "pairs"
            return
        self.use_onednn()

    def use_onednn(self) -> None:
        """oneDNN's layout for a CPU weight that `finalize` gave kiln's bf16 kernel (or has not
        laid out yet): `--cpu-linears onednn`."""
        if self.layout == "pairs":
            self.weight = nn.Parameter(unpack_pairs(self.weight, self.out_features), False)
            self.layout = "dense"
        if self.layout != "dense":
            return
        packed = prepack_for_cpu(self.weight)
        if packed is not None:
            self.weight = nn.Parameter(packed, requires_grad=False)
            self.layout = "onednn"
        else:
            self.weight = nn.Parameter(self.weight.t().contiguous(), requires_grad=False)
            self.layout = "transposed"

    def _pack(self, device: torch.device) -> None:
        """Pack the quantized parts if they cover the layer in formats a kernel runs (runs of
        parts in different formats packed apart); otherwise dequantize them into the dense
        weight (the reason is kept for the report)."""
        starts = sorted(self.quantized_parts)
        parts = [self.quantized_parts[start] for start in starts]
        self.quantized_parts = {}
        self.packed, self.fallback_reason = pack_parts(parts, self.out_features, device)
        if self.packed is not None:
            self.weight = None  # type: ignore[assignment]
            self.layout = self.packed.layout
            return
        for start, part in zip(starts, parts):
            self.weight.data[start : start + part.shape[0]] = part.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x, self.bias)
        if self.layout == "pairs":
            return pairs_linear(x, self.weight, self.out_features, self.bias)
        if self.layout == "onednn":
            return onednn_linear(x, self.weight, self.bias)
        if self.layout == "transposed":
            if self.bias is None:
                return torch.matmul(x, self.weight)
            # addmm rounds once; matmul then + bias rounds twice (1.5 ulp in fp16)
            y = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
            return y.view(*x.shape[:-1], y.shape[-1])
        return F.linear(x, self.weight, self.bias)


def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs a `dtype` linear natively on this CPU: fp32 always, bf16 and fp16
    where the instruction set has them (emulated, they would be slower than BLAS)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return dtype == torch.float32


def slow_cpu_dtype(dtype: torch.dtype) -> str | None:
    """The warning for a half-precision dtype that oneDNN cannot run natively on this CPU (its
    linears fall back to BLAS, which may be slower than float32 on oneDNN), else None."""
    if dtype not in (torch.bfloat16, torch.float16) or onednn_runs(dtype):
        return None
    name = str(dtype).removeprefix("torch.")
    isa = "AVX512-BF16 or AMX" if dtype == torch.bfloat16 else "AVX512-FP16 or AVX-NE-CONVERT"
    return (
        f"--dtype {name}: this CPU lacks {isa}, so oneDNN has no native {name} linear kernels "
        f"and the linear layers run through BLAS instead, which can be slower than float32. "
        f"Remedy: compare with --dtype float32"
    )


def pack_for_cpu(weight: torch.Tensor, kernel: bool = True) -> tuple[str, torch.Tensor | None]:
    """A CPU weight laid out for the fastest kernel that runs it: ("pairs", kiln's bf16 kernel's
    layout) where that kernel runs and `kernel` allows it, else ("onednn", oneDNN's prepacked
    weight, or None where oneDNN cannot run it)."""
    if kernel and pairs_runs(weight):
        return "pairs", pack_pairs(weight)
    return "onednn", prepack_for_cpu(weight)


def prepack_for_cpu(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of an [out, in] weight, or None where oneDNN cannot run it."""
    if not onednn_runs(weight.dtype):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
    except (RuntimeError, AttributeError):
        return None


def _onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    shape = x.shape
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), packed, bias, "none", [], "")
    return y.view(*shape[:-1], y.shape[-1])


# Under torch.compile the packed product is an opaque op (Inductor's own lowering of
# mkldnn._linear_pointwise expects frozen weights and static shapes); kiln's backend lowers
# it to a direct call of the oneDNN op (kiln/compiler/lowerings.py).
_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define("onednn_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor")
_LIB.impl("onednn_linear", _onednn_linear, "CompositeExplicitAutograd")
torch.library.register_fake(
    "kiln::onednn_linear",
    lambda x, packed, bias: x.new_empty(*x.shape[:-1], packed.shape[0]),
    lib=_LIB,
)


def onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return torch.ops.kiln.onednn_linear(x, packed, bias)
    return _onednn_linear(x, packed, bias)
