"""hami-py node monitor: per-container GPU limits and use for Prometheus, and the priority feedback.

Runs on every GPU node (``hamipy-monitor``). Modules, the I/O ones marked (io):

- ``cli``: the entry point (wiring only); ``settings``: its settings; ``errors``: the exception tree.
- ``monitor``: one running monitor: the pod watch, the scrape, the housekeeping pass, HTTP, its
  background tasks under one supervisor.
- ``pod_cache`` (io): this node's pods by list+watch (``hamipy.kube``'s informer);
  ``pods``: a pod reduced to what the monitor needs, its allocation and MIG annotations decoded.
- ``region_files`` (io): the region files of the node's containers, read without ``mmap``;
  ``region_dirs``: what their directory names and decoding errors mean.
- ``host_gpus`` (io): host GPU use from NVML, MIG instances included; ``gpu_samples``: its records.
- ``usage``: the join of allocations and regions into per-device rows; ``mig_info``: the container
  devices on MIG instances; ``collector``: the metrics.
- ``feedback``: the priority rule written into the regions.
"""
