"""The model runner: a scheduled batch laid out in persistent input buffers, dispatched to a
runtime mode (eager, PIECEWISE or FULL graphs), run through the model, and sampled."""
