"""Layer 1, the instruments: memory, allocations, timing, FLOPs, op records, blocks, optimizer
state, and the Tape they produce.
"""
