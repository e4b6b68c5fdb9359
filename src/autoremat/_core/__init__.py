"""Layer 0, the base: errors, units, the training step, RNG, tables, ranks, the chunked head's
numerics, JSON and file helpers.
"""
