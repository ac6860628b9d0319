"""The OpenAI-compatible endpoint: `offload serve`. front.py steps the engine core in a thread for asyncio callers,
protocol.py is OpenAI's wire format, app.py the routes, sse.py the streamed answers, metrics.py /metrics, run.py
uvicorn with a draining shutdown."""
