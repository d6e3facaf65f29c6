"""Generated messages (``api_pb2``) and gRPC stubs/servicers (``api_pb2_grpc``) of the kubelet
PodResources API v1, the part the device plugin reads. Regenerate with ``make proto`` after editing
``proto/``."""
