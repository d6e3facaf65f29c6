"""hami-py wire formats."""
