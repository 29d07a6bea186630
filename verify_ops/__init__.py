"""Reference implementations of the spec-hal op contract, in plain torch.

One file per op, the same file and function names as every backend. The cpu
backend runs these; the conformance suite uses them as the oracle.
"""
