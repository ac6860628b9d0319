"""SGLang's native wire format (sglang 0.4.10's POST /generate): the request checked strictly and turned into the
engine's SamplingParams (sglang_request.py), and the replies in SGLang's shape, whole or streamed
(sglang_reply.py). The routes that speak it are offload/server/sglang_routes.py."""
