"""hami-py device plugin."""
