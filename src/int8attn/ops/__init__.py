"""Launchers: validate inputs (int8attn._checks), pick grid and config, accept out=."""
