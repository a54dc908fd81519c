"""CUDA graphs: how a graph is captured and replayed (on a GPU, or emulated on the CPU for
tests), the FULL and PIECEWISE graph sets a runner replays, and the per-step dispatcher that
maps a batch to a runtime mode."""
