"""Declared image sets: kept present (and pinned when asked), reconciling only the difference.

Import from the modules (manager.ImageSets, loader.parse_text): importing the package stays
light, so the YAML parser process (parse_process.py) loads only the loader.
"""
