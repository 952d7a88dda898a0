"""What a lake is: its data files, their frozen description, one schema, the manifest."""
