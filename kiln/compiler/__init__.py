"""torch.compile for kiln's models: the backend that splits Dynamo's graph at the splitting ops
and compiles the pieces (split_backend.py), Dynamo's trace saved in the compile cache
(precompile.py, saved_graph.py), Inductor lowerings of kiln's ops, debug dumps."""
