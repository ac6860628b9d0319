"""OpenAI's wire format: request and response bodies, and tool calls; the server and batch jobs share it."""
