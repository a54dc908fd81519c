"""Compile kiln's Triton kernels for a Hopper GPU (sm_90) without one: Triton's code generator
down to a cubin with its bundled ptxas. Run by tests/test_triton_backend.py in a child process
(the tests' interpreter mode replaces the code generator):

    python -m tests.triton_cuda_compile fp32|bf16|fp16 [segments]
    python -m tests.triton_cuda_compile gdn fp32|bf16     # the Gated DeltaNet core's kernels
    python -m tests.triton_cuda_compile int4-experts fp32|bf16   # the packed experts' kernel"""

from __future__ import annotations

import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kiln.attention import triton_backend, triton_kernel
from kiln.layers import gdn_triton, moe_triton

# a head dim that is not a power of two exercises the masks; 3 heads per KV head, an idle row
CONSTANTS = {
    "GROUP": 3, "D": 96, "BLOCK_D": 128, "BLOCK_SIZE": 16, "BLOCK_Q": 5, "BLOCK_M": 16,
    "BLOCK_N": triton_backend.KEY_TILE,
    "SEGMENT_TILES": triton_backend.MIN_SEGMENT_KEYS // triton_backend.KEY_TILE,
}  # fmt: skip


def argument_types(dtype: str) -> dict[str, str]:
    tensors = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "k_cache_ptr", "v_cache_ptr")
    types = {name: f"*{dtype}" for name in tensors}
    types |= {"slot_ptr": "*i64", "kv_len_ptr": "*i32", "table_offset_ptr": "*i32"}
    types |= {"tables_ptr": "*i32", "qsl_ptr": "*i32", "scratch_ptr": "*fp32", "ticket_ptr": "*i32"}
    return types | {"scale": "fp32"}  # the rest (strides, n_slots) are i32


def compile_for_hopper(kernel: triton.runtime.JITFunction, dtype: str, segments: int) -> None:
    # the precision the launcher picks: IEEE for float32 (no TF32 rounding of the scores)
    dot_dtype = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}[dtype]
    precision = "ieee" if dtype == "fp32" else "tf32"
    constants = CONSTANTS | {"DOT_DTYPE": dot_dtype, "PRECISION": precision}
    constants["NUM_SEGMENTS"] = segments
    types = argument_types(dtype)
    signature = {
        name: "constexpr" if name in constants else types.get(name, "i32")
        for name in kernel.arg_names
    }
    # what the launcher specializes on: torch's allocations are 16-byte aligned, and every
    # stride is a multiple of 16 for these heads (it vectorizes the loads and lets the key loops
    # prefetch with cp.async, which the unspecialized kernel does not)
    aligned = [i for i, n in enumerate(kernel.arg_names) if n.endswith("_ptr") or "stride" in n]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    if (
        compiled.asm["cubin"][:4] != b"\x7fELF"
        or f".entry {kernel.__name__}" not in compiled.asm["ptx"]
    ):
        raise SystemExit(f"{kernel.__name__}: no cubin/entry point in the compiled output")
    ptx = compiled.asm["ptx"]
    # split-KV's merge: the ticket is an acquire-release atomic at GPU scope after a barrier
    # (the program's partial stores published first), the merging program reads through L2
    merge = ["bar.sync", "atom.global.gpu.acq_rel.add", "ld.global.cg"]
    if segments > 1 and not all(op in ptx for op in merge):
        raise SystemExit(f"split-KV merge: expected {merge} in the PTX")
    if segments == 1 and "atom." in ptx:
        raise SystemExit("an unsplit launch should have no atomics")
    if "cp.async" not in ptx:
        raise SystemExit("the key loops are not pipelined (no cp.async prefetch)")


