"""HTTP serving: the routes, the OpenAI-compatible images API and the uvicorn server."""
