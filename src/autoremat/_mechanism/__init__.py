"""Layer 1, the mechanism: checkpoint wrappers, segment hooks and selective modes. Knows no Plan."""
