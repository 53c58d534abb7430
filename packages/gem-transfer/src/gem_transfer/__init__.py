"""gem-transfer."""
