"""Speculative decoding pieces: DDTree build (`ddtree`), acceptance (`accept`), and one round (`round`)."""
