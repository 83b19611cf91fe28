"""The node's pins from image sets: the ledger (ledger.py), the one record of which set pins
which images, and its index by image (declared_pins.py). Light to import: the process loads
the ledger before serving whether image sets are configured or not.
"""
