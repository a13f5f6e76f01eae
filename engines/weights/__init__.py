"""Trainer weight pushes: staging a push in a shadow copy of the weights and committing it."""
