"""Decoded units of one rank: decoded once, packed into a shared arena, evicted once used."""
