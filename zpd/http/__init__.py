"""`zpd http`: SGLang's native routes and OpenAI's, served over HTTP by a client of the
router. It holds no request state the router does not: each route checks its body
into the project's own records (records.py, openai_protocol.py), makes its calls on
the asyncio router client (router_client.py) and formats the answer (native.py,
admin_routes.py, openai_format.py); app.py guards the routes with the API keys and
answers every error in OpenAI's shape; zpd/ops/serve.py starts it all."""
