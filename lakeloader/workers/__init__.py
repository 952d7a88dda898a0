"""The DataLoader worker processes: the pool, the worker's side, and the dispatcher.

``pool`` starts workers and replaces the dead, ``process`` is what runs in a worker, and
``dispatch`` hands them work, collects their answers and notices their deaths.
"""
