"""hami-py admission webhook."""
