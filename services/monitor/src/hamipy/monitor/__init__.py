"""hami-py node monitor."""
