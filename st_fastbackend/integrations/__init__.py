"""Adapters for libraries that build their own SentenceTransformer (optional extras; imported on demand)."""
