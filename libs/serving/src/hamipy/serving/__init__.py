"""What serves HTTP and keeps a hami-py process up: bounded HTTP/1.1 and HTTP/2 servers
(``http_limits``, ``connection_cap``, ``http2``, ``http_metrics``), TLS (``tls``), the probe server
(``probes``), task supervision (``supervision``) and heap trimming (``heap``); docs/contributing.md
says which room holds what."""
