"""The reader state: where the training loop stands (versioned), and the units skipped for good."""
