"""The kubelet device plugin API v1beta1 (gRPC stubs shared by the device plugin and the kubelet stand-in)."""
