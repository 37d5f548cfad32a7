"""Inter-process messages (msgspec over ZeroMQ) and stage-to-stage tensors (torch.distributed P2P)."""
