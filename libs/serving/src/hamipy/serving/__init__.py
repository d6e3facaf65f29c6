"""What serves HTTP and keeps a hami-py process up (docs/contributing.md).

- ``http_limits``: the timeouts, connection cap and queue every HTTP server of ours runs under
  (``BoundedServer``, ``start_bounded_site``); ``http2``: HTTP/2 on the same bounded connections;
  ``http_metrics``: what the limits did, as Prometheus metrics.
- ``tls``: the serving TLS context (no session tickets).
- ``probes``: the node agents' ``/metrics``, ``/healthz``, ``/readyz`` server.
- ``supervision``: long-lived tasks run by name, one that dies is logged and fails readiness;
  ``serve_until_signal`` for a CLI's main.
- ``heap``: handing the C heap's free pages back to the kernel.
"""
