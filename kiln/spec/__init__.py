"""Speculative decoding: proposers that guess a sequence's next tokens cheaply (ngram.py), the
verification that keeps the target model's output exact (verify.py), and the engine's side of
it (speculator.py: who speculates in a step, and the acceptance statistics)."""
