"""The checkpoint manager: the reader state serialised at sync barriers under one URL."""
