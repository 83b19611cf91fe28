"""The HTTP/2 frame relay: the fast passthrough engine (see connection.py)."""
