"""The OpenAI-compatible HTTP server (``constrained-serve serve``). Needs FastAPI and uvicorn
(``pip install constrained-serve[serve]``)."""
