"""The recovery coordinator: a saved position onto the lake of now; dead workers' work."""