# Qwen3-Next's Gated DeltaNet shapes: 16 key heads, 32 value heads, 128 dims, kernel 4
_HEADS = {"PER_KEY": 2, "DK": 128, "DV": 128, "BLOCK_K": 128, "UP_TO": 4}
_CHUNKED = _HEADS | {"CHUNK": gdn_triton.CHUNK, "PRECISION": gdn_triton.PRECISION}
GDN_CONSTANTS = {
    gdn_triton.gdn_conv_kernel: {"W": 4, "BLOCK_T": gdn_triton.CONV_TOKENS,
                                 "BLOCK_C": gdn_triton.CONV_CHANNELS},
    gdn_triton.gdn_conv_state_kernel: {"W": 4, "BLOCK_W1": 4,
                                       "BLOCK_C": gdn_triton.CONV_CHANNELS},
    gdn_triton.gdn_rule_kernel: _HEADS | {"BLOCK_V": 32},
    gdn_triton.gdn_chunk_prep_kernel: _CHUNKED | {"BLOCK_DV": 128},
    gdn_triton.gdn_chunk_rule_kernel: _CHUNKED | {"BLOCK_V": gdn_triton.CHAIN_VALUES},
}  # fmt: skip
# launched with more warps: their [CHUNK, 128] tiles
GDN_WARPS = {gdn_triton.gdn_chunk_prep_kernel: gdn_triton.CHUNK_WARPS,
             gdn_triton.gdn_chunk_rule_kernel: gdn_triton.CHUNK_WARPS}  # fmt: skip
# the model dtype's tensors (the rest: float32 scratch, decay, beta and recurrent states)
GDN_MODEL_DTYPE = ("mixed_ptr", "weight_ptr", "conv_states_ptr", "saved_conv_ptr", "out_ptr")


def compile_gdn_for_hopper(kernel: triton.runtime.JITFunction, dtype: str) -> None:
    constants = GDN_CONSTANTS[kernel]
    types = {"q_scale": "fp32"}
    for name in kernel.arg_names:
        if name.endswith("_ptr"):
            meta = name in ("qsl_ptr", "seq_lens_ptr", "slots_ptr", "at_ptr", "entries_ptr",
                            "rows_ptr")  # fmt: skip
            types[name] = "*i32" if meta else f"*{dtype}" if name in GDN_MODEL_DTYPE else "*fp32"
    signature = {n: "constexpr" if n in constants else types.get(n, "i32")
                 for n in kernel.arg_names}  # fmt: skip
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    options = {"num_warps": GDN_WARPS.get(kernel, 4)}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    if compiled.asm["cubin"][:4] != b"\x7fELF":
        raise SystemExit(f"{kernel.__name__}: no cubin in the compiled output")


def compile_int4_experts_for_hopper(dtype: str) -> None:
    """The grouped int4 expert kernel with two planes (Q8_0), as the launcher specializes it."""
    kernel = moe_triton._grouped_int4_kernel
    constants = {"PLANES": 2, "PRECISION": "ieee" if dtype == "fp32" else "tf32",
                 "BLOCK_M": moe_triton.BLOCK_M, "BLOCK_N": moe_triton.BLOCK_N,
                 "BLOCK_K": moe_triton.BLOCK_K}  # fmt: skip
    types = {"rows_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "codes_ptr": "*u8",
             "codes2_ptr": "*u8", "sz_ptr": "*bf16", "sz2_ptr": "*bf16", "tile_expert": "*i32",
             "tile_start": "*i32", "tile_end": "*i32"}  # fmt: skip
    signature = {n: "constexpr" if n in constants else types.get(n, "i32")
                 for n in kernel.arg_names}  # fmt: skip
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    if compiled.asm["cubin"][:4] != b"\x7fELF":
        raise SystemExit(f"{kernel.__name__}: no cubin in the compiled output")


def main() -> None:
    if sys.argv[1] == "int4-experts":
        compile_int4_experts_for_hopper(sys.argv[2])
        print("_grouped_int4_kernel ok")
        return
    if sys.argv[1] == "gdn":
        for kernel in GDN_CONSTANTS:
            compile_gdn_for_hopper(kernel, sys.argv[2])
            print(kernel.__name__, "ok")
        return
    dtype, segments = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
    kernel = triton_kernel.paged_attention_kernel
    compile_for_hopper(kernel, dtype, segments)
    print(kernel.__name__, "ok")


if __name__ == "__main__":
    main()
