"""The decode side of a router restart: a silent router's requests wait for its successor."""
