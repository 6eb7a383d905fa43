"""Model implementations. Model code exposes a block-stack seam and holds no cache logic."""
