"""Layer 3, plan: the cost model, keep-sets, the peak model and the solvers; pure functions
from a Tape and a budget to a Plan.
"""
