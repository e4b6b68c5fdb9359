"""Layer 2, the mechanism: checkpoint wrappers, segment hooks and selective modes. Knows no Plan."""
