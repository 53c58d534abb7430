"""gem-parallel."""
