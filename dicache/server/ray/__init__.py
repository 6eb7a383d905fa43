"""`dicache serve` on Ray Serve (the optional `dicache[ray]` extra)."""
