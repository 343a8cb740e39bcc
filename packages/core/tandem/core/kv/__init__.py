"""KV-cache accounting (block pool, prefix cache) and KV tensor allocation."""
