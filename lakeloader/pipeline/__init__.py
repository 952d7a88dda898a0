"""One pass over an epoch: plan steps ahead, build each batch, deliver in step order.

``iterator`` is the pass, ``collate`` turns a step's rows into the batch the training loop
gets.
"""
