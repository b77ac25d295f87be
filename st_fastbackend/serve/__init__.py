"""The HTTP server: OpenAI, text-embeddings-inference and Cohere routes, rerank for a cross-encoder, with dynamic
batching (FastAPI + uvicorn)."""
