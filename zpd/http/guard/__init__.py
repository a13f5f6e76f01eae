"""HTTP hardening: API keys and callers, the browser guard, connection limits."""
