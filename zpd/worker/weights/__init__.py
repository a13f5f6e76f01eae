"""The worker half of trainer weight sync: groups joined, pushes staged and committed."""
