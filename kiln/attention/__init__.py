from kiln.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionShape,
    GraphSupport,
)
from kiln.attention.layer import Attention
from kiln.attention.torch_backend import TorchPagedAttentionBackend

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionShape",
    "GraphSupport",
    "TorchPagedAttentionBackend",
]
