"""One pass over an epoch: plan steps ahead, build each batch, deliver in step order."""
