"""Speculative decoding, the engine's side: proposers that guess a sequence's next tokens
cheaply (ngram.py), and who speculates in a step and how it went (speculator.py). The
verification that keeps the target model's output exact is the runner's (runner/verify.py)."""
