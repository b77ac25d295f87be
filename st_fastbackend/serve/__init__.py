"""OpenAI-compatible /v1/embeddings server with dynamic batching (FastAPI + uvicorn)."""
