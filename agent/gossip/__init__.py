"""Gossip between agents: SWIM membership with Lifeguard (pure) and its gRPC transport."""
