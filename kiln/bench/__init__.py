"""`kiln bench`: the context benchmark (trial metrics and validity so far)."""
