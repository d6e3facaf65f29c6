"""Generated messages (``api_pb2``) and gRPC stubs/servicers (``api_pb2_grpc``) of the kubelet
device plugin API v1beta1. Regenerate with ``make proto`` after editing ``proto/``."""
