"""Building an engine: load the model, resolve the graph plan, measure graph memory, size the KV
cache, warm up (compile) and capture graphs, each a timed and watched boot phase."""
