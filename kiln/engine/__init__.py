"""The engine loop and what it owns: requests in, one scheduled batch per step, outputs out
(llm_engine.py), the scheduler, the block manager (paged KV blocks and the prefix cache), the
sequences and requests, and turning sampled tokens into outputs (output_processor.py,
detokenizer.py). The engine is built by kiln.boot and runs a model through kiln.runner."""
