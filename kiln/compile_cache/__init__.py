"""The compile cache: one directory per configuration, keyed by everything that changes compiled
artifacts, sealed with a checksummed manifest and locked while a process compiles into it."""
