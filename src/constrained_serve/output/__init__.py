"""Finished requests turned into what users read: Results, partial objects, confidence, spans, display."""
