"""Peer baselines: what the engine's benchmarks train, trained the way a user of another system would
(`python -m bench.peers.<script>` from the repository root; bench/peers/README.md)."""
