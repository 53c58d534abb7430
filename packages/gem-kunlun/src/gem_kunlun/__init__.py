"""gem-kunlun."""
