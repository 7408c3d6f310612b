"""The Envoy External Processor (ext_proc) gRPC service: Envoy's way into kvgate's decision."""
