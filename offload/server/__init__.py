"""The OpenAI-compatible endpoint: `offload serve`. front.py steps the engine core in a thread for asyncio callers,
app.py the routes, sse.py the streamed answers, batches.py the Batch API, sglang_routes.py SGLang's native API,
metrics.py /metrics, run.py uvicorn with a draining shutdown, settings.py what `offload serve`'s flags set. OpenAI's
wire format is offload/openai/protocol.py (below this package and the batch jobs), SGLang's is offload/sglang/."""
