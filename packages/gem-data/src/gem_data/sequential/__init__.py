"""Sequential recommendation: user histories read from files, next-item training examples, ranking evaluation."""
