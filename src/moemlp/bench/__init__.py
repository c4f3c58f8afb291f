"""The command line's jobs: bench (speed against the torch peer) and precision (the contract)."""
