"""zpd: prefill/decode disaggregated LLM serving.

The control plane lives here (messages, sockets, schedulers, router, client, CLI);
the model engine is `engines`, KV movement is `transport`.
"""
__version__ = "0.1.0"
