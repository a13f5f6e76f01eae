"""The router's half of trainer weight sync (the workers' is zpd/worker/weight_sync.py)."""
