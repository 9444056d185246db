"""`quickdraft serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one LLM.

- protocol.py: request and response bodies (pydantic), the error body;
- async_engine.py: the scheduler on its own thread, driven from the event loop;
- serving.py: completions and chat completions, whole or streamed (SSE);
- metrics.py: Prometheus metrics with vLLM's names;
- app.py: the routes, authentication, body limit, errors; launch.py: uvicorn with a graceful drain.
"""

from quickdraft.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
