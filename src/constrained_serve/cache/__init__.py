"""KV page pool and radix prefix cache."""
