"""hami-py scheduler extender."""
