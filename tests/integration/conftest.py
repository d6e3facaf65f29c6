"""Integration tests share ``stack_support`` (our services started against the devcluster).

pytest puts this directory on ``sys.path`` when it loads this conftest (rootdir-relative "prepend"
import mode), which is what makes ``import stack_support`` work from every test folder below.
"""
