"""Peer chunk sharing: which node caches which chunk, advertised by gossip and served over gRPC."""
