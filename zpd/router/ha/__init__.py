"""Several routers over one pool, and a restarted router adopting its predecessor's requests."""
