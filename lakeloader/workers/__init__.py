"""The DataLoader worker processes: the pool, the worker's side, and the dispatcher."""
