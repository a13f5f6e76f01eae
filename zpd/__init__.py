"""zpd: prefill/decode disaggregated LLM serving.

The control plane lives here (messages, sockets, schedulers, router, client, CLI);
the model engine is `engines`, KV movement is `transport`.
"""
__version__ = "0.1.0"


def __getattr__(name: str):
    # `zpd.Client` without importing zmq for users of the engine alone
    if name == "Client":
        from zpd.client import Client
        return Client
    if name == "client_curve":
        from zpd.wire.security import client_curve
        return client_curve
    raise AttributeError(f"module 'zpd' has no attribute {name!r}")
