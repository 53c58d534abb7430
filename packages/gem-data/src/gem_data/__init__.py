"""gem-data."""
