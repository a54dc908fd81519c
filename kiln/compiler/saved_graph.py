"""What a saved Dynamo trace (precompile.py) keeps of kiln's backend: Dynamo's graph. Its own
module because torch pickles the class by name and imports it to load a trace, and because
importing it imports Dynamo (0.9 s), which an eager engine never needs."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import sympy
import torch
from torch._dynamo.aot_compile_types import SerializableCallable
from torch._subclasses import FakeTensorMode
from torch.fx._graph_pickler import GraphPickler, Options

from kiln.compiler.split_backend import SplitBackend
from kiln.errors import KilnError


class KilnGraphPickler(GraphPickler):
    """GraphPickler, plus the two things Dynamo's graph holds that it refuses: the fake mode
    that a view's base tensor refers to (the unpickler gives every fake tensor its own), and
    sympy functions of symbolic shapes, pickled by name."""

    def reducer_override(self, obj: object) -> Any:
        if inspect.isclass(obj) and issubclass(obj, sympy.Function):
            unpickler = getattr(obj, "_torch_unpickler", None)
            if unpickler is not None:
                return unpickler, (obj._torch_handler_name,)
        if isinstance(obj, FakeTensorMode):
            return type(None), ()
        return super().reducer_override(obj)


class SavedGraph(SerializableCallable):
    """Dynamo's graph, with the traced value of each node (kiln's backend compiles the pieces
    from them, and AOTAutograd's cache key covers them). The backend given by `bind` compiles
    it at the first call: a number among the graph's inputs is compiled as that call passes it,
    as Dynamo passes numbers to a backend (a float traced as an unbacked SymFloat is what
    kiln's attention op cannot take; backend.py's `_graph_inputs`)."""

    def __init__(self, graph: torch.fx.GraphModule) -> None:
        self.graph = graph
        self.backend: SplitBackend | None = None
        self.compiled: Callable | None = None

    def bind(self, backend: SplitBackend) -> None:
        self.backend = backend

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            self.compiled = self._compile(args)
        return self.compiled(*args)

    def _compile(self, args: tuple) -> Callable:
        from torch._guards import TracingContext, detect_fake_mode, tracing

        if self.backend is None:
            raise KilnError("a saved Dynamo trace ran before kiln's backend was bound to it")
        placeholders = self.graph.graph.find_nodes(op="placeholder")
        inputs = [
            node.meta.get("example_value", arg) if isinstance(arg, torch.Tensor) else arg
            for node, arg in zip(placeholders, args, strict=True)
        ]
        with tracing(TracingContext(detect_fake_mode(inputs))):
            return self.backend(self.graph, inputs)

    @classmethod
    def serialize_compile_artifacts(cls, fn: SavedGraph) -> bytes:
        for node in fn.graph.graph.nodes:  # source stacks are a third of the file, unread
            value = node.meta.get("example_value")
            node.meta.clear()
            if value is not None:
                node.meta["example_value"] = value
        return KilnGraphPickler.dumps(fn.graph, Options(ops_filter=None))

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> SavedGraph:
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        return cls(GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv())))
