"""gem-trainer."""
